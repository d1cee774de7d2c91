"""Which implementation runs ``sparse_flash_mla`` and its gradient: the one place that decides.

Each backend says what it covers (``reasons(P)``: why it does not take a call, empty when it does), in
the spirit of xformers' fmha dispatch; the first that takes the call runs it.  The order: Triton
(CUDA tensors under ``DSATTN_BACKEND=auto`` / ``triton``), then the compiled CPU kernels, then the
vectorised PyTorch path, which takes everything.  Backends never import each other; what they share
lives in :mod:`dsattn.sparse_mla.problem` and :mod:`dsattn.common`.  ``dsattn bench --which`` prints
:func:`explain`'s reasons.
"""
from __future__ import annotations

import torch

from ..common import dispatch
from ..common.dispatch import TakesEverything
from ..common.softmax import uses_flash
from . import fast
from .problem import MlaProblem


class Triton:
    name = "triton"

    @staticmethod
    def reasons(P: MlaProblem, grad: bool = False) -> list[str]:
        def covers():
            from . import triton as kernels               # imported only where Triton runs
            return kernels.backward_supports(P) if grad else kernels.supports(P)
        return dispatch.triton_reasons(P.q.device, covers, "dtype, head dim, packed rows or strides: sparse_mla.triton."
                                       + ("backward_supports" if grad else "supports"))

    @staticmethod
    def forward(P: MlaProblem, want_lse: bool):
        from . import triton as kernels
        return kernels.forward(P, want_lse)

    @staticmethod
    def backward(P: MlaProblem, dout, attn_out, softmax_lse):
        from . import triton as kernels
        return kernels.backward(P, dout, attn_out, softmax_lse)


class Compiled:
    name = "compiled"

    @staticmethod
    def reasons(P: MlaProblem, grad: bool = False) -> list[str]:
        native = fast.native_sources(P)
        if native is not None:
            if grad and not all(isinstance(f, torch.Tensor) for f in native[1]):
                return ["the gradient reads plain key rows in place only (packed or strided caches here)"]
            return []
        flash = uses_flash(P.q.dtype, P.q.device)
        return dispatch.compiled_reasons(P.q, fast.NATIVE_DTYPES,
                                         "the flash rounding opt-in is on (dsattn.set_flash_attention)" if flash else "")

    @staticmethod
    def forward(P: MlaProblem, want_lse: bool):
        return fast.forward_native(P, fast.native_sources(P), want_lse)

    @staticmethod
    def backward(P: MlaProblem, dout, attn_out, softmax_lse):
        return fast.backward_native(P, fast.native_sources(P), dout, attn_out, softmax_lse)


class Torch(TakesEverything):
    forward = staticmethod(fast.forward_torch)
    backward = staticmethod(fast.backward_torch)


BACKENDS = (Triton, Compiled, Torch)


def choose(P: MlaProblem, grad: bool = False) -> type:
    """The first backend that takes the call."""
    return dispatch.choose(BACKENDS, P, grad)


def explain(P: MlaProblem, grad: bool = False) -> list[tuple[str, list[str]]]:
    """``(backend, reasons it does not take the call)`` for every backend, in dispatch order."""
    return dispatch.explain(BACKENDS, P, grad)


def forward(P: MlaProblem, want_lse: bool):
    return choose(P).forward(P, want_lse)


def backward(P: MlaProblem, dout, attn_out, softmax_lse):
    return choose(P, grad=True).backward(P, dout, attn_out, softmax_lse)
