"""Which implementation runs ``lightning_indexer``: the one place that decides.

Each backend says why it does not take a call (``reasons(P)``, empty when it does); the first that
takes it runs: Triton (CUDA tensors under ``DSATTN_BACKEND=auto`` / ``triton``), the compiled CPU
top-k, the vectorised PyTorch path.  Backends never import each other: the selection they all finish
with is :func:`dsattn.indexer.problem.select_topk`.  The KL-loss gradient has one implementation
(:func:`dsattn.indexer.fast.kl_loss_grad`).
"""
from __future__ import annotations

import torch

from ..common import dispatch
from ..common.dispatch import TakesEverything
from . import fast
from .problem import IndexerProblem


class Triton:
    name = "triton"

    @staticmethod
    def reasons(P: IndexerProblem) -> list[str]:
        def covers():
            from . import triton as kernels               # imported only where Triton runs
            return kernels.supports(P)
        return dispatch.triton_reasons(P.q.device, covers, "indexer.triton.supports")

    @staticmethod
    def lightning_indexer(P: IndexerProblem, topk: int, offset):
        from . import triton as kernels
        return kernels.lightning_indexer(P, topk, offset)


class Compiled:
    name = "compiled"

    @staticmethod
    def reasons(P: IndexerProblem) -> list[str]:
        if fast.native_indexer(P) is not None:
            return []
        strided = "the keys are not one flat view (strided)" if P.k.flat_rows() is None else ""
        return dispatch.compiled_reasons(P.q, (torch.bfloat16, torch.float16, torch.float32), strided)

    lightning_indexer = staticmethod(fast.lightning_indexer_native)


class Torch(TakesEverything):
    lightning_indexer = staticmethod(fast.lightning_indexer_torch)


BACKENDS = (Triton, Compiled, Torch)


def choose(P: IndexerProblem) -> type:
    return dispatch.choose(BACKENDS, P)


def explain(P: IndexerProblem) -> list[tuple[str, list[str]]]:
    return dispatch.explain(BACKENDS, P)


def lightning_indexer(P: IndexerProblem, topk: int, offset):
    """``(indices [R, topk] int32, values [R, topk] float32)`` over flattened rows."""
    return choose(P).lightning_indexer(P, topk, offset)


# quant_lightning_indexer (a QuantIndexerProblem: keys decoded as they are read)


class QuantTriton:
    name = "triton"

    @staticmethod
    def reasons(P) -> list[str]:
        def covers():
            from . import triton as kernels               # imported only where Triton runs
            return kernels.quant_supports(P)
        return dispatch.triton_reasons(P.q.device, covers, "indexer.triton.quant_supports")

    @staticmethod
    def quant_lightning_indexer(P, topk: int, offset):
        from . import triton as kernels
        return kernels.quant_lightning_indexer(P, topk, offset)


class QuantCompiled:
    name = "compiled"

    @staticmethod
    def reasons(P) -> list[str]:
        if fast.native_quant_indexer(P) is not None:
            return []
        return dispatch.compiled_reasons(P.q, (torch.bfloat16, torch.float16, torch.float32), "")

    quant_lightning_indexer = staticmethod(fast.quant_indexer_native)


class QuantTorch(TakesEverything):
    @staticmethod
    def quant_lightning_indexer(P, topk: int, offset):
        return fast.lightning_indexer_torch(P.dequantized(), topk, offset)


QUANT_BACKENDS = (QuantTriton, QuantCompiled, QuantTorch)


def explain_quant(P) -> list[tuple[str, list[str]]]:
    return dispatch.explain(QUANT_BACKENDS, P)


def quant_lightning_indexer(P, topk: int, offset):
    """``(indices [R, topk] int32, values [R, topk] float32)`` over flattened rows, quantised keys."""
    return dispatch.choose(QUANT_BACKENDS, P).quant_lightning_indexer(P, topk, offset)
