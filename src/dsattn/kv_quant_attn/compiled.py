"""A decode-sized ``kv_quant_sparse_flash_attention`` call over a paged packed cache in one compiled step
(dsattn/native/kv_quant.cpp): the content checks, query rows, candidate tokens, their paged addresses and
the attention (packed tokens decoded as they are read) that the Python path runs as many small calls.

It takes the calls the Python path would give the compiled kernel (CPU bf16 / fp16 queries, Triton not
chosen, the compiled layer loaded) when they are of the serving shape (``layout_kv="PA_BSND"``, packed rows
one after another, the fixed attributes at their legal values, content checks on, candidate tables within
one block of rows).  Anything else, and any argument the checks would refuse, is declined (``None``) before
a byte is written: the Python path then runs the call, gives the same bits and words the errors."""
from __future__ import annotations

import torch

from .. import native
from ..backend import use_triton
from ..common.checks import content_checks_enabled
from ..common.memory import empty_output
from ..quant.block import PAYLOAD_DTYPES
from ..quant.rows import KV_LORA_RANK, TILE_SIZE, row_width
from ..quant.tokens import PackedTokens
from .problem import FIXED_ATTRS


def run(query, key, value, sparse_indices, scale_value, kw: dict, want_stats: bool):
    """The op's three outputs, or None when the compiled step declines the call."""
    rope = kw.get("rope_head_dim", 64)
    block = kw.get("sparse_block_size", 1)
    if (query.device.type != "cpu" or query.dtype not in (torch.bfloat16, torch.float16)
            or kw.get("layout_kv", "BSND") != "PA_BSND" or kw.get("layout_query", "BSND") not in ("BSND", "TND")
            or any(kw.get(name, legal) != legal for name, legal in FIXED_ATTRS)
            or kw.get("key_dequant_scale") is not None or kw.get("value_dequant_scale") is not None
            or kw.get("sparse_mode", 3) not in (0, 3) or rope not in (0, 64)
            or not 1 <= block <= 128 or block & (block - 1)
            or key.dtype not in PAYLOAD_DTYPES or value.dtype != key.dtype
            or key.size(-1) != row_width(KV_LORA_RANK, rope, TILE_SIZE) or query.size(-1) != KV_LORA_RANK + rope
            or tuple(value.shape) not in (tuple(key.shape), tuple(key.shape[:-1]) + (KV_LORA_RANK,))
            or use_triton(query.device) or not content_checks_enabled(query)):
        return None
    module = native.kernels()
    tokens = PackedTokens.row_fields(key, rope, TILE_SIZE, query.dtype) if module is not None else None
    if tokens is None:
        return None
    tnd = kw.get("layout_query", "BSND") == "TND"
    R = query.size(0) if tnd else query.size(0) * query.size(1)
    H = query.size(-2)
    out = empty_output(*query.shape[:-1], KV_LORA_RANK, dtype=query.dtype, device=query.device)
    stats = torch.empty(2, R, H, dtype=torch.float32)
    taken = module.qsfa_paged(out, stats, query, key, sparse_indices, kw.get("block_table"),
                              kw.get("actual_seq_lengths_query"), kw.get("actual_seq_lengths_kv"), kw.get("sinks"),
                              float(scale_value), block, kw.get("sparse_mode", 3) == 3, tnd, [int(f) for f in tokens])
    if not taken:
        return None
    if not want_stats:
        empty = torch.zeros(0, dtype=torch.float32)
        return out, empty, empty.clone()
    shape = (1, R, H) if tnd else (query.size(0), 1, query.size(1), H)
    return out, stats[0].reshape(shape).clone(), stats[1].reshape(shape).clone()     # outputs never alias
