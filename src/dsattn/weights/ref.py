"""The golden of ``fp8_block_linear`` and ``mxfp4_linear``: the dequantised weight (code x its block's scale) times
x, in float64."""
from __future__ import annotations

import torch

from .problem import E2M1, QuantLinearProblem, parse_fp8_linear, parse_mxfp4_linear


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bn: int, bk: int, dtype=torch.float64) -> torch.Tensor:
    """FP8 codes [N, K] (e4m3fn or its uint8 bits) x their blocks' scales, in ``dtype``."""
    N, K = codes.shape
    w = codes.view(torch.float8_e4m3fn).to(dtype)
    s = scale.to(dtype).repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return w * s


def dequantize_mxfp4(codes: torch.Tensor, scale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """e2m1 pairs uint8 [N, K / 2] x their groups' scales (float32, or ue8m0 as uint8 / float8_e8m0fnu) [N, K / 32]."""
    from .problem import e8m0_to_float
    flat = torch.stack([codes & 0xF, codes >> 4], -1).reshape(codes.shape[0], -1).long()
    values = torch.tensor(E2M1, dtype=dtype)[flat]
    s = scale if scale.dtype == torch.float32 else e8m0_to_float(scale)
    return values * s.to(dtype).repeat_interleave(32, 1)


def weight_of(P: QuantLinearProblem, dtype=torch.float64) -> torch.Tensor:
    if P.format == "fp4":
        return dequantize_mxfp4(P.codes, P.scale, dtype)
    return dequantize(P.codes, P.scale_float, P.bn, P.bk, dtype)


def _product(P: QuantLinearProblem, dtype) -> torch.Tensor:
    y = P.x.to(dtype) @ weight_of(P, dtype).T
    if P.bias is not None:
        y = y + P.bias.to(dtype)
    return y.reshape(P.out_shape)


def fp8_block_linear(x, weight, weight_scale, block_size=(128, 128), bias=None, dtype=torch.float64) -> torch.Tensor:
    return _product(parse_fp8_linear(x, weight, weight_scale, block_size, bias), dtype)


def mxfp4_linear(x, weight, weight_scale, bias=None, dtype=torch.float64) -> torch.Tensor:
    return _product(parse_mxfp4_linear(x, weight, weight_scale, bias), dtype)
