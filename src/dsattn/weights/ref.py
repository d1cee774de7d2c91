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
    values = torch.tensor(E2M1, dtype=dtype, device=codes.device)[flat]
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


def routed_experts(x, w13, w2, topk_weights, topk_ids, expert_map=None, weights_applied: bool = False,
                   limit: float | None = None, dtype=torch.float64) -> torch.Tensor:
    """The golden of :func:`dsattn.weights.moe.run_experts` over dense expert weights (``w13`` [E, 2I, H]: gate rows
    then up rows; ``w2`` [E, H, I]), token by token in ``dtype``: for each of a token's top-k experts on this rank,
    ``w2 (silu(gate) * up)`` with ``gate, up = w13 x`` (clamped where ``limit`` is given), weighted by its top-k weight
    (or not, where ``weights_applied``: ``x`` already carries it) and summed."""
    T, k = topk_ids.shape
    half = w13.shape[1] // 2
    out = torch.zeros(T, w2.shape[1], dtype=dtype)
    for t in range(T):
        for j in range(k):
            e = int(topk_ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e])
            if e < 0:
                continue
            h = w13[e].to(dtype) @ x[t].to(dtype)
            gate, up = h[:half], h[half:]
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            y = w2[e].to(dtype) @ (torch.nn.functional.silu(gate) * up)
            out[t] += y if weights_applied else float(topk_weights[t, j]) * y
    return out
