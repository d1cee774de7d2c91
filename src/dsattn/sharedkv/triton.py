"""Plan-driven decode on a GPU (issue 13, item 3): the ``sparse_attn_sharedkv_metadata`` table is the
tile scheduler of a persistent Triton kernel, as FlashMLA's metadata is for its kernels.

The 1024-int32 table stays on the device.  Program ``(core, lane)`` of
:func:`plan_walk_kernel` reads its core's FA entry (50 §3) and walks the core's half-open range
``[start, end)`` of (bn2, m-block, s2-block) units (50 §4); the ``lanes`` programs of a core share
its work by (query row, block of 16 heads) of each m-block, so every SM is busy although the table
holds at most 36 cores (plan with ``aic_core_num`` up to 36 and the kernel launches 36 x lanes
programs).  For each row segment of the walk a program attends its query rows over the keys of the
segment's s2-blocks only -- window block ``j`` is raw keys ``[first + 512 j, first + 512 (j+1))``,
compressed block ``win_end + c`` is slots ``[512 c, 512 (c+1))`` of the row's list -- taken from the
row's key-offset list (:meth:`MlaProblem.keys`, the same selection every path uses).  A row the core
holds whole is finished there (the sink inside its softmax, P rounded against the row maximum: the
golden's rounding points); a split row writes its piece's unnormalised state (maximum, sum,
accumulator, no sink) to the FD workspace slot ``firstFdDataWorkspaceIdx + k``, and
:func:`fd_merge_kernel`, one program per FD entry and block of 16 row pairs, merges the
``workspaceNum`` pieces by LSE, adding the sink once (60 §7).

Row geometry (each m-block's clipped window start ``first``, its window and compressed block
counts) is the planner's own arithmetic (50 §2.2), evaluated by vectorised torch on the device over
a static bound of m-blocks, so nothing is read back to the host: the step can be captured in a CUDA
graph.  (The plan's fit to the call is checked on the host only when content checks are on, as
everywhere else.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.triton_lib import sink_logits
from ..planner.params import FA_CORES, FD_CORES, S2_BASE
from ..sparse_mla.problem import MlaProblem
from ..sparse_mla.triton import (RowAttention, fp8_mode, head_parts, range_max, range_pv,
                                supports as kernel_supports)

INT64_MAX = 2 ** 63 - 1
FD_BASE = 8 * FA_CORES
MAX_SLOTS = 2 * FA_CORES          # a core leaves at most two partial rows (50 §4)
S2_BASE_C: tl.constexpr = tl.constexpr(S2_BASE)
FD_BASE_C: tl.constexpr = tl.constexpr(FD_BASE)


@triton.jit
def _table_entry(ENTRY):
    """Fields 1..7 of an 8-int32 table entry (50 §3); field 0 is its enable flag."""
    return (tl.load(ENTRY + 1), tl.load(ENTRY + 2), tl.load(ENTRY + 3), tl.load(ENTRY + 4), tl.load(ENTRY + 5),
            tl.load(ENTRY + 6), tl.load(ENTRY + 7))


@triton.jit
def _store_heads(X_row, acc_a, acc_b, scale_rows, hmask, da, db, D, DB: tl.constexpr):
    tl.store(X_row + da[None, :], (acc_a * scale_rows[:, None]).to(X_row.dtype.element_ty),
             mask=hmask[:, None] & (da[None, :] < D))
    if DB > 0:
        tl.store(X_row + db[None, :], (acc_b * scale_rows[:, None]).to(X_row.dtype.element_ty),
                 mask=hmask[:, None] & (db[None, :] < D))


@triton.jit
def plan_walk_kernel(TABLE, Q, K, A, ROW_LO, N_M, REC_FIRST, REC_WIN_END, REC_S2_END, Q_START, SINK, OUT,
                     WS_M, WS_L, WS_ACC, stride_qr, stride_qh, stride_or, stride_oh, stride_ar,
                     G, MB, M_MAX, D, WO, WC, N, ROPE, scale,
                     TILE: tl.constexpr, PACKED: tl.constexpr, FP8: tl.constexpr, ROPE_BF16: tl.constexpr,
                     LANES: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                     DA: tl.constexpr, DB: tl.constexpr, DOT_FP32: tl.constexpr, BF16_BY_BITS: tl.constexpr,
                     Q_RELOAD: tl.constexpr):
    core = tl.program_id(0)
    lane = tl.program_id(1)
    entry = TABLE + 8 * core
    enabled = tl.load(entry) == 1
    bn2, m, s2, end_b, end_m, end_s, slot = _table_entry(entry)
    if not enabled:                  # a disabled core has an empty range
        end_b, end_m, end_s = bn2, m, s2
    Q_TY = Q.dtype.element_ty
    da = tl.arange(0, DA)
    db = da
    if DB > 0:
        db = DA + tl.arange(0, DB)
    hb_per_row = tl.cdiv(G, BLOCK_H)
    while (bn2 < end_b) | ((bn2 == end_b) & ((m < end_m) | ((m == end_m) & (s2 < end_s)))):
        n_m = tl.load(N_M + bn2)
        if m >= n_m:                 # past the last m-block of bn2 (or an empty batch)
            bn2 += 1
            m = 0
            s2 = 0
        else:
            rec = bn2 * M_MAX + m
            first = tl.load(REC_FIRST + rec)
            win_end = tl.load(REC_WIN_END + rec)
            s2_end = tl.load(REC_S2_END + rec)
            stop = s2_end
            if (bn2 == end_b) & (m == end_m):
                stop = end_s
            lo_blk = s2                          # (every row's s2 axis starts at 0: 50 §2.2)
            if stop > lo_blk:
                partial = (lo_blk > 0) | (stop < s2_end)
                # the m-block's (query row, head) pairs, in items of one query row x BLOCK_H heads
                rho_lo = m * MB
                rho_hi = tl.minimum(rho_lo + MB, tl.load(Q_START + 2 * bn2 + 1) * G)
                u_lo = rho_lo // G
                n_items = ((rho_hi - 1) // G - u_lo + 1) * hb_per_row
                q0 = tl.load(Q_START + 2 * bn2)
                for item in range(lane, n_items, LANES):
                    u = u_lo + item // hb_per_row
                    offs_h = (item % hb_per_row) * BLOCK_H + tl.arange(0, BLOCK_H)
                    rho = u * G + offs_h
                    hmask = (offs_h < G) & (rho >= rho_lo) & (rho < rho_hi)
                    t = (q0 + u).to(tl.int64)
                    q_row = Q + t * stride_qr + offs_h[:, None] * stride_qh
                    q_a, q_b = head_parts(q_row, hmask, da, db, D, DB, DOT_FP32)
                    A_row = A + t * stride_ar
                    # the segment's key columns: window blocks, then compressed blocks
                    row_lo = tl.load(ROW_LO + t)
                    o_lo = tl.minimum(tl.maximum(first + lo_blk * S2_BASE_C - row_lo, 0), WO)
                    o_hi = tl.minimum(tl.maximum(first + tl.minimum(stop, win_end) * S2_BASE_C - row_lo, 0), WO)
                    c_lo = WO + tl.minimum(tl.maximum((lo_blk - win_end) * S2_BASE_C, 0), WC)
                    c_hi = WO + tl.minimum(tl.maximum((stop - win_end) * S2_BASE_C, 0), WC)
                    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
                    count = tl.zeros([BLOCK_H], tl.int32)
                    m_i, count = range_max(q_a, q_b, q_row, hmask, K, A_row, o_lo, o_hi, m_i, count, D, N, ROPE,
                                           scale, TILE, PACKED, FP8, ROPE_BF16, BLOCK_N, DA, DB, Q_TY, BF16_BY_BITS,
                                           DOT_FP32, Q_RELOAD)
                    m_i, count = range_max(q_a, q_b, q_row, hmask, K, A_row, c_lo, c_hi, m_i, count, D, N, ROPE,
                                           scale, TILE, PACKED, FP8, ROPE_BF16, BLOCK_N, DA, DB, Q_TY, BF16_BY_BITS,
                                           DOT_FP32, Q_RELOAD)
                    sink = tl.full([BLOCK_H], float("-inf"), tl.float32)
                    finite = sink == 0.0
                    if HAS_SINK:
                        sink, finite = sink_logits(SINK, offs_h, hmask)
                        if not partial:      # a whole row: the sink is one more logit
                            m_i = tl.maximum(m_i, tl.where(finite, sink, float("-inf")))
                    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
                    l_i = tl.zeros([BLOCK_H], tl.float32)
                    acc_a = tl.zeros([BLOCK_H, DA], tl.float32)
                    acc_b = tl.zeros([BLOCK_H, DB if DB > 0 else 16], tl.float32)
                    l_i, acc_a, acc_b = range_pv(q_a, q_b, q_row, hmask, K, A_row, o_lo, o_hi, m_safe, l_i, acc_a,
                                                 acc_b, D, N, ROPE, scale, TILE, PACKED, FP8, ROPE_BF16, True,
                                                 BLOCK_N, DA, DB, Q_TY, BF16_BY_BITS, DOT_FP32, Q_RELOAD)
                    l_i, acc_a, acc_b = range_pv(q_a, q_b, q_row, hmask, K, A_row, c_lo, c_hi, m_safe, l_i, acc_a,
                                                 acc_b, D, N, ROPE, scale, TILE, PACKED, FP8, ROPE_BF16, True,
                                                 BLOCK_N, DA, DB, Q_TY, BF16_BY_BITS, DOT_FP32, Q_RELOAD)
                    if partial:              # the piece's state, without the sink, for the FD merge
                        ws = slot.to(tl.int64) * MB + (rho - rho_lo)
                        tl.store(WS_M + ws, m_i, mask=hmask)
                        tl.store(WS_L + ws, l_i, mask=hmask)
                        _store_heads(WS_ACC + ws[:, None] * D, acc_a, acc_b, tl.full([BLOCK_H], 1.0, tl.float32),
                                     hmask, da, db, D, DB)
                    else:
                        if HAS_SINK:
                            l_i += tl.where(finite, tl.exp(sink - m_safe), 0.0)
                            l_i += tl.where(sink == float("inf"), float("inf"), 0.0)
                        has = count > 0
                        inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
                        _store_heads(OUT + t * stride_or + offs_h[:, None] * stride_oh, acc_a, acc_b, inv, hmask,
                                     da, db, D, DB)
                slot += partial.to(slot.dtype)
            m += 1
            s2 = 0



@triton.jit
def fd_merge_kernel(TABLE, Q_START, SINK, OUT, WS_M, WS_L, WS_ACC, stride_or, stride_oh, G, MB, D,
                    HAS_SINK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, MAX_SPLIT: tl.constexpr):
    """FD entry ``program_id(0)``: rows ``[mStart, mStart + mNum)`` of its m-block, ``BLOCK`` row pairs
    per program (``program_id(1)``): merge the ``workspaceNum`` partial states by LSE and add the
    sink once."""
    entry = TABLE + FD_BASE_C + 8 * tl.program_id(0)
    if tl.load(entry) == 1:
        bn2, m, ws0, n_split, m_start, m_num, _ = _table_entry(entry)
        pairs = m_start + tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        pmask = pairs < m_start + m_num
        rho = m * MB + pairs
        t = (tl.load(Q_START + 2 * bn2) + rho // G).to(tl.int64)
        h = rho % G
        sp = tl.arange(0, MAX_SPLIT)
        smask = pmask[:, None] & (sp[None, :] < n_split)
        ws = (ws0 + sp[None, :]).to(tl.int64) * MB + pairs[:, None]
        m_s = tl.load(WS_M + ws, mask=smask, other=float("-inf"))
        l_s = tl.load(WS_L + ws, mask=smask, other=0.0)
        m_i = tl.max(m_s, 1)
        has = m_i > float("-inf")
        if HAS_SINK:
            sink, finite = sink_logits(SINK, h, pmask)
            m_i = tl.maximum(m_i, tl.where(finite, sink, float("-inf")))
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        w = tl.where(smask & (m_s > float("-inf")), tl.exp(m_s - m_safe[:, None]), 0.0)
        l_i = tl.sum(w * l_s, 1)
        if HAS_SINK:
            l_i += tl.where(finite, tl.exp(sink - m_safe), 0.0)
            l_i += tl.where(sink == float("inf"), float("inf"), 0.0)
        inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
        d = tl.arange(0, BLOCK_D)
        for c0 in range(0, D, BLOCK_D):
            cols = c0 + d
            acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)
            for k in range(0, n_split):
                wk = tl.sum(tl.where(sp[None, :] == k, w, 0.0), 1)
                row = (ws0 + k).to(tl.int64) * MB + pairs
                acc += wk[:, None] * tl.load(WS_ACC + row[:, None] * D + cols[None, :],
                                             mask=pmask[:, None] & (cols[None, :] < D), other=0.0)
            tl.store(OUT + t[:, None] * stride_or + h[:, None] * stride_oh + cols[None, :],
                     (acc * inv[:, None]).to(OUT.dtype.element_ty), mask=pmask[:, None] & (cols[None, :] < D))



def walk_options(cfg: dict, packed: bool) -> dict:
    """Launch options of the walk (warps, stages, NVIDIA's ``maxnreg``): the forward's, except
    * one stage for packed rows (the walk's extra state and the dequantisation spill on NVIDIA at
      3 stages: 80 bytes sm_90, 552 sm_80);
    * fp32 at 8 warps with 255 registers, where the forward takes 16 warps capped at 128: the
      walk's whole-row pieces fit (157-162 registers on sm_90) and at 16 warps its fp8 decoding
      spills 16 bytes."""
    opts = {k: cfg[k] for k in ("num_warps", "num_stages", "maxnreg") if k in cfg}
    if packed:
        opts["num_stages"] = 1
    if opts.get("maxnreg") == 128:
        opts.update(num_warps=8, maxnreg=255)
    return opts


def supports(P: MlaProblem) -> bool:
    """Positional calls (a band or causal mask: every valid row is inside the plan) that the forward
    kernel covers (plain rows, or packed rows dequantised in the kernel).  Not fp8 rows on NVIDIA
    GPUs without the hardware conversion (before sm_89): decoding e4m3fn from its bits beside the
    walk's state spills 192 bytes on sm_80, so those calls take the split-K kernel instead."""
    dev = P.q.device
    bit_decoded_fp8 = (P.ori.decode is not None and dev.type == "cuda" and not torch.version.hip
                       and fp8_mode(P.ori.tensor.dtype, dev) == 1)
    return kernel_supports(P) and P.positional and not bit_decoded_fp8


def row_geometry(P: MlaProblem):
    """``(mb, M_max, n_m, first, win_end, s2_end, q_start)``: the m-block size and a static bound of
    m-blocks per batch (from shapes), then per (batch, m-block) the clipped window start, window block
    count and s2-block end (50 §2.2), and per batch the m-block count and first flattened query row --
    device tensors, no host read."""
    rows, dev = P.rows, P.q.device
    G = P.q.size(-2)
    K = 0 if P.cmp_idx is None else P.cmp_idx.size(1)
    scfa = P.cmp is not None and K > 0
    mb = G if scfa else 256
    M_max = max(1, triton.cdiv((P.q.size(1) if rows.layout == "BSND" else P.q.size(0)) * G, mb))
    S1, S2 = rows.extent.to(torch.int64), P.ori.lengths.to(torch.int64)
    S1v = torch.minimum(S1, S2)
    n_m = torch.div(S1v * G + mb - 1, mb, rounding_mode="floor")
    idx = torch.arange(M_max, device=dev, dtype=torch.int64)[None, :]
    pre = (P.wl if P.wl > -1 else INT64_MAX) if P.om == 4 else INT64_MAX
    pre_lu = (S1v - S2 + pre) if P.om == 4 else torch.full_like(S1v, pre)
    next_lu = S2 - S1v
    f = idx * mb
    last_rho = torch.minimum(f + mb, (S1v * G)[:, None]) - 1
    first = torch.div(f, G, rounding_mode="floor") - pre_lu[:, None]
    last = torch.div(last_rho, G, rounding_mode="floor") + next_lu[:, None]
    s2 = S2[:, None]
    empty = (S1[:, None] == 0) | (s2 == 0) | (first >= s2) | (last < 0) | (last < first)
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    first = torch.where(empty, zero, torch.clamp(first, min=0))
    last = torch.where(empty, zero, torch.minimum(last, s2 - 1))
    win_end = torch.where(empty, zero, torch.div(last - first, S2_BASE, rounding_mode="floor") + 1)
    if P.cmp is not None:
        act = torch.div(last + 1, P.r, rounding_mode="floor")
        if scfa:
            act = torch.clamp(act, max=K)
        s2_end = torch.where(act == 0, win_end, win_end + torch.div(act - 1, S2_BASE, rounding_mode="floor") + 1)
    else:
        s2_end = win_end
    # flattened index of each batch's first plannable query row (the last S1v rows of the batch), and S1v
    first_row = (torch.arange(rows.B, device=dev, dtype=torch.int64) * P.q.size(1) if rows.layout == "BSND"
                 else torch.cumsum(S1, 0) - S1)
    start = first_row + (S1 - S1v)
    q_start = torch.stack([start, S1v], 1).contiguous()
    i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731  (the table's own width: positions < 2**31)
    return mb, M_max, i32(n_m), i32(first), i32(win_end), i32(s2_end), i32(q_start)


def execute(P: MlaProblem, metadata: torch.Tensor) -> torch.Tensor:
    """Run a plan: the persistent walk over the table, then the FD merge."""
    q = P.q
    qf = P.rows.flat_unit_stride(q)
    R, G, D = qf.shape
    dev = q.device
    att = RowAttention(qf, [src.tensor for src in (P.ori, P.cmp) if src is not None], D, P.sinks, P.scale,
                       packed=P.ori.packed if P.ori.decode is not None else None)
    cfg = att.cfg
    k = P.keys(0, R)
    parts = [att.offsets(P.ori, k.ori_addr, k.ori_mask)]
    Wo, Wc = k.ori_mask.size(1), 0
    if P.cmp is not None:
        parts.append(att.offsets(P.cmp, k.cmp_addr, k.cmp_mask))
        Wc = k.cmp_mask.size(1)
    addr = torch.cat(parts, 1).contiguous()
    row_lo = (k.ori_x[:, 0] if Wo else torch.zeros(R, dtype=torch.int64, device=dev)).to(torch.int32).contiguous()
    mb, M_max, n_m, first, win_end, s2_end, q_start = row_geometry(P)
    out = torch.zeros(R, G, D, dtype=torch.float32 if att.bf16_by_bits else q.dtype, device=dev)
    ws_m = torch.empty(MAX_SLOTS, mb, dtype=torch.float32, device=dev)
    ws_l = torch.empty(MAX_SLOTS, mb, dtype=torch.float32, device=dev)
    ws_acc = torch.empty(MAX_SLOTS, mb, D, dtype=torch.float32, device=dev)
    table = metadata.reshape(-1).to(torch.int32).contiguous()
    sinks = P.sinks if P.sinks is not None else ws_m
    hb = triton.cdiv(G, cfg["BLOCK_H"])
    lanes = min(16, hb * max(1, triton.cdiv(mb, G)))
    consts = {k_: att.consts[k_] for k_ in ("HAS_SINK", "DOT_FP32", "BF16_BY_BITS", "TILE", "PACKED", "FP8",
                                             "ROPE_BF16")}
    plan_walk_kernel[(FA_CORES, lanes)](
        table, qf, att.base, addr, row_lo, n_m, first, win_end, s2_end, q_start, sinks, out, ws_m, ws_l, ws_acc,
        qf.stride(0), qf.stride(1), out.stride(0), out.stride(1), addr.stride(0), G, mb, M_max, D, Wo, Wc,
        *att.runtime, float(P.scale), LANES=lanes, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], DA=cfg["DA"], DB=cfg["DB"],
        Q_RELOAD=cfg["Q_RELOAD"], **walk_options(cfg, consts["PACKED"]), **consts)
    fd_merge_kernel[(FD_CORES, triton.cdiv(mb, 16))](
        table, q_start, sinks, out, ws_m, ws_l, ws_acc, out.stride(0), out.stride(1), G, mb, D,
        HAS_SINK=consts["HAS_SINK"], BLOCK=16, BLOCK_D=min(128, triton.next_power_of_2(D)),
        MAX_SPLIT=triton.next_power_of_2(FA_CORES))
    return P.rows.unflat(out.to(q.dtype), q)

