"""The quantised linears' fast paths: the compiled CPU kernel (``native/weights.cpp``) and the PyTorch one."""
from __future__ import annotations

import torch

from .. import native
from . import invariance
from .problem import QuantLinearProblem

TORCH_ROWS = 1024          # weight rows the PyTorch path dequantises at a time (its only copy of the weight)
STREAM_EVERY_ROW = 2 ** 62  # the compiled kernel's stream_rows_max that streams any M (the batch-invariant mode)


def native_module(P: QuantLinearProblem):
    """The compiled layer where it takes this call (CPU tensors, a K block of whole 16-code runs), else None."""
    if P.x.device.type != "cpu" or P.bk % 16:
        return None
    return native.kernels()


def linear_native(P: QuantLinearProblem, stream_rows_max: int | None = None) -> torch.Tensor:
    """``stream_rows_max``: the rows of x up to which the weight is streamed (-1: the kernel's default, 8; 0: always
    tiled); None: as the batch-invariant mode says (on: every call streamed, one summation order for every M)."""
    if stream_rows_max is None:
        stream_rows_max = STREAM_EVERY_ROW if invariance.requested() else -1
    y = native_module(P).quant_linear(P.x.contiguous(), P.codes.contiguous(), P.scale, P.bn, P.bk, P.bias, P.format,
                                      stream_rows_max)
    return y.reshape(P.out_shape)


def linear_torch(P: QuantLinearProblem) -> torch.Tensor:
    """Rows of the weight dequantised to fp32 a chunk at a time, then multiplied in fp32."""
    from .ref import weight_of
    out = torch.empty(P.M, P.N, dtype=P.x.dtype, device=P.x.device)
    x = P.x.float()
    for n0 in range(0, P.N, TORCH_ROWS):
        n1 = min(P.N, n0 + TORCH_ROWS)
        b0 = (n0 // P.bn) * P.bn                 # (from the first row of n0's block: the scales' rows align)
        rows = QuantLinearProblem(P.x, P.codes[b0:n1], P.scale[n0 // P.bn:-(-n1 // P.bn)], P.bn, P.bk, None, (),
                                  P.format)
        w = weight_of(rows, torch.float32)[n0 - b0:]
        y = x @ w.T
        if P.bias is not None:
            y += P.bias[n0:n1].float()
        out[:, n0:n1] = y
    return out.reshape(P.out_shape)
