"""Validation and layout resolution of ``kv_quant_sparse_flash_attention`` (40-kv-quant §4).

The packed cache is addressed through :class:`dsattn.common.layout.KVSource` (BSND, TND, or
PA_BSND with ``block_table``); the query through :class:`QueryRows`, whose extent is the
query length of each batch (QSFA has no separate used-row count: rows of a BSND batch at or
past ``actual_seq_lengths_query[b]`` are padding).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.checks import check_choice, check_dtype, check_int32, content_checks_enabled, fail, host_ints
from ..common.layout import PAGED, KVSource, QueryRows, kv_source, query_rows
from ..quant.block import PAYLOAD_DTYPES
from ..quant.rows import KV_LORA_RANK, TILE_SIZE, row_width

INT64_MAX = 2 ** 63 - 1
FIXED_ATTRS = (("key_quant_mode", 2), ("value_quant_mode", 2), ("attention_mode", 2),
               ("quant_scale_repo_mode", 1), ("tile_size", TILE_SIZE), ("pre_tokens", INT64_MAX),
               ("next_tokens", INT64_MAX))
LAYOUTS_KV = {"BSND": "BSND", "TND": "TND", "PA_BSND": PAGED}


@dataclass
class QsfaProblem:
    query: torch.Tensor
    rows: QueryRows
    kv: KVSource
    idx: torch.Tensor          # [R, K] sparse block indices per flattened query row
    scale: float
    sinks: torch.Tensor | None
    block: int                 # sparse_block_size
    causal: bool               # sparse_mode 3
    R: int                     # rope_head_dim

    @property
    def width(self) -> int:
        """Candidate tokens per row: every listed block, whole."""
        return self.idx.size(1) * self.block

    def stats_shape(self):
        q = self.query
        return (q.size(0), 1, q.size(1), q.size(2)) if self.rows.layout == "BSND" else (1, q.size(0), q.size(1))


def _cumulative(ends: torch.Tensor) -> torch.Tensor:
    """TND cumulative ends without a leading 0 -> ``cu_seqlens`` with it."""
    return torch.cat([ends.new_zeros(1), ends])


def parse_qsfa(query, key, value, sparse_indices, scale_value=1.0, *, key_quant_mode=2, value_quant_mode=2,
               key_dequant_scale=None, value_dequant_scale=None, block_table=None,
               actual_seq_lengths_query=None, actual_seq_lengths_kv=None, sinks=None, sparse_block_size=1,
               layout_query="BSND", layout_kv="BSND", sparse_mode=3, pre_tokens=INT64_MAX,
               next_tokens=INT64_MAX, attention_mode=2, quant_scale_repo_mode=1, tile_size=128,
               rope_head_dim=64, content=None) -> QsfaProblem:
    attrs = dict(key_quant_mode=key_quant_mode, value_quant_mode=value_quant_mode, attention_mode=attention_mode,
                 quant_scale_repo_mode=quant_scale_repo_mode, tile_size=tile_size, pre_tokens=pre_tokens,
                 next_tokens=next_tokens)
    for name, legal in FIXED_ATTRS:
        if attrs[name] != legal:
            fail(name, f"value {attrs[name]} is not supported; the only legal value is {legal}")
    for name, t in (("key_dequant_scale", key_dequant_scale), ("value_dequant_scale", value_dequant_scale)):
        if t is not None:
            fail(name, "is reserved and must be None (the scales are stored inline in the packed rows)")
    check_choice("sparse_mode", sparse_mode, (0, 3))
    check_choice("layout_query", layout_query, ("BSND", "TND"))
    check_choice("layout_kv", layout_kv, tuple(LAYOUTS_KV))
    if layout_kv != "PA_BSND" and layout_kv != layout_query:
        fail("layout_kv", f"{layout_kv!r} must equal layout_query={layout_query!r} for a non-paged cache")
    if query.dtype not in (torch.bfloat16, torch.float16):
        fail("query", f"dtype {query.dtype} is not supported; expected bfloat16 or float16", TypeError)
    if getattr(torch, "hifloat8", None) is not None and key.dtype == getattr(torch, "hifloat8"):
        fail("key", "HiFloat8 is an Ascend-only format and is not implemented", NotImplementedError)
    if key.dtype not in PAYLOAD_DTYPES:
        fail("key", f"dtype {key.dtype} is not supported; expected int8 or float8_e4m3fn", TypeError)
    check_dtype("value", value, key.dtype, "the dtype of key")
    check_dtype("sinks", sinks, torch.float32)
    check_int32("sparse_indices", sparse_indices)
    check_int32("block_table", block_table)
    check_int32("actual_seq_lengths_query", actual_seq_lengths_query)
    check_int32("actual_seq_lengths_kv", actual_seq_lengths_kv)
    if rope_head_dim not in (0, 64):
        fail("rope_head_dim", f"value {rope_head_dim} is not supported; expected 0 or 64")
    qd = KV_LORA_RANK + rope_head_dim
    W = row_width(KV_LORA_RANK, rope_head_dim, TILE_SIZE)
    q_rank = 4 if layout_query == "BSND" else 3
    if query.dim() != q_rank:
        fail("query", f"expected a {q_rank}-D tensor for layout {layout_query}, got shape {tuple(query.shape)}")
    if query.size(-1) != qd:
        fail("query", f"last dim {query.size(-1)} must be 512 + rope_head_dim = {qd} (rope_head_dim={rope_head_dim})")
    if key.size(-1) != W:
        fail("key", f"packed row width {key.size(-1)} must be {W} bytes for rope_head_dim={rope_head_dim}")
    if tuple(value.shape) not in (tuple(key.shape), tuple(key.shape[:-1]) + (KV_LORA_RANK,)):
        fail("value", f"shape {tuple(value.shape)} must equal key's {tuple(key.shape)} or key's with last dim 512")
    if (sparse_block_size < 1 or sparse_block_size > 128 or sparse_block_size & (sparse_block_size - 1)):
        fail("sparse_block_size", f"value {sparse_block_size} must be a power of two in [1, 128]")
    lead = tuple(query.shape[:q_rank - 2])
    if (sparse_indices.dim() != q_rank or tuple(sparse_indices.shape[:q_rank - 2]) != lead
            or sparse_indices.size(-2) != 1 or sparse_indices.size(-1) < 1):
        fail("sparse_indices", f"expected shape {[*lead, 1, 'K>=1']}, got {tuple(sparse_indices.shape)}")
    H = query.size(-2)
    if sinks is not None and tuple(sinks.shape) != (H,):
        fail("sinks", f"expected shape [Q_N={H}], got {tuple(sinks.shape)}")
    if content is None:
        content = content_checks_enabled(query, key, sparse_indices, block_table, actual_seq_lengths_query,
                                         actual_seq_lengths_kv)
    # ---- query rows --------------------------------------------------------------------
    if layout_query == "TND":
        if actual_seq_lengths_query is None:
            fail("actual_seq_lengths_query", "is required for layout TND (cumulative ends)")
        if actual_seq_lengths_query.dim() != 1 or actual_seq_lengths_query.size(0) < 1:
            fail("actual_seq_lengths_query", f"expected shape [B], got {tuple(actual_seq_lengths_query.shape)}")
        rows = query_rows(query, "TND", _cumulative(actual_seq_lengths_query), None, q_name="query",
                          cu_name="actual_seq_lengths_query", content=content)
    else:
        rows = query_rows(query, "BSND", None, actual_seq_lengths_query, q_name="query",
                          used_name="actual_seq_lengths_query", content=content)
        if actual_seq_lengths_query is not None:
            rows.extent = actual_seq_lengths_query.to(torch.int64)
    B = rows.B
    # ---- packed cache ------------------------------------------------------------------
    layout = LAYOUTS_KV[layout_kv]
    if layout == "TND" and actual_seq_lengths_kv is None:
        fail("actual_seq_lengths_kv", "is required for layout TND (cumulative ends)")
    if layout == PAGED:
        if block_table is None:
            fail("block_table", "is required for layout_kv PA_BSND")
        if actual_seq_lengths_kv is None:
            fail("actual_seq_lengths_kv", "is required for layout_kv PA_BSND")
        if key.dim() == 4 and key.size(1) % sparse_block_size:
            fail("sparse_block_size", f"value {sparse_block_size} must divide the block size {key.size(1)}")
    elif block_table is not None:
        fail("block_table", f"must be None for the non-paged layout_kv {layout_kv}")
    if layout == "TND":
        if actual_seq_lengths_kv.dim() != 1 or actual_seq_lengths_kv.size(0) != B:
            fail("actual_seq_lengths_kv", f"expected shape [B={B}], got {tuple(actual_seq_lengths_kv.shape)}")
        kv = kv_source("key", key, "TND", B, cu=_cumulative(actual_seq_lengths_kv), cu_name="actual_seq_lengths_kv",
                       seqused=None, used_name="actual_seq_lengths_kv", block_table=None, table_name="block_table",
                       content=content)
    else:
        kv = kv_source("key", key, layout, B, cu=None, cu_name="actual_seq_lengths_kv", seqused=actual_seq_lengths_kv,
                       used_name="actual_seq_lengths_kv", block_table=block_table, table_name="block_table",
                       content=content)
    if layout == PAGED and content:
        cap = block_table.size(1) * key.size(1)
        for b, v in enumerate(host_ints(actual_seq_lengths_kv)):
            if v > cap:
                fail("actual_seq_lengths_kv", f"value {v} at batch {b} exceeds the paged cache's capacity {cap} "
                     f"(block_table columns {block_table.size(1)} x block size {key.size(1)})")
    idx = rows.flat(sparse_indices)[:, 0]
    return QsfaProblem(query, rows, kv, idx, float(scale_value), sinks, sparse_block_size, sparse_mode == 3,
                       rope_head_dim)


def candidate_tokens(P: QsfaProblem, t0: int, t1: int):
    """Token positions ``[n, K·bs]`` of rows ``[t0, t1)`` and the mask of visible ones."""
    rows, bs = P.rows, P.block
    b, i = rows.batch[t0:t1], rows.local[t0:t1]
    S1, S2 = rows.extent[b], P.kv.lengths[b]
    thr = S2 - S1 + i + 1 if P.causal else S2
    idx = P.idx[t0:t1].to(torch.int64)
    K = idx.size(1)
    n_blocks = torch.clamp(torch.div(thr + bs - 1, bs, rounding_mode="floor"), 0, K)
    listed = torch.cumprod((idx >= 0).to(torch.int32), dim=1).bool()      # -1 ends the list
    slot = torch.arange(K, device=idx.device)
    block_ok = listed & (slot[None] < n_blocks[:, None]) & (idx * bs < thr[:, None])
    tok = idx[:, :, None] * bs + torch.arange(bs, device=idx.device)
    end = torch.minimum(S2, thr)
    mask = block_ok[:, :, None] & (tok < end[:, None, None]) & rows.used[t0:t1, None, None]
    return b, tok.flatten(1), mask.flatten(1)
