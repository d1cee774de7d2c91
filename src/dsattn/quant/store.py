"""``kv_rmsnorm_rope_quant_cache`` (40-kv-quant §3): RMSNorm of the latent, RoPE of the rope
part, per-tile quantisation, packing, and a scatter into a paged cache by flat slot
(-1 = do not write; slot 0 is a real slot)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.checks import check_choice, check_slots, content_checks_enabled, fail
from ..common.paged import write_rows
from ..common.rope import check_rotary_args, rms_norm, rotary
from .block import PAYLOAD_DTYPES, quantize_tiles
from .rows import KV_LORA_RANK, TILE_SIZE, pack_kv_rows, row_width


@dataclass
class StoreProblem:
    kv: torch.Tensor          # [T, 512 + R]
    gamma: torch.Tensor
    cos: torch.Tensor | None  # [T, R]
    sin: torch.Tensor | None
    flat_cache: torch.Tensor  # [num_blocks · block_size, W]
    slots: torch.Tensor       # [T] int64
    eps: float
    R: int
    rotary_mode: int


def parse_store(kv, gamma, cos, sin, kv_cache, slot_mapping, *, eps=1e-6, rope_head_dim=64, tile_size=128,
                rotary_mode=2, content=None) -> StoreProblem:
    if kv.dtype not in (torch.bfloat16, torch.float16):
        fail("kv", f"dtype {kv.dtype} is not supported; expected bfloat16 or float16", TypeError)
    if gamma.dtype not in (torch.float32, kv.dtype):
        fail("gamma", f"dtype {gamma.dtype} is not supported; expected float32 or {kv.dtype}", TypeError)
    if kv_cache.dtype not in PAYLOAD_DTYPES:
        fail("kv_cache", f"dtype {kv_cache.dtype} is not supported; expected int8 or float8_e4m3fn", TypeError)
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        fail("slot_mapping", f"dtype {slot_mapping.dtype} is not supported; expected int32 or int64", TypeError)
    check_choice("rope_head_dim", rope_head_dim, (0, 64))
    if tile_size != TILE_SIZE:
        fail("tile_size", f"value {tile_size} is not supported; the cache format uses {TILE_SIZE}")
    check_choice("rotary_mode", rotary_mode, (1, 2))
    if not eps > 0:
        fail("eps", f"value {eps} must be > 0")
    check_rotary_args(rope_head_dim, rotary_mode, rope_head_dim)
    R = rope_head_dim
    if kv.dim() < 1 or kv.size(-1) != KV_LORA_RANK + R:
        fail("kv", f"last dim must be 512 + rope_head_dim = {KV_LORA_RANK + R}, got shape {tuple(kv.shape)}")
    if tuple(gamma.shape) != (KV_LORA_RANK,):
        fail("gamma", f"expected shape [{KV_LORA_RANK}], got {tuple(gamma.shape)}")
    W = row_width(KV_LORA_RANK, R, TILE_SIZE)
    if kv_cache.dim() not in (3, 4) or kv_cache.size(-1) != W or (kv_cache.dim() == 4 and kv_cache.size(2) != 1):
        fail("kv_cache", f"expected [num_blocks, block_size, 1, {W}] or [num_blocks, block_size, {W}] for "
             f"rope_head_dim={R}, got {tuple(kv_cache.shape)}")
    rows = kv.reshape(-1, kv.size(-1))
    T = rows.size(0)
    if slot_mapping.dim() != 1 or slot_mapping.size(0) != T:
        fail("slot_mapping", f"expected shape [T={T}], got {tuple(slot_mapping.shape)}")
    if R:
        for name, t in (("cos", cos), ("sin", sin)):
            if t is None:
                fail(name, "is required when rope_head_dim = 64")
            if t.dtype != torch.float32:
                fail(name, f"dtype {t.dtype} is not supported; expected torch.float32", TypeError)
            if tuple(t.shape) != (T, R):
                fail(name, f"expected shape [T={T}, {R}], got {tuple(t.shape)}")
    flat = kv_cache.view(-1, W)
    if content is None:
        content = content_checks_enabled(kv, kv_cache, slot_mapping)
    if content:
        check_slots(slot_mapping, flat.size(0))
    return StoreProblem(rows, gamma, cos if R else None, sin if R else None, flat, slot_mapping.to(torch.int64),
                        eps, R, rotary_mode)


def pack_rows(p: StoreProblem) -> torch.Tensor:
    """The packed rows ``[T, W]`` of every input row (§3.2)."""
    kdt = p.kv.dtype
    x = p.kv.float()
    nope = rms_norm(x[:, :KV_LORA_RANK], p.gamma.float(), p.eps).to(kdt)
    y, s = quantize_tiles(nope, p.flat_cache.dtype, TILE_SIZE)
    rope = rotary(x[:, KV_LORA_RANK:], p.cos, p.sin, p.rotary_mode).to(kdt) if p.R else None
    return pack_kv_rows(y, s, rope)


def store(p: StoreProblem) -> torch.Tensor:
    packed = pack_rows(p)
    write_rows(p.flat_cache, p.slots.clamp(min=0), p.slots >= 0, packed)
    return packed
