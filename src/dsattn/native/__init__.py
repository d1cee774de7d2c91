"""The compiled kernel layer (issue 15): C++ shipped built in the wheel, or built on first use.

A wheel (``pip wheel .`` / ``pip install .``: ``setup.py``) holds the layer as ``dsattn/_native``, built against
one torch minor version, with ``_native_build.json`` beside it (that torch, and a key of the sources it was built
from).  :func:`load` imports it where the running torch and the installed sources match, with no compiler needed
and no build.  Otherwise (a source checkout, an edited one, another torch) the layer is built on first use with
``torch.utils.cpp_extension`` (a C++ compiler and ninja needed; a few minutes, said on stderr before it starts),
cached under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) in a directory keyed by the
sources, the flags, the compiler and the torch version; concurrent processes wait on one build under a lock that
dies with its holder, and a killed build is never loaded (:mod:`dsattn.native.build`).  Where the wheel's
module cannot be used, one ``RuntimeWarning`` names why (the two torch versions, or the import error).

``DSATTN_NATIVE=0`` skips the layer (the PyTorch / NumPy paths run); if the build fails (no compiler,
no ninja) one ``RuntimeWarning`` says so and the same fallback runs.  :func:`status` says which
path is active and where the module came from (``dsattn bench --which``).

The GEMMs run on half-precision operands where the CPU multiplies them natively: AMX (oneDNN's
ukernel, bf16 and fp16), else AVX512-BF16 (bf16: dsattn's register-tiled vdpbf16ps micro-kernel, or
oneDNN's avx512_core_bf16 ukernel where a timing of both on the attention's shapes finds it over 10 %
faster), else on fp32 operands (AVX2, AVX-512F), decided once per process.
``DSATTN_NATIVE_GEMM=fp32``, ``=avx512bf16`` or ``=onednn`` (or :func:`gemm_path` for a block) forces
a path on any CPU that has it: the paths other machines take, tested and timed on one that has more.

Batch invariance (a request's bits the same alone as in any batch, on any thread count) holds on dsattn's
own GEMMs only: the fp32 GEMM and the vdpbf16ps micro-kernel, which sum each element over K in one order
whatever the shapes and the threads.  AMX and the ``onednn`` path are oneDNN's kernels, chosen by CPU, shape
and ISA cap: no invariance is promised there (:func:`gemm_is_own`).  ``DSATTN_NATIVE_GEMM=own`` runs dsattn's
own kernels only (bf16 on the micro-kernel where the CPU has AVX512-BF16, everything else fp32).
``DSATTN_CPU_ISA`` (:mod:`dsattn.native.isa`) caps the whole layer at a smaller CPU class: its GEMM path,
decoders, head sums and vector loops all run as that class's would.
"""
from __future__ import annotations

import contextlib
import os
import warnings

from .sources import BUILD_INFO, CFLAGS, HEADERS, LDFLAGS, SOURCES, paths, sources_key

_state: dict = {}


def requested() -> bool:
    """False when ``DSATTN_NATIVE=0`` (force the PyTorch / NumPy paths)."""
    return os.environ.get("DSATTN_NATIVE", "1").strip() not in ("0", "false", "off", "no")


def prebuilt_info() -> dict | None:
    """``_native_build.json`` of the wheel's module (the torch it was built against, its sources' key), or None
    where this install holds no built module."""
    import json
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), BUILD_INFO)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _load_prebuilt():
    """The wheel's module, or None with the reason in ``_state["prebuilt"]`` (said once, as a warning, where the
    module exists but cannot serve: another torch, or an import error)."""
    info = prebuilt_info()
    if info is None:
        _state["prebuilt"] = "no compiled layer installed"
        return None
    import torch
    if info.get("torch") != torch.__version__:
        why = (f"the installed compiled layer was built for torch {info.get('torch')}, and this is torch "
               f"{torch.__version__}")
    elif info.get("sources_key") != sources_key():
        _state["prebuilt"] = "the sources differ from the installed compiled layer's (an edited checkout)"
        return None
    else:
        try:
            from .. import _native
            _state.update(prebuilt=f"the wheel's module ({_native.__file__})", from_wheel=True)
            return _native
        except (ImportError, OSError) as exc:
            why = f"the installed compiled layer (torch {info.get('torch')}) does not load: {exc}"
    _state["prebuilt"] = why
    _state["no_build"] = not compiler_available()
    then = ("no C++ compiler to build it for this torch: the PyTorch / NumPy paths run" if _state["no_build"] else
            "building it for this torch on first use (a few minutes)")
    warnings.warn(f"dsattn: {why}; {then}", RuntimeWarning, stacklevel=3)
    return None


@contextlib.contextmanager
def suspended():
    """Within the block :func:`load` returns None, so every piece takes its PyTorch / NumPy path
    (benchmarks put the two side by side in one run; tests compare them)."""
    _state["suspended"] = _state.get("suspended", 0) + 1
    try:
        yield
    finally:
        _state["suspended"] -= 1


_GEMM_PATHS = ("best", "own", "avx512bf16", "onednn", "fp32")


