"""Cases for ``kv_quant_sparse_flash_attention`` over the packed int8 / fp8 cache (40 §4.8):
ragged batches, all three layout pairs, sparse blocks of 1..16 tokens, -1 tails, all -1 rows,
duplicates, indices past the visible range.  Packed rows that no index list references, and
every padding / spare row, are 0xFF bytes (NaN scales and rope), so a stray read shows up."""
from __future__ import annotations

import torch

from ..quant.block import quantize_tiles
from ..quant.rows import pack_kv_rows, quantize_kv_rows
from .attention import Case, _pack_int_rows, _pack_rows, _page, _randn, sharedkv_case

NAN_BYTE = 0xFF


def packed_rows(g, n: int, rope_head_dim: int, payload, rope_dtype) -> torch.Tensor:
    """``n`` random packed rows ``[n, 1, W]`` as uint8 bytes."""
    nope, scales = quantize_tiles(_randn(g, n, 512, scale=2.0), payload, 128)
    rope = _randn(g, n, rope_head_dim, dtype=rope_dtype) if rope_head_dim else None
    return pack_kv_rows(nope, scales, rope).view(torch.uint8)[:, None, :]


def qsfa_case(layout_q: str = "TND", layout_kv: str = "PA_BSND", dtype=torch.bfloat16, *, rope_head_dim: int = 64,
              payload=torch.int8, sparse_block_size: int = 1, sparse_mode: int = 3, sinks: bool = True,
              lengths: list[tuple[int, int]] | None = None, H: int = 4, K: int = 8, block_size: int = 16,
              seed: int = 0, lse: bool = True) -> Case:
    """``lengths`` = per batch (S1, S2).  Default: ragged, including a KV length that ends in
    the middle of a page and a batch with more queries than keys."""
    g = torch.Generator().manual_seed(seed)
    bs = sparse_block_size
    if lengths is None:
        lengths = [(5, 37), (3, 2), (4, 21)] if layout_q == "TND" else [(4, 37), (4, 2), (3, 21)]
    S1s, S2s = [a for a, _ in lengths], [b for _, b in lengths]
    qd = 512 + rope_head_dim
    q_rows = [_randn(g, s, H, qd, dtype=dtype, scale=0.1) for s in S1s]
    idx_rows, kv_rows = [], []
    for b, (S1, S2) in enumerate(lengths):
        nb = -(-S2 // bs)
        x = torch.randint(0, nb + 2, (S1, K), generator=g, dtype=torch.int32)   # some past the end: skipped
        cut = torch.randint(1, K + 1, (S1,), generator=g)
        x[torch.arange(K)[None, :] >= cut[:, None]] = -1
        if S1 > 2:
            x[1] = -1                                          # an all -1 row
            x[2, 0] = x[2, 1]                                  # a duplicate
        idx_rows.append(x[:, None, :])
        rows = packed_rows(g, S2, rope_head_dim, payload, dtype)
        listed = torch.zeros(nb + 2, dtype=torch.bool)
        for r in range(S1):
            for v in x[r].tolist():
                if v < 0:
                    break
                listed[v] = True
        for tok in range(S2):
            if not listed[tok // bs]:
                rows[tok] = NAN_BYTE                           # no list references it
        kv_rows.append(rows)
    if layout_q == "BSND":
        S1 = max(S1s)
        q, _ = _pack_rows(q_rows, "BSND", S1 + 1)             # a padding row past every S1
        kw = dict(actual_seq_lengths_query=torch.tensor(S1s, dtype=torch.int32))
        idx = _pack_int_rows(idx_rows, "BSND", S1 + 1)
    else:
        q, cu = _pack_rows(q_rows, "TND", None, tail=2)
        kw = dict(actual_seq_lengths_query=cu[1:].clone())
        idx = _pack_int_rows(idx_rows, "TND", None, tail=2)
    if layout_kv == "PA_BSND":
        key, kw["block_table"] = _page(kv_rows, block_size, g, fill=NAN_BYTE)
        kw["actual_seq_lengths_kv"] = torch.tensor(S2s, dtype=torch.int32)
    else:
        key, cu_kv = _pack_rows(kv_rows, layout_kv, max(S2s) + 2, tail=2, fill=NAN_BYTE)
        kw["actual_seq_lengths_kv"] = (cu_kv[1:].clone() if layout_kv == "TND"
                                       else torch.tensor(S2s, dtype=torch.int32))
    key = key.view(payload)
    kw.update(sparse_block_size=bs, layout_query=layout_q, layout_kv=layout_kv, sparse_mode=sparse_mode,
              rope_head_dim=rope_head_dim, return_softmax_lse=lse, scale_value=qd ** -0.5)
    if sinks:
        kw["sinks"] = _randn(g, H, scale=1.5)
    name = (f"qsfa-{layout_q}+{layout_kv}-{str(dtype).split('.')[-1]}-rope{rope_head_dim}-"
            f"{'int8' if payload == torch.int8 else 'fp8'}-sb{bs}-mode{sparse_mode}{'-sinks' if sinks else ''}"
            f"{'-lse' if lse else ''}")
    return Case(name, q, kw, {"key": key, "sparse_indices": idx})


def pack_sharedkv_caches(kwargs: dict, rope: int, payload, tile: int) -> dict:
    """sharedkv arguments with ``ori_kv`` / ``cmp_kv`` as packed rows (:func:`quantize_kv_rows`)
    for ``sparse_attn_sharedkv_packed``; rows that were NaN (unreachable) become 0xFF bytes."""
    args = dict(kwargs, kv_rope_dim=rope, kv_tile_size=tile)
    for name in ("ori_kv", "cmp_kv"):
        if name in args:
            kv = args[name]
            packed = quantize_kv_rows(torch.nan_to_num(kv, nan=0.0), rope, payload, tile)
            unreachable = kv.isnan().any(-1, keepdim=True).expand_as(packed)
            args[name] = packed.view(torch.uint8).masked_fill(unreachable, NAN_BYTE).view(payload)
    return args


def packed_sharedkv_case(layout: str = "TND", ratio: int = 4, dtype=torch.bfloat16, *, paged: bool = True,
                         payload=torch.int8, rope: int = 16, tile: int = 16, seed: int = 0, **kw) -> Case:
    """A :func:`sharedkv_case` whose caches are packed rows (:func:`quantize_kv_rows`) for
    ``sparse_attn_sharedkv_packed``; rows that were NaN (unreachable) become 0xFF bytes.
    ``extra["unpacked"]`` keeps the unquantised sharedkv arguments."""
    c = sharedkv_case(layout, ratio, dtype, paged=paged, seed=seed, **kw)
    args = pack_sharedkv_caches(c.kwargs, rope, payload, tile)
    return Case(f"{c.name}+{str(payload).split('.')[-1]}", c.q, args, dict(c.extra, unpacked=c.kwargs))


# ----------------------------------------------------------------------------- quant_lightning_indexer


def quant_indexer_case(base: Case, key_dtype: torch.dtype, scale_layout: str = "separate", query: str = "float",
                       block_pad: int = 0, scale_dtype: torch.dtype = torch.float32) -> Case:
    """A ``quant_lightning_indexer`` case from a ``lightning_indexer`` case: its keys quantised per token
    (a NaN row, one no query reads, keeps a NaN scale and so decodes to NaN) and stored with their scales
    in ``scale_layout``; ``query="quant"`` quantises the query per token and head to the key format, else
    the case's float query is kept.  ``block_pad`` bytes of padding after each block of a ``"block"``
    cache give it a block stride of its own; ``scale_dtype`` (fp32 / fp16) is that of the scales given in their own
    tensors (the key's ``"separate"`` scales, a quantised query's)."""
    from ..quant.index_keys import pack_index_blocks, pack_index_rows, quantize_index_keys
    k, w, topk = base.extra["k"], base.extra["w"], base.extra["topk"]
    values, scales = quantize_index_keys(k.float(), key_dtype)
    key, key_scale = values, scales.to(scale_dtype)
    if scale_layout == "row":
        key, key_scale = pack_index_rows(values, scales), None
    elif scale_layout == "block":
        blocks = pack_index_blocks(values[:, :, 0], scales[:, :, 0])
        padded = torch.full((blocks.size(0), blocks.size(1) + block_pad), NAN_BYTE, dtype=torch.uint8)
        padded[:, :blocks.size(1)] = blocks.view(torch.uint8)
        key, key_scale = padded[:, :blocks.size(1)].view(key_dtype), None
    q, q_scale = base.q, None
    if query == "quant":
        q, q_scale = quantize_index_keys(base.q.float(), key_dtype)
        q_scale = q_scale.to(scale_dtype)
    kw = dict(base.kwargs, key_scale_layout=scale_layout)
    name = (f"{base.name.replace('indexer', 'qindexer', 1)}-{'int8' if key_dtype == torch.int8 else 'fp8'}-{scale_layout}"
            f"{'-qquant' if query == 'quant' else ''}{'-fp16scales' if scale_dtype == torch.float16 else ''}")
    return Case(name, q, kw, {"key": key, "w": w, "topk": topk, "query_dequant_scale": q_scale,
                              "key_dequant_scale": key_scale})
