"""Execute a ``sparse_attn_sharedkv_metadata`` plan (50 §4): core by core, then the
flash-decode reduction.

Each enabled cube core walks its range ``[start, end)`` of (bn2, m-block, s2-block) units.
A row (m-block) the core holds whole is finished on that core: its query rows attend over
all their keys (window keys, then compressed keys) with the sink (the whole rows of all cores
are computed here in one batched pass).  A row split across cores
leaves one *partial state* per core in the FD workspace: attention over only the keys of the
core's s2-blocks, normalised, with its LSE and without the sink.  Each enabled vector core
then merges the partial states of its FD task for its slice of the m-block's rows by LSE,
adding the sink once (60-serving §7, :func:`merge_attention_states`).

The key of a row belongs to s2-block ``(x - first) // 512`` (window key at raw position x,
``first`` the m-block's clipped window start) or ``cmp_start + s // 512`` (compressed key in
top-k slot s, or compressed index s for the dense branch).  The plan is read on the host; a
plan that does not fit the call's lengths (a unit past a row's blocks, a row covered twice or
not at all) raises ``ValueError`` naming ``metadata``.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import native
from ..common.checks import fail, host_ints
from ..common.softmax import attend, attention_dtype, merge_attention_states
from ..planner import native as native_planner
from ..planner.fast import Rows
from ..planner.params import FA_CORES, FD_CORES, S2_BASE, plan_params
from ..planner.table import check_coverage, coverage, decode
from ..sparse_mla import fast
from ..sparse_mla.problem import MlaProblem


def plan_params_for(P: MlaProblem):
    """The planner parameters that describe this call (its own lengths and attributes)."""
    K = 0 if P.cmp_idx is None else P.cmp_idx.size(1)
    if P.cmp is not None and P.cmp_idx is not None and K not in (512, 1024):
        fail("metadata", f"a plan describes cmp_topk 512 or 1024, but cmp_sparse_indices has K={K}")
    as_mirror = lambda t: torch.tensor(host_ints(t), dtype=torch.int32)  # noqa: E731  (the plan is host work)
    try:
        return plan_params(P.q.size(-2), 1, P.q.size(-1), layout_q="TND", layout_kv="PA_ND",
                           seqused_q=as_mirror(P.rows.extent), seqused_kv=as_mirror(P.ori.lengths),
                           has_cmp_kv=P.cmp is not None, cmp_ratio=P.r if P.cmp is not None else -1, cmp_topk=K,
                           ori_mask_mode=P.om, cmp_mask_mode=P.cm, ori_win_left=P.wl, ori_win_right=P.wr)
    except ValueError as e:
        fail("metadata", f"this call cannot be described by a plan: {e}")


def read_plan(P: MlaProblem, metadata: torch.Tensor, check: bool):
    """The plan on the host: (params, the row records of this call, the plan's FD entries, its
    coverage: which rows each core holds whole, which it splits); ``check``: raise ValueError
    naming ``metadata`` when the plan does not fit the call (50 §5 invariants).  Read by the
    compiled layer where it is loaded (:func:`dsattn.planner.native.read_plan`), else in NumPy."""
    pp = plan_params_for(P)
    module = native.load()
    try:
        if module is not None:                # the same reading in one compiled call
            rw, fd, cov = native_planner.read_plan(module, metadata, pp, check)
            return pp, rw, fd, cov
        rw = Rows(pp, costs=False)
        plan = decode(metadata)
        cov = coverage(plan, rw)
        if check:
            check_coverage(plan, rw, cov, pp.B, FA_CORES, FD_CORES,
                           bool(plan.fd) or any(s[2] for s in plan.starts) or any(e[2] for e in plan.ends))
    except AssertionError as e:
        fail("metadata", f"the plan does not fit this call (built from other lengths or attributes?): "
             f"invariant {e}")
    return pp, rw, plan.fd, cov


def execute(P: MlaProblem, metadata: torch.Tensor) -> torch.Tensor:
    pp, rw, fd, cov = read_plan(P, metadata, P.content)
    S1 = pp.S1
    B, G, mb = pp.B, pp.G, pp.m_base
    off = rw.off

    q = P.q
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = P.rows.flat(q)
    R, H, D = qf.shape
    dev = q.device
    sinks = None if P.sinks is None else P.sinks.to(cdt)
    out = torch.zeros(R, H, D, dtype=cdt, device=dev)
    done = torch.zeros(R, H, dtype=torch.int32, device=dev)
    q_start = [b * q.size(1) for b in range(B)] if P.rows.layout == "BSND" else \
        [int(v) for v in (P.rows.extent.cumsum(0) - P.rows.extent).tolist()]

    def pairs(b, m, lo=0, hi=None):
        """(t, h) of rows ``[lo, hi)`` of m-block m of batch b."""
        n = min(mb, rw.S1v[b] * G - m * mb)
        hi = n if hi is None else hi
        rho = torch.arange(m * mb + lo, m * mb + hi, device=dev)
        t = q_start[b] + (S1[b] - int(rw.S1v[b])) + torch.div(rho, G, rounding_mode="floor")
        return t, rho % G

    kernels = fast.native_sources(P)

    def attend_rows(t0, t1, blocks=None, with_sinks=True):
        """Attention of flattened rows [t0, t1); ``blocks = (g, lo, hi)`` keeps only keys of s2-blocks
        [lo, hi) of global row record g (a partial state, normalised, LSE without the sink).  Whole
        rows take the compiled kernel where it runs; partial states stay fp32 (not rounded to the
        query dtype) until they are merged, as the FD workspace holds them."""
        compiled = kernels is not None and blocks is None and with_sinks
        k = fast.native_keys(P, kernels[1], t0, t1) if compiled else P.keys(t0, t1)
        mask = k.mask
        if compiled:
            o, lse = fast.native_rows(P, *kernels, qf, k, t0, t1, None if sinks is None else sinks.float())
            return (o.to(cdt), lse.to(cdt)), mask.any(-1)
        if blocks is not None:
            g, lo, hi = blocks
            ori_blk = torch.div(k.ori_x - int(rw.first[g]), S2_BASE, rounding_mode="floor")
            blk = ori_blk
            if k.cmp_mask is not None:
                col = torch.arange(k.cmp_mask.size(1), device=dev)[None].expand_as(k.cmp_mask)
                blk = torch.cat([ori_blk, int(rw.win_end[g]) + torch.div(col, S2_BASE, rounding_mode="floor")], 1)
            if P.content and bool((mask & ((blk < int(rw.s2_start[g])) | (blk >= int(rw.s2_end[g])))).any()):
                fail("metadata", f"row record {g} does not cover every key of its query rows; was the plan built "
                     "from these lengths and attributes?")
            mask = mask & (blk >= lo) & (blk < hi)
        adt = attention_dtype(q)
        keys = P.gather(k, adt)
        qb = torch.where(k.valid[:, None, None], qf[t0:t1].to(adt), torch.zeros((), dtype=adt, device=dev))
        return attend(qb, keys, mask, sinks if with_sinks else None, P.scale, q.dtype, k.valid), mask.any(-1)

    workspace = {}
    step = P.rows_per_block()
    # Rows a core holds whole are final on that core.  A CPU has no cube cores to hand them to, so
    # the whole rows of every core are computed in one batched pass; the per-core ranges still
    # decide which rows are whole and which are split, and ``done`` still catches a row planned twice.
    if cov.whole.size:
        # m-block m of batch b holds the (query, head) pairs base_b + [m mb, min((m + 1) mb, S1v G))
        # of the flattened [R, H] rows (H = G: one KV head)
        g = cov.whole
        b = np.searchsorted(off, g, side="right") - 1
        m = g - off[b]
        base = (np.asarray(q_start, dtype=np.int64)[b] + np.asarray(S1, dtype=np.int64)[b] - rw.S1v[b]) * G
        lo, hi = base + m * mb, base + np.minimum((m + 1) * mb, rw.S1v[b] * G)
        edges = np.zeros(R * H + 1, dtype=np.int32)
        np.add.at(edges, lo, 1)
        np.add.at(edges, hi, -1)
        count = torch.from_numpy(np.cumsum(edges[:-1], dtype=np.int32)).view(R, H).to(dev)
        done += count
        sel = count > 0
        t_lo, t_hi = int(lo.min()) // H, int(hi.max() - 1) // H + 1
        for t0 in range(t_lo, t_hi, step):
            t1 = min(t_hi, t0 + step)
            (o, _), _ = attend_rows(t0, t1)
            out[t0:t1] = torch.where(sel[t0:t1, :, None], o, out[t0:t1])
    for s in cov.partial:                                      # one partial state per split piece
        t, h = pairs(s.bn2, s.m)
        g = int(off[s.bn2]) + s.m
        t0, t1 = int(t.min()), int(t.max()) + 1
        (o, lse), has_key = attend_rows(t0, t1, (g, s.s2_lo, s.s2_hi), with_sinks=False)
        lt = t - t0
        workspace[s.slot] = (o[lt, h], lse[lt, h], has_key[lt])
    for bn2, m, ws, split, m_start, m_num in fd:
        t, h = pairs(bn2, m, m_start, m_start + m_num)
        parts = [workspace.get(ws + k) for k in range(split)]
        if any(p is None for p in parts):
            fail("metadata", f"FD entry for (bn2 {bn2}, m {m}) reads workspace slots {ws}..{ws + split - 1} that "
                 "no cube core wrote")
        sl = slice(m_start, m_start + m_num)
        o, _ = merge_attention_states([p[0][sl].float() for p in parts], [p[1][sl].float() for p in parts],
                                      sinks=None if sinks is None else sinks[h].float(),
                                      valid=[p[2][sl] for p in parts])
        out[t, h] = o.to(cdt)
        done.index_put_((t, h), torch.ones_like(t, dtype=torch.int32), accumulate=True)
    _check_and_fill(P, done, out, attend_rows)
    return P.rows.unflat(out.to(q.dtype), q)


def _check_and_fill(P, done, out, attend_rows):
    """Every valid (row, head) exactly once.  Rows the planner never plans (it clips S1 to S2:
    the first S1 - S2 rows of a batch, which see keys only with ori_mask_mode 0 and no
    compressed branch) are computed here, outside the plan."""
    rows = P.rows
    S1, S2 = rows.extent[rows.batch], P.ori.lengths[rows.batch]
    valid = rows.used & ((S2 - S1 + rows.local >= 0) if P.positional else torch.ones_like(rows.used))
    if bool((done > 1).any()):
        t = int((done > 1).nonzero()[0, 0])
        fail("metadata", f"query row {t} is computed by more than one core; the plan does not fit this call")
    clipped = valid & (rows.local < S1 - torch.minimum(S1, S2))
    missing = valid & ~clipped & (done == 0).any(-1)
    if bool(missing.any()):
        t = int(missing.nonzero()[0, 0])
        fail("metadata", f"query row {t} is not covered by the plan; was it built from these lengths?")
    for t in clipped.nonzero().flatten().tolist():
        (o, _), _ = attend_rows(t, t + 1)
        out[t] = o[0]
