"""The backend choice every operator family makes (its ``dispatch.py``): backends in order, each with a
``name`` and ``reasons(...)`` (why it does not take a call; empty when it does), the first that takes
the call runs it."""
from __future__ import annotations

from collections.abc import Callable

import torch


class TakesEverything:
    """Base of a family's last backend (the vectorised PyTorch path): it takes every call."""
    name = "torch"

    @staticmethod
    def reasons(*args, **kwargs) -> list[str]:
        return []


def choose(backends, *args, **kwargs) -> type:
    """The first backend without reasons for these arguments."""
    return next(b for b in backends if not b.reasons(*args, **kwargs))


def explain(backends, *args, **kwargs) -> list[tuple[str, list[str]]]:
    """``(name, reasons)`` of every backend, in order."""
    return [(b.name, b.reasons(*args, **kwargs)) for b in backends]


def triton_reasons(device: torch.device, covers: Callable[[], bool], check: str) -> list[str]:
    """A Triton backend's reasons: the device does not run Triton, or ``covers()`` (the kernel's own
    test, named ``check``; called only where Triton runs, so triton is imported only there) says no."""
    from ..backend import use_triton
    if not use_triton(device):
        return [f"{device.type} tensors do not run Triton (DSATTN_BACKEND and the device decide)"]
    return [] if covers() else [f"the kernel does not cover this call ({check})"]


def compiled_reasons(q: torch.Tensor, dtypes: tuple, *extra: str) -> list[str]:
    """A compiled CPU backend's reasons when it declined a call: the query's device or dtype, the
    backend's own ``extra`` reasons, or else the compiled layer's status (not built, turned off)."""
    why = [f"not a CPU tensor ({q.device.type})"] if q.device.type != "cpu" else []
    if q.dtype not in dtypes:
        why.append(f"query dtype {q.dtype} (it takes {', '.join(str(d).split('.')[-1] for d in dtypes)})")
    why += [x for x in extra if x]
    if not why:
        from .. import native
        why.append(native.status())
    return why
