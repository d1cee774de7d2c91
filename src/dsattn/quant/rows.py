"""Packed cache rows (40-kv-quant §2): ``[nope payload | rope as 16-bit bytes | fp32 scales]``.

With kv_lora_rank 512 and tile 128: 656 bytes with RoPE 64, 528 bytes with RoPE 0.  The row
tensor has the payload dtype (one byte per element); the rope and scale fields are raw bit
patterns in native (little-endian) byte order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.checks import check_float, fail
from .block import PAYLOAD_DTYPES, check_finite, dequant_block, quantize_tiles

KV_LORA_RANK = 512
TILE_SIZE = 128


def row_width(kv_lora_rank: int = KV_LORA_RANK, rope_head_dim: int = 64, tile_size: int = TILE_SIZE) -> int:
    """Bytes per packed row: ``kv_lora_rank + 2·rope_head_dim + 4·kv_lora_rank / tile_size``."""
    if kv_lora_rank % tile_size:
        fail("kv_lora_rank", f"value {kv_lora_rank} is not a multiple of tile_size={tile_size}")
    return kv_lora_rank + 2 * rope_head_dim + 4 * (kv_lora_rank // tile_size)


def nope_width(width: int, rope_head_dim: int, tile_size: int = TILE_SIZE) -> int:
    """kv_lora_rank of a row of ``width`` bytes (inverse of :func:`row_width`)."""
    n = (width - 2 * rope_head_dim) * tile_size
    if n <= 0 or n % (tile_size + 4):
        fail("packed", f"row width {width} does not fit rope_head_dim={rope_head_dim}, tile_size={tile_size}")
    return n // (tile_size + 4)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:               # an empty tensor may carry stride 0, which view() rejects
        return torch.empty((*t.shape[:-1], t.size(-1) * t.element_size()), dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8)


def pack_kv_rows(nope_q: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
    """Packed rows ``[..., W]`` (dtype of ``nope_q``) from payload, fp32 scales and 16-bit rope."""
    if nope_q.dtype not in PAYLOAD_DTYPES:
        fail("nope_q", f"dtype {nope_q.dtype} is not supported; expected int8 or float8_e4m3fn", TypeError)
    if scales.dtype != torch.float32:
        fail("scales", f"dtype {scales.dtype} is not supported; expected torch.float32", TypeError)
    parts = [_bytes(nope_q)]
    if rope is not None:
        if rope.dtype not in (torch.bfloat16, torch.float16):
            fail("rope", f"dtype {rope.dtype} is not supported; expected bfloat16 or float16", TypeError)
        parts.append(_bytes(rope))
    parts.append(_bytes(scales))
    return torch.cat(parts, dim=-1).view(nope_q.dtype)


def unpack_kv_rows(packed: torch.Tensor, rope_head_dim: int, rope_dtype: torch.dtype = torch.bfloat16,
                   tile_size: int = TILE_SIZE):
    """Inverse of :func:`pack_kv_rows`: ``(nope_q, rope or None, scales)``."""
    N = nope_width(packed.size(-1), rope_head_dim, tile_size)
    u8 = packed.view(torch.uint8)
    nope = packed[..., :N]
    rope = u8[..., N:N + 2 * rope_head_dim].contiguous().view(rope_dtype) if rope_head_dim else None
    off = N + 2 * rope_head_dim
    scales = u8[..., off:off + 4 * (N // tile_size)].contiguous().view(torch.float32)
    return nope, rope, scales


def dequant_kv_rows(packed: torch.Tensor, rope_head_dim: int, out_dtype: torch.dtype,
                    rope_dtype: torch.dtype | None = None, tile_size: int = TILE_SIZE):
    """``(k, v)``: ``k = [dequant(nope) | rope]``, ``v = dequant(nope)``, both ``out_dtype``."""
    if rope_dtype is None:
        if out_dtype not in (torch.bfloat16, torch.float16):
            fail("rope_dtype", f"must be given when out_dtype is {out_dtype} (the rope bytes are bf16 or fp16)")
        rope_dtype = out_dtype
    nope, rope, scales = unpack_kv_rows(packed, rope_head_dim, rope_dtype, tile_size)
    v = dequant_block(nope, scales, tile_size, out_dtype)
    k = torch.cat([v, rope.to(out_dtype)], dim=-1) if rope is not None else v
    return k, v


def rope_bytes_dtype(dtype: torch.dtype) -> torch.dtype:
    """16-bit type of the rope field for activations of ``dtype``: float16 for float16, bfloat16
    otherwise (a float32 / float64 model stores its rope part rounded to bfloat16)."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


