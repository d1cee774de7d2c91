"""The backend choice every operator family makes (its ``dispatch.py``): backends in order, each with a
``name`` and ``reasons(...)`` (why it does not take a call; empty when it does), the first that takes
the call runs it."""
from __future__ import annotations


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
