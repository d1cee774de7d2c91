"""``fp8_block_linear``'s fast paths: the compiled CPU kernel (``native/weights.cpp``) and the PyTorch one."""
from __future__ import annotations

import torch

from .. import native
from .problem import Fp8LinearProblem

TORCH_ROWS = 1024          # weight rows the PyTorch path dequantises at a time (its only copy of the weight)


def native_module(P: Fp8LinearProblem):
    """The compiled layer where it takes this call (CPU tensors, a K block of whole 16-code runs), else None."""
    if P.x.device.type != "cpu" or P.bk % 16:
        return None
    return native.load()


def linear_native(P: Fp8LinearProblem, stream_rows_max: int = -1) -> torch.Tensor:
    y = native_module(P).fp8_block_linear(P.x.contiguous(), P.codes.contiguous(), P.scale, P.bn, P.bk, P.bias,
                                          stream_rows_max)
    return y.reshape(P.out_shape)


def linear_torch(P: Fp8LinearProblem) -> torch.Tensor:
    """Rows of the weight dequantised to x's dtype (fp32 for fp32 x) a chunk at a time, then multiplied."""
    out = torch.empty(P.M, P.N, dtype=P.x.dtype, device=P.x.device)
    x = P.x.float()
    for n0 in range(0, P.N, TORCH_ROWS):
        n1 = min(P.N, n0 + TORCH_ROWS)
        w = P.codes[n0:n1].view(torch.float8_e4m3fn).to(torch.float32)
        s = P.scale.repeat_interleave(P.bn, 0)[n0:n1].repeat_interleave(P.bk, 1)[:, :P.K]
        y = x @ (w * s).T
        if P.bias is not None:
            y += P.bias[n0:n1].float()
        out[:, n0:n1] = y
    return out.reshape(P.out_shape)
