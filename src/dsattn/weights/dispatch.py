"""Which implementation runs the quantised linears (``fp8_block_linear``, ``mxfp4_linear``): the compiled CPU
kernel, else the PyTorch path."""
from __future__ import annotations

from ..common import dispatch
from ..common.dispatch import TakesEverything
from . import fast
from .problem import ACT_DTYPES, QuantLinearProblem


class Compiled:
    name = "compiled"

    @staticmethod
    def reasons(P: QuantLinearProblem) -> list[str]:
        if fast.native_module(P) is not None:
            return []
        block = f"block_k {P.bk} is not a multiple of 16" if P.bk % 16 else ""
        return dispatch.compiled_reasons(P.x, ACT_DTYPES, block)

    linear = staticmethod(fast.linear_native)


class Torch(TakesEverything):
    linear = staticmethod(fast.linear_torch)


BACKENDS = (Compiled, Torch)


def choose(P: QuantLinearProblem) -> type:
    return dispatch.choose(BACKENDS, P)


def explain(P: QuantLinearProblem) -> list[tuple[str, list[str]]]:
    return dispatch.explain(BACKENDS, P)
