"""Golden reference of ``sparse_flash_mla`` and ``sparse_flash_mla_grad`` (20-sparse-flash-mla §1.4, §3.4).

Plain loops over batch and query row, the spec's math and nothing clever.  Key lists come
from the scalar rules of :mod:`dsattn.common.masks`; key rows are read one at a time through
the layout's addressing.  ``compute_dtype`` (default: float32, float64 for float64 inputs)
is the accumulation dtype; ``float64`` gives a rounding-free view of the math.  P is
rounded to the query dtype before P·V (and ``dS`` before its products) exactly as the CANN
golden does; pass ``emulate_rounding=False`` to skip those roundings.
"""
from __future__ import annotations

import torch

from ..common.checks import host_ints, stat_dtype
from ..common.masks import cmp_threshold, ori_range, sparse_walk
from ..common.softmax import finite_sinks, round_q
from .problem import MlaProblem, check_grad_inputs, lse_from_rows, lse_to_rows, parse_mla


def _row_keys(P: MlaProblem, b: int, i: int, t: int, S1e: int, lens: dict):
    """(ori positions, cmp (slot, index) pairs) of one used row, or None if the row is invalid."""
    S2o = lens["S2o"][b]
    p = S2o - S1e + i
    if p < 0 and P.positional:
        return None
    lo, hi = ori_range(p, S2o, P.om, P.wl, P.wr)
    ori = list(range(lo, hi))
    cmp = []
    if P.cmp is not None:
        pc = lens["Lc"][b] - S1e + i
        thr = cmp_threshold(pc, S2o, lens["S2c"][b], P.r, P.cm)
        if P.cmp_idx is None:
            cmp = [(None, j) for j in range(thr)]
        else:                                                  # min(K, thr, cmp_topk_length) slots (20 §2.8)
            limit = thr if P.cmp_len is None else min(thr, int(P.cmp_len[t]))
            cmp = sparse_walk(host_ints(P.cmp_idx[t]), limit, thr)
    return ori, cmp


def _lengths(P: MlaProblem) -> dict:
    lens = {"S2o": host_ints(P.ori.lengths)}
    if P.cmp is not None:
        lens["S2c"] = host_ints(P.cmp.lengths)
        lens["Lc"] = host_ints(P.Lc)
    return lens


def _key_matrix(P: MlaProblem, b: int, ori, cmp, dtype) -> torch.Tensor:
    rows = [P.ori.row(b, x) for x in ori] + [P.cmp.row(b, j) for _, j in cmp]
    return torch.stack(rows).to(dtype)


def sparse_flash_mla(q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, cmp_sparse_indices=None,
                     ori_block_table=None, cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                     cu_seqlens_cmp_kv=None, seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None,
                     cmp_residual_kv=None, ori_topk_length=None, cmp_topk_length=None, sinks=None,
                     metadata=None, softmax_scale=1.0, cmp_ratio=1, ori_mask_mode=4, cmp_mask_mode=3,
                     ori_win_left=127, ori_win_right=0, layout_q="BSND", layout_kv="BSND",
                     topk_value_mode=1, return_softmax_lse=False, compute_dtype=None,
                     emulate_rounding=True):
    """Golden forward: ``(attn_out, softmax_lse)`` with the operator's shapes and dtypes."""
    args = dict(locals())
    for k in ("return_softmax_lse", "compute_dtype", "emulate_rounding"):
        args.pop(k)
    P = parse_mla(content=True, **args)
    cdt = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    rq = q.dtype if emulate_rounding else cdt
    qf = P.rows.flat(q)
    R, H, D = qf.shape
    out = torch.zeros(R, H, D, dtype=cdt)
    lse = torch.zeros(R, H, dtype=cdt)
    lens = _lengths(P)
    for b, i, t, S1e in P.rows.host_used_rows():
        keys = _row_keys(P, b, i, t, S1e, lens)
        if keys is None or not (keys[0] or keys[1]):
            continue                                           # invalid or empty row: 0 / 0
        K = _key_matrix(P, b, *keys, cdt)                      # [n, D], K = V
        s = P.scale * (qf[t].to(cdt) @ K.T)                    # [H, n]
        m = s.max(-1).values
        if sinks is not None:                                  # a +-inf sink is not in the maximum
            m = torch.maximum(m, finite_sinks(sinks, cdt))     # (+inf: l = inf, out 0, LSE +inf)
        e = torch.exp(s - m[:, None])
        l = e.sum(-1) + (torch.exp(sinks.to(cdt) - m) if sinks is not None else 0)
        out[t] = (round_q(e, rq) @ K) / l[:, None]
        lse[t] = m + torch.log(l)
    attn_out = P.rows.unflat(out.to(q.dtype), q)
    if not return_softmax_lse:
        return attn_out, torch.zeros((), dtype=stat_dtype(q))
    return attn_out, lse_from_rows(lse.to(stat_dtype(q)), q, layout_q)


