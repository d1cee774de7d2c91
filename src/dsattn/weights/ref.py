"""The golden of ``fp8_block_linear``: the dequantised weight (code x its block's scale) times x, in float64."""
from __future__ import annotations

import torch

from .problem import parse_fp8_linear


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bn: int, bk: int, dtype=torch.float64) -> torch.Tensor:
    """codes [N, K] (e4m3fn or its uint8 bits) x their blocks' scales, in ``dtype``."""
    N, K = codes.shape
    w = codes.view(torch.float8_e4m3fn).to(dtype)
    s = scale.to(dtype).repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return w * s


def fp8_block_linear(x, weight, weight_scale, block_size=(128, 128), bias=None, dtype=torch.float64) -> torch.Tensor:
    P = parse_fp8_linear(x, weight, weight_scale, block_size, bias)
    y = P.x.to(dtype) @ dequantize(P.codes, P.scale, P.bn, P.bk, dtype).T
    if P.bias is not None:
        y = y + P.bias.to(dtype)
    return y.reshape(P.out_shape)
