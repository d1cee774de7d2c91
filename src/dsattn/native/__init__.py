"""The compiled kernel layer (issue 15): C++ built on first use with ``torch.utils.cpp_extension``.

Why a build on first use rather than at ``pip install``: the extension is compiled against the
torch that is actually imported (a wheel built against another torch version would not load), it
needs no build-time torch in pip's isolated build environment, and the package installs on a
machine without a compiler.  The build takes ~30-60 s once; the result is cached under
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) in a directory keyed by the sources,
the flags, the compiler and the torch version; concurrent processes wait on one build under a lock
that dies with its holder, and a killed build is never loaded (:mod:`dsattn.native.build`).

``DSATTN_NATIVE=0`` skips it (the PyTorch / NumPy paths run); if the build fails (no compiler,
no ninja) one ``RuntimeWarning`` says so and the same fallback runs.  :func:`status` says which
path is active (``dsattn bench --which``).

The GEMMs run on half-precision operands where the CPU multiplies them natively: AMX (oneDNN's
ukernel, bf16 and fp16), else AVX512-BF16 (bf16: dsattn's register-tiled vdpbf16ps micro-kernel, or
oneDNN's avx512_core_bf16 ukernel where a timing of both on the attention's shapes finds it over 10 %
faster), else on fp32 operands (AVX2, AVX-512F), decided once per process.
``DSATTN_NATIVE_GEMM=fp32``, ``=avx512bf16`` or ``=onednn`` (or :func:`gemm_path` for a block) forces
a path on any CPU that has it: the paths other machines take, tested and timed on one that has more.
``DSATTN_CPU_ISA`` (:mod:`dsattn.native.isa`) caps the whole layer at a smaller CPU class: its GEMM path,
decoders, head sums and vector loops all run as that class's would.
"""
from __future__ import annotations

import contextlib
import os
import warnings

_SOURCES = ("module.cpp", "planner.cpp", "attention.cpp", "indexer.cpp", "compressor.cpp", "paged.cpp", "matmul.cpp", "sharedkv.cpp", "flashmla.cpp", "kv_quant.cpp")
_HEADERS = ("attention.h", "common.h", "fp8.h", "gemm.h", "isa.h", "keys.h")
_state: dict = {}


def requested() -> bool:
    """False when ``DSATTN_NATIVE=0`` (force the PyTorch / NumPy paths)."""
    return os.environ.get("DSATTN_NATIVE", "1").strip() not in ("0", "false", "off", "no")


# -fopenmp: at::parallel_for is a header template whose OpenMP pragma is compiled here (without
# the flag the rows would run on one thread); torch itself links the same libgomp.
_CFLAGS = ["-O3", "-std=c++17", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]


def _paths(names) -> list[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    return [os.path.join(here, s) for s in names]


@contextlib.contextmanager
def suspended():
    """Within the block :func:`load` returns None, so every piece takes its PyTorch / NumPy path
    (benchmarks put the two side by side in one run; tests compare them)."""
    _state["suspended"] = _state.get("suspended", 0) + 1
    try:
        yield
    finally:
        _state["suspended"] -= 1


_GEMM_PATHS = ("best", "avx512bf16", "onednn", "fp32")


@contextlib.contextmanager
def gemm_path(path: str):
    """Within the block the compiled kernels run the GEMM path ``path``: ``"fp32"`` (the one AVX2-only
    CPUs take), ``"avx512bf16"`` (the vdpbf16ps micro-kernel, on a CPU that has it), ``"onednn"``
    (oneDNN's avx512_core_bf16 ukernel, on an AVX512-BF16 CPU without AMX) or ``"best"``;
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


def fp32_gemm():
    """:func:`gemm_path` ``("fp32")``."""
    return gemm_path("fp32")


def gemm_requested() -> str:
    """``DSATTN_NATIVE_GEMM``: ``fp32``, ``avx512bf16`` or ``onednn`` forces that GEMM path; unset (or
    empty) leaves the CPU's best (``"best"``)."""
    value = os.environ.get("DSATTN_NATIVE_GEMM", "").strip().lower() or "best"
    if value not in _GEMM_PATHS:
        raise ValueError(f"DSATTN_NATIVE_GEMM: expected 'fp32', 'avx512bf16', 'onednn' or unset, got {value!r}")
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
    try:
        module, _ = build_and_load("dsattn_native", _paths(_SOURCES), _paths(_HEADERS), _CFLAGS, _LDFLAGS,
                                   announce="dsattn: building the compiled kernel layer (once per version of "
                                            "its sources, torch and compiler; about a minute)...")
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
    """A C++ compiler cpp_extension would use (``CXX``, else ``c++``) is on the PATH."""
    import shutil
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def status() -> str:
    """One line: which path the native-capable pieces take."""
    if not requested():
        return "native: off (DSATTN_NATIVE=0): PyTorch / NumPy paths"
    if _state.get("suspended"):
        return "native: suspended (dsattn.native.suspended()): PyTorch / NumPy paths"
    module = load()
    if module is None:
        return f"native: unavailable ({_state.get('error')}): PyTorch / NumPy paths"
    return ("native: loaded (C++ planner, CPU attention forward and backward, CPU indexer, CPU compressor pooling); "
            f"running as CPU class {module.cpu_isa()}" + (f" (capped; the CPU's own: {module.cpu_isa_own()})"
                                                          if module.cpu_isa() != module.cpu_isa_own() else ""))
