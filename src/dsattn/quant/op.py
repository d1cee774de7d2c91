"""Registration of ``dsattn::dynamic_block_quant``, ``dsattn::dequant_block`` and
``dsattn::kv_rmsnorm_rope_quant_cache``."""
from __future__ import annotations

import torch

from .._registry import register
from ..common.checks import fail
from .block import PAYLOAD_DTYPES, check_block_args, check_finite, dequant_block, dst_dtype, quantize_tiles
from .store import parse_store, store

DYNAMIC_BLOCK_QUANT_SCHEMA = 'dynamic_block_quant(Tensor x, str dst_type="int8", int tile_size=128) -> (Tensor, Tensor)'
DEQUANT_BLOCK_SCHEMA = "dequant_block(Tensor y, Tensor scale, int tile_size=128, ScalarType? out_dtype=None) -> Tensor"
KV_STORE_SCHEMA = (
    "kv_rmsnorm_rope_quant_cache(Tensor kv, Tensor gamma, Tensor? cos, Tensor? sin, "
    "Tensor(a!) kv_cache, Tensor slot_mapping, *, float eps=1e-06, int rope_head_dim=64, "
    "int tile_size=128, int rotary_mode=2) -> Tensor")


def _quant(x, dst_type="int8", tile_size=128):
    check_block_args(x, tile_size)
    check_finite("x", x)
    return quantize_tiles(x, dst_dtype(dst_type), tile_size)


def _quant_fake(x, dst_type="int8", tile_size=128):
    check_block_args(x, tile_size)
    return (x.new_empty(x.shape, dtype=dst_dtype(dst_type)),
            x.new_empty((*x.shape[:-1], x.size(-1) // tile_size), dtype=torch.float32))


def _check_dequant(y, scale, tile_size, out_dtype):
    if y.dtype not in PAYLOAD_DTYPES:
        fail("y", f"dtype {y.dtype} is not supported; expected int8 or float8_e4m3fn", TypeError)
    if scale.dtype != torch.float32:
        fail("scale", f"dtype {scale.dtype} is not supported; expected torch.float32", TypeError)
    if tile_size < 1 or y.size(-1) % tile_size:
        fail("tile_size", f"value {tile_size} must be >= 1 and divide the last dim {y.size(-1)} of y")
    if tuple(scale.shape) != (*y.shape[:-1], y.size(-1) // tile_size):
        fail("scale", f"expected shape {[*y.shape[:-1], y.size(-1) // tile_size]}, got {tuple(scale.shape)}")
    if out_dtype is not None and out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        fail("out_dtype", f"{out_dtype} is not supported; expected torch.float16, torch.bfloat16 or torch.float32",
             TypeError)
    return out_dtype or torch.float32


def _dequant(y, scale, tile_size=128, out_dtype=None):
    return dequant_block(y, scale, tile_size, _check_dequant(y, scale, tile_size, out_dtype))


def _dequant_fake(y, scale, tile_size=128, out_dtype=None):
    return y.new_empty(y.shape, dtype=_check_dequant(y, scale, tile_size, out_dtype))


def _store(kv, gamma, cos, sin, kv_cache, slot_mapping, **kw):
    check_finite("kv", kv)
    return store(parse_store(kv, gamma, cos, sin, kv_cache, slot_mapping, **kw))


def _store_fake(kv, gamma, cos, sin, kv_cache, slot_mapping, **kw):
    p = parse_store(kv, gamma, cos, sin, kv_cache, slot_mapping, content=False, **kw)
    return kv_cache.new_empty((p.kv.size(0), p.flat_cache.size(1)))


register(DYNAMIC_BLOCK_QUANT_SCHEMA, _quant, _quant_fake)
register(DEQUANT_BLOCK_SCHEMA, _dequant, _dequant_fake)
register(KV_STORE_SCHEMA, _store, _store_fake)
