"""Registration of ``dsattn::kv_quant_sparse_flash_attention`` (40-kv-quant §4.1)."""
from __future__ import annotations

import torch

from .._registry import register
from ..quant.rows import KV_LORA_RANK
from . import compiled, dispatch
from .problem import parse_qsfa

KV_QUANT_SFA_SCHEMA = (
    "kv_quant_sparse_flash_attention(Tensor query, Tensor key, Tensor value, "
    "Tensor sparse_indices, float scale_value=1.0, *, "
    "int key_quant_mode=2, int value_quant_mode=2, "
    "Tensor? key_dequant_scale=None, Tensor? value_dequant_scale=None, "
    "Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, "
    "Tensor? actual_seq_lengths_kv=None, Tensor? sinks=None, "
    'int sparse_block_size=1, str layout_query="BSND", str layout_kv="BSND", '
    "int sparse_mode=3, int pre_tokens=9223372036854775807, "
    "int next_tokens=9223372036854775807, int attention_mode=2, "
    "int quant_scale_repo_mode=1, int tile_size=128, int rope_head_dim=64, "
    "bool return_softmax_lse=False) -> (Tensor, Tensor, Tensor)")


def _kernel(query, key, value, sparse_indices, scale_value=1.0, **kw):
    want = kw.pop("return_softmax_lse", False)
    taken = compiled.run(query, key, value, sparse_indices, scale_value, kw, want)    # paged decode: one step
    if taken is not None:
        return taken
    return dispatch.forward(parse_qsfa(query, key, value, sparse_indices, scale_value, **kw), want)


def _fake(query, key, value, sparse_indices, scale_value=1.0, **kw):
    want = kw.pop("return_softmax_lse", False)
    P = parse_qsfa(query, key, value, sparse_indices, scale_value, content=False, **kw)
    out = query.new_empty((*query.shape[:-1], KV_LORA_RANK))
    shape = P.stats_shape() if want else (0,)
    return out, query.new_empty(shape, dtype=torch.float32), query.new_empty(shape, dtype=torch.float32)


register(KV_QUANT_SFA_SCHEMA, _kernel, _fake)
