"""Golden reference of ``kv_quant_sparse_flash_attention`` (40-kv-quant §4.4): a loop over
used query rows, the block walk of the spec token by token, one packed row at a time
unpacked and dequantised, the two partial dot products formed separately."""
from __future__ import annotations

import torch

from ..common.checks import host_ints
from ..common.softmax import finite_sinks, round_q
from ..quant.rows import KV_LORA_RANK, unpack_kv_rows
from .problem import QsfaProblem, parse_qsfa


def visible_tokens(indices: list[int], S1: int, S2: int, i: int, bs: int, causal: bool) -> list[int]:
    """Tokens of query row i (§4.4): listed blocks in order, -1 ends the list, blocks starting
    at or past the threshold are skipped, a block straddling it is cut."""
    thr = S2 - S1 + i + 1 if causal else S2
    if thr <= 0:
        return []
    toks = []
    for s in range(min(len(indices), -(-thr // bs))):
        idx = indices[s]
        if idx < 0:
            break
        start = idx * bs
        if start >= thr:
            continue
        toks += range(start, min(start + bs, S2, thr))
    return toks


def _dequant_row(P: QsfaProblem, row: torch.Tensor):
    nope, rope, scales = unpack_kv_rows(row, P.R, P.query.dtype)
    k = (nope.float().reshape(-1, 128) * scales[:, None]).reshape(KV_LORA_RANK)
    return round_q(k, P.query.dtype), (rope.float() if rope is not None else None)


def kv_quant_sparse_flash_attention(query, key, value, sparse_indices, scale_value=1.0, *, key_quant_mode=2,
                                    value_quant_mode=2, key_dequant_scale=None, value_dequant_scale=None,
                                    block_table=None, actual_seq_lengths_query=None, actual_seq_lengths_kv=None,
                                    sinks=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                                    sparse_mode=3, pre_tokens=2 ** 63 - 1, next_tokens=2 ** 63 - 1,
                                    attention_mode=2, quant_scale_repo_mode=1, tile_size=128, rope_head_dim=64,
                                    return_softmax_lse=False):
    """Golden forward: ``(attention_out, softmax_max, softmax_sum)`` with the operator's shapes."""
    attrs = dict(locals())
    for k in ("query", "key", "value", "sparse_indices", "scale_value", "return_softmax_lse"):
        attrs.pop(k)
    P = parse_qsfa(query, key, value, sparse_indices, scale_value, content=True, **attrs)
    qf = P.rows.flat(query)
    Rq, H, _ = qf.shape
    out = torch.zeros(Rq, H, KV_LORA_RANK)
    smax = torch.zeros(Rq, H)
    ssum = torch.zeros(Rq, H)
    S2s = host_ints(P.kv.lengths)
    for b, i, t, S1 in P.rows.host_used_rows():
        toks = visible_tokens(host_ints(P.idx[t]), S1, S2s[b], i, P.block, P.causal)
        if not toks:
            continue                                            # empty row: 0, 0, 0
        q = qf[t].float()
        knope, rope = zip(*(_dequant_row(P, P.kv.row(b, x)) for x in toks))
        V = torch.stack(knope)                                  # [n, 512]
        s = q[:, :KV_LORA_RANK] @ V.T
        if P.R:
            s = s + q[:, KV_LORA_RANK:] @ torch.stack(rope).T   # added after, in this order
        s = P.scale * s
        m = s.max(-1).values
        if P.sinks is not None:
            m = torch.maximum(m, finite_sinks(P.sinks, m.dtype))   # +-inf sinks: not in the maximum
        e = torch.exp(s - m[:, None])
        l = e.sum(-1) + (torch.exp(P.sinks - m) if P.sinks is not None else 0)
        out[t] = (round_q(e, query.dtype) @ V) / l[:, None]
        smax[t], ssum[t] = m, l
    attn = P.rows.unflat(out.to(query.dtype), query)
    if not return_softmax_lse:
        empty = torch.zeros(0)
        return attn, empty, empty.clone()
    return attn, smax.reshape(P.stats_shape()), ssum.reshape(P.stats_shape())