def sparse_flash_mla_grad(q, dout, attn_out, softmax_lse, *, ori_kv=None, cmp_kv=None,
                          ori_sparse_indices=None, cmp_sparse_indices=None, cu_seqlens_q=None,
                          cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, seqused_q=None,
                          seqused_ori_kv=None, seqused_cmp_kv=None, cmp_residual_kv=None,
                          ori_topk_length=None, cmp_topk_length=None, sinks=None, metadata=None,
                          softmax_scale=1.0, cmp_ratio=1, ori_mask_mode=4, cmp_mask_mode=3,
                          ori_win_left=127, ori_win_right=0, layout_q="BSND", layout_kv="BSND",
                          compute_dtype=None, emulate_rounding=True):
    """Golden backward: ``(dq, dori_kv, dcmp_kv, dsinks, ori_softmax_l1_norm, cmp_softmax_l1_norm)``."""
    args = dict(locals())
    for k in ("dout", "attn_out", "softmax_lse", "compute_dtype", "emulate_rounding"):
        args.pop(k)
    check_grad_inputs(q, dout, attn_out, softmax_lse, layout_q, layout_kv)
    P = parse_mla(content=True, **args)
    cdt = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    rq = q.dtype if emulate_rounding else cdt
    sdt = stat_dtype(q)
    rows = P.rows
    qf, dof, of = rows.flat(q), rows.flat(dout), rows.flat(attn_out)
    lse = lse_to_rows(softmax_lse, rows).to(cdt)
    R, H, D = qf.shape
    dq = torch.zeros(R, H, D, dtype=cdt)
    dori = torch.zeros(ori_kv.shape, dtype=cdt)
    dcmp = torch.zeros(cmp_kv.shape, dtype=cdt) if cmp_kv is not None else None
    dsinks = torch.zeros(H, dtype=cdt)
    cmp_l1 = torch.zeros(R, P.cmp_idx.size(1), dtype=cdt) if P.cmp_idx is not None else None
    ori_l1 = torch.zeros(R, P.ori_idx.size(1), dtype=cdt) if P.ori_idx is not None else None
    lens = _lengths(P)

    def add_row(src, grad, b, x, value):
        """grad[row x of batch b] += value, through the source's (non-paged) addressing."""
        if src.layout == "BSND":
            grad[b, x, 0] += value
        else:
            grad[int(src.cu[b]) + x, 0] += value

    for b, i, t, S1e in P.rows.host_used_rows():
        keys = _row_keys(P, b, i, t, S1e, lens)
        if keys is None or not (keys[0] or keys[1]):
            continue
        ori, cmp = keys
        K = _key_matrix(P, b, ori, cmp, cdt)                    # [n, D]
        qt, dO, O = qf[t].to(cdt), dof[t].to(cdt), of[t].to(cdt)
        s = P.scale * (qt @ K.T)                                # [H, n]
        Pm = torch.exp(s - lse[t][:, None])
        dP = dO @ K.T
        Dsum = (dO * O).sum(-1)
        dS = round_q(Pm * (dP - Dsum[:, None]), rq)
        dq[t] = P.scale * (dS @ K)
        dK = P.scale * (dS.T @ qt) + round_q(Pm, rq).T @ dO     # [n, D]: key and value parts
        for n, x in enumerate(ori):
            add_row(P.ori, dori, b, x, dK[n])
        for n, (_, j) in enumerate(cmp):
            add_row(P.cmp, dcmp, b, j, dK[len(ori) + n])
        if sinks is not None:                                   # a head with LSE +inf (+inf sink): none
            g = -torch.exp(sinks.to(cdt) - lse[t]) * (Pm * dP).sum(-1)
            dsinks += torch.where(torch.isfinite(lse[t]), g, torch.zeros_like(g))
        Pmean = Pm.mean(0)                                      # head mean, [n]
        if cmp_l1 is not None:
            for n, (s_, _) in enumerate(cmp):
                cmp_l1[t, s_] = Pmean[len(ori) + n]
        if ori_l1 is not None:
            lo = ori[0] if ori else 0
            for s_, x in enumerate(host_ints(P.ori_idx[t])):
                if x < 0:
                    break
                if x in range(lo, lo + len(ori)):
                    ori_l1[t, s_] = Pmean[x - lo]
    empty = torch.zeros(0, dtype=sdt)
    return (rows.unflat(dq.to(q.dtype), q),
            dori.to(ori_kv.dtype),
            dcmp.to(cmp_kv.dtype) if dcmp is not None else torch.zeros(0, dtype=q.dtype),
            dsinks.to(sdt) if sinks is not None else empty,
            ori_l1.to(sdt).reshape(ori_sparse_indices.shape) if ori_l1 is not None else empty,
            cmp_l1.to(sdt).reshape(cmp_sparse_indices.shape) if cmp_l1 is not None else empty)
