"""Which implementation runs ``kv_quant_sparse_flash_attention``: the one place that decides.

Each backend says why it does not take a call (``reasons(P)``, empty when it does); the first that
takes it runs: Triton (CUDA tensors), the compiled CPU kernel (packed tokens decoded as they are
gathered), the vectorised PyTorch path.  Backends never import each other: the candidate tokens
they all start from are :func:`dsattn.kv_quant_attn.problem.candidate_tokens`.
"""
from __future__ import annotations

from ..backend import use_triton
from ..common import dispatch
from ..common.dispatch import TakesEverything
from . import fast
from .problem import QsfaProblem


class Triton:
    name = "triton"

    @staticmethod
    def reasons(P: QsfaProblem) -> list[str]:
        if not use_triton(P.query.device):
            return [f"{P.query.device.type} tensors do not run Triton (DSATTN_BACKEND and the device decide)"]
        from . import triton as kernels                   # imported only where Triton runs
        return [] if kernels.supports(P) else ["the kernel does not cover this call (kv_quant_attn.triton.supports)"]

    @staticmethod
    def forward(P: QsfaProblem, want_stats: bool):
        from . import triton as kernels
        return kernels.forward(P, want_stats)


class Compiled:
    name = "compiled"

    @staticmethod
    def reasons(P: QsfaProblem) -> list[str]:
        if fast.compiled_tokens(P) is not None:
            return []
        q = P.query
        if q.device.type != "cpu":
            return [f"not a CPU tensor ({q.device.type})"]
        if q.dtype.itemsize != 2:
            return [f"query dtype {q.dtype} (it takes bf16, fp16)"]
        from .. import native
        return [native.status() if native.kernels() is None else "the packed rows are not one after another"]

    forward = staticmethod(fast.forward_compiled)


class Torch(TakesEverything):
    forward = staticmethod(fast.forward_torch)


BACKENDS = (Triton, Compiled, Torch)


def choose(P: QsfaProblem) -> type:
    return dispatch.choose(BACKENDS, P)


def explain(P: QsfaProblem) -> list[tuple[str, list[str]]]:
    return dispatch.explain(BACKENDS, P)


def forward(P: QsfaProblem, want_stats: bool):
    return choose(P).forward(P, want_stats)