@contextlib.contextmanager
def gemm_path(path: str):
    """Within the block the compiled kernels run the GEMM path ``path``: ``"fp32"`` (the one AVX2-only
    CPUs take), ``"avx512bf16"`` (the vdpbf16ps micro-kernel, on a CPU that has it), ``"onednn"``
    (oneDNN's avx512_core_bf16 ukernel, on an AVX512-BF16 CPU without AMX), ``"own"`` (dsattn's own
    kernels only: the batch-invariant paths) or ``"best"``;
    afterwards ``DSATTN_NATIVE_GEMM``'s choice again.  No effect without the compiled layer."""
    if path not in _GEMM_PATHS:
        raise ValueError(f"gemm_path: expected one of {_GEMM_PATHS}, got {path!r}")
    module = load()
    if module is None:
        yield
        return
    module.set_gemm_path(path)
    try:
        yield
    finally:
        module.set_gemm_path(gemm_requested())


def gemm_is_own(dtype) -> bool:
    """Whether the compiled kernels' GEMMs for ``dtype`` (a torch dtype or its name) run on dsattn's own code, where
    batch invariance is promised, under the path now in force; False on oneDNN's (AMX, ``onednn``) and without
    the compiled layer."""
    module = load()
    name = str(dtype).replace("torch.", "")
    return module is not None and module.gemm_is_own(name)


def fp32_gemm():
    """:func:`gemm_path` ``("fp32")``."""
    return gemm_path("fp32")


def gemm_requested() -> str:
    """``DSATTN_NATIVE_GEMM``: ``fp32``, ``avx512bf16`` or ``onednn`` forces that GEMM path, ``own`` dsattn's
    own kernels only; unset (or empty) leaves the CPU's best (``"best"``)."""
    value = os.environ.get("DSATTN_NATIVE_GEMM", "").strip().lower() or "best"
    if value not in _GEMM_PATHS:
        raise ValueError(f"DSATTN_NATIVE_GEMM: expected 'own', 'fp32', 'avx512bf16', 'onednn' or unset, "
                         f"got {value!r}")
    return value


def fp32_requested() -> bool:
    return gemm_requested() == "fp32"


def load():
    """The extension module, or None (not requested, suspended, or the build failed: warned once)."""
    if not requested() or _state.get("suspended"):
        return None
    if "module" in _state:
        return _state["module"]
    from . import isa
    from .build import build_and_load
    gemm = gemm_requested()                          # (a bad value is the caller's error, not a build failure)
    isa.requested()                                  # (likewise DSATTN_CPU_ISA's)
    module = _load_prebuilt()
    if module is None and _state.get("no_build"):  # (said once, by _load_prebuilt)
        _state.update(module=None, error=_state["prebuilt"])
        return None
    try:
        if module is None:
            module, _ = build_and_load("dsattn_native", paths(SOURCES), paths(HEADERS), list(CFLAGS), list(LDFLAGS),
                                       announce="dsattn: building the compiled kernel layer (" + _state["prebuilt"]
                                                + "; once per version of its sources, torch and compiler: 3-5 "
                                                  "minutes on two cores)...")
        _state.update(module=module, error=None)
    except Exception as exc:                        # no compiler / ninja, or a build error
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        _state.update(module=None, error=f"{type(exc).__name__}: {first}")
        warnings.warn(f"dsattn: the compiled kernel layer could not be built ({_state['error']}); the PyTorch / "
                      "NumPy paths run instead (set DSATTN_NATIVE=0 to skip the build)", RuntimeWarning,
                      stacklevel=2)
    if _state["module"] is not None and not _state.get("gemm_set"):
        _state["module"].set_gemm_path(gemm)        # ValueError where the CPU lacks the forced path
        _state["gemm_set"] = True
    return _state["module"]


def kernels():
    """The module where its attention / indexer kernels exist (the torch it was built against exports
    the batch-reduce GEMM they run on), else None."""
    module = load()
    return module if module is not None and module.kernels_available() else None


def compiler_available() -> bool:
    """A C++ compiler cpp_extension would use (``CXX``, else ``c++``) is on the PATH and answers ``--version``."""
    import shutil
    import subprocess
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        return False
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, timeout=30,
                              stdin=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def status() -> str:
    """One line: which path the native-capable pieces take."""
    if not requested():
        return "native: off (DSATTN_NATIVE=0): PyTorch / NumPy paths"
    if _state.get("suspended"):
        return "native: suspended (dsattn.native.suspended()): PyTorch / NumPy paths"
    module = load()
    if module is None:
        return f"native: unavailable ({_state.get('error')}): PyTorch / NumPy paths"
    origin = _state["prebuilt"] if _state.get("from_wheel") else "built on first use"
    return ("native: loaded (C++ planner, CPU attention forward and backward, CPU indexer, CPU compressor pooling; "
            f"{origin}); running as CPU class {module.cpu_isa()}" + (f" (capped; the CPU's own: {module.cpu_isa_own()})"
                                                          if module.cpu_isa() != module.cpu_isa_own() else ""))
