"""Configurations of the attention layer: the real V4-Flash / V4-Pro attention dimensions
(00 §3.1) and a ``small`` preset that runs in seconds on 2 cores."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class V4AttentionConfig:
    hidden: int
    heads: int
    head_dim: int              # nope + rope
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    index_heads: int
    index_dim: int
    index_topk: int
    page_size: int = 64
    kv_quant_tile: int = 64    # packed KV caches: the nope part (head_dim - rope_dim) in tiles of this size
    eps: float = 1e-6
    rope_theta: float = 10000.0
    cmp_rope_theta: float = 160000.0
    yarn_factor: float = 16.0
    yarn_original: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5


PRESETS = {
    "v4-flash": V4AttentionConfig(hidden=4096, heads=64, head_dim=512, rope_dim=64, q_lora_rank=1024, o_groups=8,
                                  o_lora_rank=1024, window=128, index_heads=64, index_dim=128, index_topk=512),
    "small": V4AttentionConfig(hidden=96, heads=4, head_dim=64, rope_dim=16, q_lora_rank=48, o_groups=2,
                               o_lora_rank=32, window=16, index_heads=4, index_dim=32, index_topk=512,
                               page_size=16, kv_quant_tile=16),
}


def rope_frequencies(cfg: V4AttentionConfig, compressed_layer: bool, dim: int | None = None) -> torch.Tensor:
    """Inverse frequencies of the interleaved RoPE: theta 10000 on window-only layers; theta
    160000 with YaRN (factor, original length, beta_fast, beta_slow) on compressed layers."""
    dim = dim or cfg.rope_dim
    theta = cfg.cmp_rope_theta if compressed_layer else cfg.rope_theta
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if not compressed_layer or cfg.yarn_factor <= 1:
        return freqs

    def correction_dim(num_rotations):
        return dim * math.log(cfg.yarn_original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))
    low = max(math.floor(correction_dim(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.yarn_beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    smooth = 1 - ramp
    return freqs / cfg.yarn_factor * (1 - smooth) + freqs * smooth


def rope_tables(freqs: torch.Tensor, positions: int):
    """Per-dimension interleaved tables ``(cos, sin)`` float32 ``[positions, 2·len(freqs)]``:
    ``cs[2i] = cs[2i+1] = cos(pos·f_i)`` (30 §3)."""
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * freqs[None]
    return (torch.cos(ang).repeat_interleave(2, -1).float(), torch.sin(ang).repeat_interleave(2, -1).float())
