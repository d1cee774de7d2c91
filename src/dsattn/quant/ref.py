"""Golden references of the quantisation path (40-kv-quant §1-§3), written independently of
the vectorised code: the per-tile quantizer in NumPy float32 (IEEE division, ``rint`` =
round half to even), and the cache writer as a loop over rows."""
from __future__ import annotations

import numpy as np
import torch

from ..compressor.ref import rotary_literal
from .block import QMAX, check_block_args, dst_dtype
from .rows import KV_LORA_RANK, TILE_SIZE, pack_kv_rows
from .store import parse_store


def dynamic_block_quant(x: torch.Tensor, dst_type: str = "int8", tile_size: int = 128):
    check_block_args(x, tile_size)
    dtype = dst_dtype(dst_type)
    qmax = np.float32(QMAX[dtype])
    v = x.detach().cpu().float().reshape(-1, x.size(-1)).numpy()
    n_tiles = v.shape[1] // tile_size
    y = np.zeros(v.shape, np.float32)
    scale = np.zeros((v.shape[0], n_tiles), np.float32)
    for i in range(v.shape[0]):
        for t in range(n_tiles):
            tile = v[i, t * tile_size:(t + 1) * tile_size]
            amax = np.float32(np.max(np.abs(tile)))
            s = np.float32(amax / qmax)
            if amax == 0 or s == 0:
                continue                                         # scale +0.0, payload 0
            scale[i, t] = s
            q = (tile / s).astype(np.float32)
            y[i, t * tile_size:(t + 1) * tile_size] = (np.clip(np.rint(q), -127, 127) if dtype == torch.int8
                                                       else np.clip(q, -qmax, qmax))
    yt = torch.from_numpy(y).reshape(x.shape).to(dtype).to(x.device)
    return yt, torch.from_numpy(scale).reshape(*x.shape[:-1], n_tiles).to(x.device)


def kv_rmsnorm_rope_quant_cache(kv, gamma, cos, sin, kv_cache, slot_mapping, *, eps=1e-6, rope_head_dim=64,
                                tile_size=128, rotary_mode=2):
    p = parse_store(kv, gamma, cos, sin, kv_cache, slot_mapping, eps=eps, rope_head_dim=rope_head_dim,
                    tile_size=tile_size, rotary_mode=rotary_mode, content=True)
    kdt = kv.dtype
    name = "int8" if p.flat_cache.dtype == torch.int8 else "float8_e4m3fn"
    out = []
    for t in range(p.kv.size(0)):
        x = p.kv[t].float()
        nope = x[:KV_LORA_RANK]
        n = (nope * torch.rsqrt((nope * nope).mean() + eps) * gamma.float()).to(kdt)
        y, s = dynamic_block_quant(n, name, TILE_SIZE)
        rope = None
        if p.R:
            rope = rotary_literal(x[KV_LORA_RANK:], p.cos[t], p.sin[t], rotary_mode).to(kdt)
        row = pack_kv_rows(y, s, rope)
        out.append(row)
        if int(slot_mapping[t]) >= 0:
            p.flat_cache[int(slot_mapping[t])] = row
    return torch.stack(out)


def dequant_block(y: torch.Tensor, scale: torch.Tensor, tile_size: int = 128, out_dtype=None):
    """``fp32(y) · scale`` tile by tile in NumPy float32, rounded to ``out_dtype``."""
    v = y.detach().cpu().float().reshape(-1, y.size(-1)).numpy()
    s = scale.detach().cpu().reshape(v.shape[0], -1).numpy()
    out = np.empty_like(v)
    for t in range(s.shape[1]):
        out[:, t * tile_size:(t + 1) * tile_size] = v[:, t * tile_size:(t + 1) * tile_size] * s[:, t:t + 1]
    return torch.from_numpy(out).reshape(y.shape).to(out_dtype or torch.float32).to(y.device)
