"""Golden references of ``lightning_indexer`` and ``sparse_lightning_indexer_kl_loss_grad``
(10-indexer §1.4, §2.5): plain loops over batch and query row, the spec's math.

``compute_dtype`` (default float32) is the accumulation dtype; ``emulate_rounding=False``
skips the rounding of dS to the query dtype in the KL gradient.
"""
from __future__ import annotations

import torch

from ..common.checks import host_ints
from ..common.masks import indexer_num_valid, sparse_walk
from ..common.softmax import round_q
from .problem import (IndexerProblem, check_index_pair, check_lightning_attrs, check_offset, check_offset_results,
                      parse_indexer)


def _keys(P: IndexerProblem, b: int, js, dtype) -> torch.Tensor:
    return torch.stack([P.k.row(b, j) for j in js]).to(dtype)


def lightning_indexer(q, k, w, topk, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                      cmp_residual_k=None, block_table=None, output_idx_offset=None, metadata=None,
                      max_seqlen_q=-1, layout_q="BSND", layout_k="BSND", mask_mode=0, cmp_ratio=1,
                      return_value=0, compute_dtype=torch.float32):
    """Golden top-k selection: ``(sparse_indices int32, sparse_values float32 or (0,))``."""
    check_lightning_attrs(topk, max_seqlen_q, return_value)
    P = parse_indexer(q, k, w, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                      seqused_k=seqused_k, cmp_residual_k=cmp_residual_k, block_table=block_table,
                      metadata=metadata, layout_q=layout_q, layout_k=layout_k, mask_mode=mask_mode,
                      cmp_ratio=cmp_ratio, k_layouts=("BSND", "TND", "PA_BBND"), content=True)
    offset = check_offset(output_idx_offset, P, layout_q)
    qf = P.rows.flat(q)
    idx = torch.full((P.rows.R, topk), -1, dtype=torch.int32)
    val = torch.full((P.rows.R, topk), float("-inf"), dtype=torch.float32)
    Kc, resid = host_ints(P.k.lengths), host_ints(P.resid)
    for b, i, t, S1e in P.rows.host_used_rows():
        n = indexer_num_valid(Kc[b], P.r, resid[b], S1e, i, mask_mode)
        c = min(n, topk)
        if c <= 0:
            continue
        K = _keys(P, b, range(n), compute_dtype)                              # [n, D]
        s = torch.relu(qf[t].to(compute_dtype) @ K.T)                         # [N1, n]
        score = (P.w[t].to(compute_dtype)[:, None] * s).sum(0)                # [n]
        order = torch.sort(-score, stable=True).indices[:c]                   # ties: lower index first
        idx[t, :c] = order.to(torch.int32) + (int(offset[t]) if offset is not None else 0)
        val[t, :c] = score[order].float()
    check_offset_results(idx, offset, True)
    out_idx = P.rows.unflat(idx, q).unsqueeze(-2)
    if not return_value:
        return out_idx, torch.zeros(0, dtype=torch.float32)
    return out_idx, P.rows.unflat(val, q).unsqueeze(-2)


def quant_lightning_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, topk, quant_mode, *,
                            compute_dtype=torch.float32, **kw):
    """Golden of ``quant_lightning_indexer``: the query and every key dequantised (``fp32(code) x scale``),
    then the ``lightning_indexer`` golden on them."""
    from .quant import parse_quant_indexer
    P, _, _ = parse_quant_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, topk, quant_mode,
                                  dict(kw), True)
    q = query.float() if P.q_scale is None else query.float() * query_dequant_scale.float()[..., None]
    keys = P.pool.dequantize()                                                 # [blocks, bs, D]
    k = keys[:, 0, None] if kw.get("layout_k", "BSND") == "TND" else keys[:, :, None]
    kw = {n: v for n, v in kw.items() if n != "key_scale_layout"}
    return lightning_indexer(q, k, weights, topk, compute_dtype=compute_dtype, **kw)


def sparse_lightning_indexer_kl_loss_grad(q, k, w, sparse_indices, attn_softmax_l1_norm, *, cu_seqlens_q=None,
                                          cu_seqlens_k=None, seqused_q=None, seqused_k=None, cmp_residual_k=None,
                                          metadata=None, layout_q="TND", layout_k="TND", mask_mode=3, cmp_ratio=1,
                                          compute_dtype=torch.float32, emulate_rounding=True):
    """Golden KL-loss gradient: ``(dq, dk, dw, softmax_out)``."""
    P = parse_indexer(q, k, w, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                      seqused_k=seqused_k, cmp_residual_k=cmp_residual_k, block_table=None, metadata=metadata,
                      layout_q=layout_q, layout_k=layout_k, mask_mode=mask_mode, cmp_ratio=cmp_ratio,
                      k_layouts=("BSND", "TND"), content=True)
    check_index_pair(q, layout_q, sparse_indices, attn_softmax_l1_norm)
    cdt = compute_dtype
    rq = q.dtype if emulate_rounding else cdt
    rows = P.rows
    qf = rows.flat(q)
    idx, pt = rows.flat(sparse_indices)[:, 0], rows.flat(attn_softmax_l1_norm)[:, 0]
    R, H, D = qf.shape
    dq = torch.zeros(R, H, D, dtype=cdt)
    dk = torch.zeros(k.shape, dtype=cdt)
    dw = torch.zeros(R, H, dtype=cdt)
    soft = torch.zeros(R, idx.size(1), dtype=cdt)
    Kc, resid = host_ints(P.k.lengths), host_ints(P.resid)
    for b, i, t, S1e in P.rows.host_used_rows():
        real_k = indexer_num_valid(Kc[b], P.r, resid[b], S1e, i, mask_mode)
        slots = sparse_walk(host_ints(idx[t]), real_k, real_k)
        if not slots:
            continue
        ss = [s for s, _ in slots]
        js = [j for _, j in slots]
        K = _keys(P, b, js, cdt)                                   # [n, D]
        qt, wt = qf[t].to(cdt), P.w[t].to(cdt)
        S = qt @ K.T                                               # [H, n]
        I = (wt[:, None] * torch.relu(S)).sum(0)                   # [n]
        y = torch.softmax(I, dim=0)
        p = pt[t, ss].to(cdt)
        dI = y * p.sum() - p
        dw[t] = (torch.relu(S) * dI[None, :]).sum(-1)
        dS = round_q(dI[None, :] * wt[:, None] * (S > 0), rq)     # [H, n]
        dq[t] = dS @ K
        dK = dS.T @ qt                                             # [n, D]
        for n, j in enumerate(js):
            if P.k.layout == "BSND":
                dk[b, j, 0] += dK[n]
            else:
                dk[int(P.k.cu[b]) + j, 0] += dK[n]
        soft[t, ss] = y
    return (rows.unflat(dq.to(q.dtype), q), dk.to(k.dtype), rows.unflat(dw.float(), q),
            rows.unflat(soft.float(), q).unsqueeze(-2))
