"""Structure-aware forward for blocks of consecutive query rows of one batch (prefill, chunked
prefill): the rows' windows overlap, so their raw keys are one contiguous range gathered once
(a slice of a BSND / TND cache, one gather of a paged one) and scored with one GEMM under a
band mask; a dense compressed branch (HCA) is likewise one shared causal prefix.  Only a
sparse compressed branch (CSA) is gathered per row.

The softmax is the golden's single pass over both branches (one maximum including the sink,
P rounded to the query dtype before P·V), so results differ from the golden only by
summation order.
"""
from __future__ import annotations

import torch

from ..common.masks import cmp_threshold_t, ori_range_t, sparse_walk_t
from ..common.softmax import attend_branches
from .problem import MlaProblem

def _gather_range(src, b, xs, mask, dtype, check: bool):
    """Key rows ``xs`` of batch ``b``; only those some row of ``mask [n, len(xs)]`` selects are
    addressed (a key seen only by padding rows may sit on an unmapped page).  The others hold a
    placeholder row: :func:`attend_branches` replaces their scores and value rows (00 §8)."""
    i0, i1 = src.locate(b.reshape(1), xs, mask.any(0), check=check)
    return src.gather(i0, i1).to(dtype)


def block_forward(P: MlaProblem, t0: int, t1: int, b: int, cdt: torch.dtype):
    """Rows [t0, t1) of batch b -> (out [n, H, D] cdt, lse [n, H] cdt)."""
    rows, dev = P.rows, P.q.device
    bt = torch.tensor(b, device=dev)
    i = rows.local[t0:t1]
    S1e, S2o = rows.extent[b], P.ori.lengths[b]
    p = S2o - S1e + i
    # The shared key ranges are taken over every row with a position (not only the used ones), so
    # a valid row is computed bit for bit the same with or without seqused_q (20 §1.1).
    inb = p >= 0 if P.positional else torch.ones_like(p, dtype=torch.bool)
    valid = rows.used[t0:t1] & inb
    n, H, D = t1 - t0, P.q.size(-2), P.q.size(-1)
    out = torch.zeros(n, H, D, dtype=cdt, device=dev)
    lse = torch.zeros(n, H, dtype=cdt, device=dev)
    if not bool(inb.any()):
        return out, lse
    q = torch.where(valid[:, None, None], P.rows.flat(P.q)[t0:t1].to(cdt), torch.zeros((), dtype=cdt, device=dev))
    lo, hi = ori_range_t(p, S2o, P.om, P.wl, P.wr)
    big = torch.iinfo(torch.int64).max
    lo_u = int(torch.where(inb & (hi > lo), lo, big).min())
    hi_u = int(torch.where(inb, hi, 0).max())
    scores, values, masks = [], [], []
    if hi_u > lo_u:
        xs = torch.arange(lo_u, hi_u, device=dev)
        masks.append(valid[:, None] & (xs[None] >= lo[:, None]) & (xs[None] < hi[:, None]))
        K = _gather_range(P.ori, bt, xs, masks[-1], cdt, P.content)
        scores.append(torch.einsum("nhd,ud->nhu", q, K))
        values.append(("shared", K))
    if P.cmp is not None:
        pc = P.Lc[b] - S1e + i
        thr = cmp_threshold_t(pc, S2o, P.cmp.lengths[b], P.r, P.cm)
        if P.cmp_idx is None:
            hi_c = int(torch.where(inb, thr, 0).max())
            if hi_c > 0:
                xs = torch.arange(hi_c, device=dev)
                masks.append(valid[:, None] & (xs[None] < thr[:, None]))
                K = _gather_range(P.cmp, bt, xs, masks[-1], cdt, P.content)
                scores.append(torch.einsum("nhd,ud->nhu", q, K))
                values.append(("shared", K))
        else:
            cx = P.cmp_idx[t0:t1, :P.cmp_width].to(torch.int64)
            cm = sparse_walk_t(cx, P.walk_limit(thr, t0, t1), thr) & valid[:, None]
            i0, i1 = P.cmp.locate(bt.expand(n)[:, None], cx, cm, check=P.content)
            K = P.cmp.gather(i0, i1).to(cdt)
            K.masked_fill_(~cm[..., None], 0.0)                     # unselected slots may hold NaN
            masks.append(cm)
            scores.append(torch.einsum("nhd,nwd->nhw", q, K))
            values.append(("per_row", K))
    if not scores:
        return out, lse
    out, lse, _ = attend_branches(scores, masks, values, P.scale, P.sinks, P.q.dtype)
    return out, lse


def batch_row_ranges(P: MlaProblem):
    """(b, first flattened row, extent) of every batch, read on the host (CPU tensors only)."""
    ext = P.rows.extent.tolist()
    if P.rows.layout == "BSND":
        S1 = P.q.size(1)
        return [(b, b * S1, e) for b, e in enumerate(ext)]
    starts, acc = [], 0
    for b, e in enumerate(ext):
        starts.append((b, acc, e))
        acc += e
    return starts
