"""Which implementation runs ``kv_quant_sparse_flash_attention``: the one place that decides.

Each backend says why it does not take a call (``reasons(P)``, empty when it does); the first that
takes it runs: Triton (CUDA tensors), the compiled CPU kernel (packed tokens decoded as they are
gathered), the vectorised PyTorch path.  Backends never import each other: the candidate tokens
they all start from are :func:`dsattn.kv_quant_attn.problem.candidate_tokens`.
"""
from __future__ import annotations

import torch

from ..common import dispatch
from ..common.dispatch import TakesEverything
from . import fast
from .problem import QsfaProblem


class Triton:
    name = "triton"

    @staticmethod
    def reasons(P: QsfaProblem) -> list[str]:
        def covers():
            from . import triton as kernels               # imported only where Triton runs
            return kernels.supports(P)
        return dispatch.triton_reasons(P.query.device, covers, "kv_quant_attn.triton.supports")

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
        from .. import native
        rows = "the packed rows are not one after another" if native.kernels() is not None else ""
        return dispatch.compiled_reasons(P.query, (torch.bfloat16, torch.float16), rows)

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