def quantize_kv_rows(k: torch.Tensor, rope_head_dim: int, dtype: torch.dtype = torch.int8,
                     tile_size: int = TILE_SIZE) -> torch.Tensor:
    """Packed rows ``[..., W]`` of full key rows ``k [..., N + R]``: the first ``N`` columns are
    block-quantised per ``tile_size`` tile (40 §1), the last ``R = rope_head_dim`` are kept as
    16-bit (:func:`rope_bytes_dtype`).  Inverse: :func:`dequant_kv_rows` (its ``k``)."""
    if dtype not in PAYLOAD_DTYPES:
        fail("dtype", f"value {dtype} is not supported; expected torch.int8 or torch.float8_e4m3fn", TypeError)
    check_float("k", k, allow_f64=True)
    check_finite("k", k)
    N = k.size(-1) - rope_head_dim
    if rope_head_dim < 0 or N < 1 or N % tile_size:
        fail("rope_head_dim", f"value {rope_head_dim} leaves {N} quantised columns of a {k.size(-1)}-wide row; "
             f"expected a positive multiple of tile_size={tile_size}")
    y, scale = quantize_tiles(k[..., :N], dtype, tile_size)
    rope = k[..., N:].to(rope_bytes_dtype(k.dtype)) if rope_head_dim else None
    return pack_kv_rows(y, scale, rope)


@dataclass(frozen=True)
class PackedKV:
    """How an attention op reads a packed KV cache whose rows hold full ``D``-wide keys (V4: the
    value is the whole key row, rope part included): ``D - rope_head_dim`` quantised columns in
    tiles of ``tile_size``, then the rope part as 16-bit, then the fp32 scales.  Rows are
    dequantised in fp32 and rounded once to the query dtype (as ``kv_quant_sparse_flash_attention``)."""

    rope_head_dim: int
    tile_size: int

    def width(self, D: int) -> int:
        N = D - self.rope_head_dim
        if self.rope_head_dim < 0 or N < 1 or self.tile_size < 1 or N % self.tile_size:
            fail("kv_tile_size", f"head dim {D} minus kv_rope_dim={self.rope_head_dim} must be a positive "
                 f"multiple of kv_tile_size={self.tile_size}")
        return row_width(N, self.rope_head_dim, self.tile_size)

    @staticmethod
    def check_dtype(name: str, kv: torch.Tensor | None) -> None:
        if kv is not None and kv.dtype not in PAYLOAD_DTYPES:
            fail(name, f"dtype {kv.dtype} is not supported for a packed cache; expected int8 or float8_e4m3fn",
                 TypeError)

    def check(self, name: str, kv: torch.Tensor | None, D: int) -> None:
        if kv is None:
            return
        self.check_dtype(name, kv)
        if kv.size(-1) != self.width(D):
            fail(name, f"row width {kv.size(-1)} bytes does not match head dim {D} packed with "
                 f"kv_rope_dim={self.rope_head_dim}, kv_tile_size={self.tile_size} (expected {self.width(D)})")

    def decoder(self, out_dtype: torch.dtype):
        """``rows [..., W] -> keys [..., D]`` in ``out_dtype``: the ``k`` of :func:`dequant_kv_rows`,
        bit for bit, written into one output (half the time of unpack + dequantise + concatenate)."""
        R, tile = self.rope_head_dim, self.tile_size
        rope_dtype = rope_bytes_dtype(out_dtype)

        def decode(rows: torch.Tensor) -> torch.Tensor:
            N = nope_width(rows.size(-1), R, tile)
            u8 = rows.view(torch.uint8)
            out = torch.empty(*rows.shape[:-1], N + R, dtype=out_dtype, device=rows.device)
            scales = u8[..., N + 2 * R:].contiguous().view(torch.float32)
            out[..., :N] = rows[..., :N].float().unflatten(-1, (-1, tile)).mul_(scales[..., None]).flatten(-2)
            if R:
                out[..., N:] = u8[..., N:N + 2 * R].contiguous().view(rope_dtype)
            return out
        return decode
