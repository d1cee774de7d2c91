"""Which device's implementations an operator call may take: Triton or not (issue 13's dispatch).

This module is the leaf the families' ``dispatch.py`` consult; the report of what each piece runs
(``dsattn bench --which``) lives above the families, in :mod:`dsattn.which`.

``DSATTN_BACKEND`` (read at each call): ``torch`` forces the vectorised PyTorch path; ``triton`` forces
the Triton kernels where an operator has them (on a CPU tensor they run under Triton's
interpreter, ``TRITON_INTERPRET=1``: the way the kernels are tested without a GPU); unset or ``auto``: Triton on CUDA
tensors when ``triton`` imports, PyTorch otherwise.  Inputs a kernel does not cover (packed
caches, float64, ...) always take the PyTorch path.
"""
from __future__ import annotations

import functools
import os

import torch

CHOICES = ("auto", "torch", "triton")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401  (the import is the test)
    except Exception:                         # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def requested() -> str:
    v = os.environ.get("DSATTN_BACKEND", "auto").strip().lower() or "auto"
    if v not in CHOICES:
        raise ValueError(f"DSATTN_BACKEND: value {v!r} is not one of {list(CHOICES)}")
    return v


def use_triton(device: torch.device) -> bool:
    """Whether the Triton kernels should run for tensors on ``device``."""
    choice = requested()
    if choice == "torch" or (choice == "auto" and device.type != "cuda"):
        return False                          # (no triton import on the default CPU path)
    if not triton_available():
        if choice == "triton" and not triton_available():
            raise RuntimeError("DSATTN_BACKEND=triton but triton is not importable; pip install 'dsattn[gpu]'")
        return False
    if choice == "triton":
        if device.type == "cpu" and not interpreting():
            raise RuntimeError("DSATTN_BACKEND=triton on CPU tensors needs Triton's interpreter: set "
                               "TRITON_INTERPRET=1 before the first import of triton")
        return device.type in ("cuda", "cpu")
    return device.type == "cuda"


def interpreting() -> bool:
    """Triton's interpreter mode (``TRITON_INTERPRET=1``, fixed when triton is first imported)."""
    from triton import knobs
    return bool(knobs.runtime.interpret)
