"""RMSNorm and rotary embedding as the compressor and the quantised-cache writer apply them
(30-compressor §3, 40-kv-quant §3.2).  All arithmetic is in the compute dtype (fp32).

The rotary tables are per dimension and are applied literally: every table entry the formula
names is read, and the pairs are *not* assumed to share their cos/sin value.
"""
from __future__ import annotations

import torch

from .checks import check_choice

ROTARY_HALF = 1         # pairs (i, i + R/2)
ROTARY_INTERLEAVE = 2   # pairs (2i, 2i + 1); DeepSeek-V4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x · rsqrt(mean(x²) + eps) · weight`` over the last dim, in ``x``'s (compute) dtype."""
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)


def rotate_partner(u: torch.Tensor, mode: int) -> torch.Tensor:
    """The signed partner of every element: ``out = u·cos + partner·sin`` is the rotation."""
    if mode == ROTARY_INTERLEAVE:
        even, odd = u[..., 0::2], u[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    h = u.size(-1) // 2
    return torch.cat((-u[..., h:], u[..., :h]), dim=-1)


def rotary(u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: int) -> torch.Tensor:
    """30-compressor §3: mode 2 ``out[2i] = u[2i]·cs[2i] - u[2i+1]·sn[2i]``,
    ``out[2i+1] = u[2i+1]·cs[2i+1] + u[2i]·sn[2i+1]``; mode 1 the same on pairs ``(i, i+R/2)``."""
    return u * cos.to(u.dtype) + rotate_partner(u, mode) * sin.to(u.dtype)


def check_rotary_args(rope_head_dim: int, rotary_mode: int, width: int, eps: float | None = None) -> None:
    check_choice("rotary_mode", rotary_mode, (ROTARY_HALF, ROTARY_INTERLEAVE))
    if rope_head_dim < 0 or rope_head_dim % 2 or rope_head_dim > width:
        raise ValueError(f"rope_head_dim: value {rope_head_dim} must be even and in [0, {width}]")
    if eps is not None and not eps > 0:
        raise ValueError(f"norm_eps: value {eps} must be > 0")
