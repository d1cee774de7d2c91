"""Per-tile dynamic block quantisation (40-kv-quant §1), bit-exact on every backend.

One tile = one row × ``tile_size`` consecutive columns.  ``scale = fp32(amax / qmax)`` and
``t = fp32(v / scale)`` use correctly rounded fp32 division (never a reciprocal multiply);
int8 rounds half to even and clamps to ±127; float8_e4m3fn clamps to ±448 before the
nearest-even cast (PyTorch's cast does not saturate).  A tile whose amax is 0 (or whose
scale underflows to 0) gets scale +0.0 and all-zero payload bytes.
"""
from __future__ import annotations

import torch

from ..common.checks import check_float, content_checks_enabled, fail

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
DST_TYPES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}
PAYLOAD_DTYPES = tuple(QMAX)


def dst_dtype(dst_type: str) -> torch.dtype:
    if dst_type == "hifloat8":
        fail("dst_type", "HiFloat8 is an Ascend-only format and is not implemented", NotImplementedError)
    if dst_type not in DST_TYPES:
        fail("dst_type", f"value {dst_type!r} is not one of {list(DST_TYPES)} (or 'hifloat8', unsupported)")
    return DST_TYPES[dst_type]


def check_block_args(x: torch.Tensor, tile_size: int) -> None:
    check_float("x", x)
    if tile_size < 1:
        fail("tile_size", f"value {tile_size} must be >= 1")
    if x.dim() < 1 or x.size(-1) % tile_size:
        fail("x", f"last dim {x.size(-1) if x.dim() else None} is not a multiple of tile_size={tile_size}")


def check_finite(arg: str, x: torch.Tensor) -> None:
    """Non-finite input has no defined quantisation (40 §1.2 leaves it unspecified); the library
    rejects it as a content check, so it never becomes a silent NaN scale in a cache."""
    if content_checks_enabled(x) and not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        fail(arg, f"holds a non-finite value {float(x[tuple(bad)])} at {bad}; quantisation needs finite input")


def quantize_tiles(x: torch.Tensor, dtype: torch.dtype, tile_size: int):
    """``x [..., N]`` -> (payload ``[..., N]`` of ``dtype``, scale fp32 ``[..., N / tile_size]``)."""
    qmax = QMAX[dtype]
    v = x.float().reshape(*x.shape[:-1], x.size(-1) // tile_size, tile_size)
    amax = v.abs().amax(-1, keepdim=True)
    scale = amax / qmax
    zero_tile = (amax == 0) | (scale == 0)
    safe = torch.where(zero_tile, torch.ones_like(scale), scale)
    t = v / safe
    if dtype == torch.int8:
        y = torch.round(t).clamp(-127, 127)
    else:
        y = t.clamp(-qmax, qmax)
    y = torch.where(zero_tile, torch.zeros((), device=x.device), y).to(dtype)
    scale = torch.where(zero_tile, torch.zeros((), device=x.device), scale)
    return y.reshape(x.shape), scale.squeeze(-1)


def dequant_block(y: torch.Tensor, scale: torch.Tensor, tile_size: int = 128,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp32(y) · scale`` per tile (fp32 multiply), rounded once to ``out_dtype`` (40 §1.4)."""
    v = y.float().reshape(*y.shape[:-1], y.size(-1) // tile_size, tile_size) * scale.float()[..., None]
    return v.reshape(y.shape).to(out_dtype)
