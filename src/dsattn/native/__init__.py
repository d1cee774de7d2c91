"""The compiled kernel layer (issue 15): C++ built on first use with ``torch.utils.cpp_extension``.

Why a build on first use rather than at ``pip install``: the extension is compiled against the
torch that is actually imported (a wheel built against another torch version would not load), it
needs no build-time torch in pip's isolated build environment, and the package installs on a
machine without a compiler.  The build takes ~30-60 s once; the result is cached under
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), keyed by the sources, the flags
and the torch version, and concurrent processes wait on one build (cpp_extension's file lock).

``DSATTN_NATIVE=0`` skips it (the PyTorch / NumPy paths run); if the build fails (no compiler,
no ninja) one ``RuntimeWarning`` says so and the same fallback runs.  :func:`status` says which
path is active (``dsattn bench --which``).
"""
from __future__ import annotations

import os
import re
import sys
import warnings

_SOURCES = ("module.cpp", "planner.cpp")
_state: dict = {}


def requested() -> bool:
    """False when ``DSATTN_NATIVE=0`` (force the PyTorch / NumPy paths)."""
    return os.environ.get("DSATTN_NATIVE", "1").strip() not in ("0", "false", "off", "no")


def load():
    """The extension module, or None (not requested, or the build failed: warned once)."""
    if not requested():
        return None
    if "module" in _state:
        return _state["module"]
    import torch
    from torch.utils import cpp_extension
    here = os.path.dirname(os.path.abspath(__file__))
    name = "dsattn_native_" + re.sub(r"\W", "_", torch.__version__)
    try:
        if not os.path.exists(os.path.join(cpp_extension._get_build_directory(name, False), f"{name}.so")):
            print("dsattn: building the compiled kernel layer (once per torch version, about a minute)...",
                  file=sys.stderr, flush=True)
        module = cpp_extension.load(name=name, sources=[os.path.join(here, s) for s in _SOURCES],
                                    extra_cflags=["-O3", "-std=c++17"], verbose=False)
        _state.update(module=module, error=None)
    except Exception as exc:                        # no compiler / ninja, or a build error
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        _state.update(module=None, error=f"{type(exc).__name__}: {first}")
        warnings.warn(f"dsattn: the compiled kernel layer could not be built ({_state['error']}); the PyTorch / "
                      "NumPy paths run instead (set DSATTN_NATIVE=0 to skip the build)", RuntimeWarning,
                      stacklevel=2)
    return _state["module"]


def compiler_available() -> bool:
    """A C++ compiler cpp_extension would use (``CXX``, else ``c++``) is on the PATH."""
    import shutil
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def status() -> str:
    """One line: which path the native-capable pieces take."""
    if not requested():
        return "native: off (DSATTN_NATIVE=0): PyTorch / NumPy paths"
    module = load()
    if module is None:
        return f"native: unavailable ({_state.get('error')}): PyTorch / NumPy paths"
    return "native: loaded (C++ planner)"
