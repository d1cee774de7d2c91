"""Triton forward of ``sparse_flash_mla`` (issue 13, item 1): one kernel for decode and prefill.

A program owns one query row and a block of heads (all heads share the single KV head, so heads
are the M dimension of both GEMMs).  The row's keys -- the window band of the ori branch, then
the compressed branch (top-k walk or causal prefix) -- arrive as one list of element offsets
into the two KV tensors (``-1``: no key), computed by the vectorised key selection of
:meth:`MlaProblem.keys` without any device read; the kernel gathers them block by block, so no
``[rows, keys, D]`` buffer exists.  Two passes over the keys: the row maximum (with the sink),
then P = exp(S - m) rounded to the query dtype before P·V -- the golden's rounding points
exactly, where a single online pass would round against running maxima (bf16 then misses the
cross-order rule on long rows); it reads the keys twice (the price, to revisit with GPU
measurements).  fp32 statistics, the sink inside the softmax (``+inf`` sink: out 0, LSE
``+inf``), LSE including the sink,
rows without a key 0 / 0 (spec 00 §8-9).  The head dim is split into a power-of-two main part
and a tail (576 = 512 + 64), so V3.2's 576 and V4's 512 both tile without padding to 1024.

Under Triton's interpreter (``TRITON_INTERPRET=1`` before triton is imported; CPU tensors) dots
run in fp32 on P already rounded to the query dtype (the interpreter's bf16 ``tl.dot`` is
unreliable; the rounding points are the same), and bf16 rounding is done by bit arithmetic (its
fp32 -> bf16 cast truncates).  On a GPU fp32 dots use ``input_precision="ieee"`` (no TF32).
"""
from __future__ import annotations

import triton
import triton.language as tl

import torch

from ..common.checks import stat_dtype
from .problem import MlaProblem, lse_from_rows

ADDRESS_BUDGET = 16 << 20        # bytes of key offsets per launch


@triton.jit
def _round_bf16(x):
    """fp32 -> nearest-even bfloat16 value, kept in fp32 (the interpreter's own cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_keys(KO, KC, off, from_ori, from_cmp, cols, D):
    """Key rows ``[BLOCK_N, len(cols)]``: each from the ori or the cmp tensor (the other load masked)."""
    ptr = off[:, None] + cols[None, :]
    inside = cols[None, :] < D
    return tl.load(KO + ptr, mask=from_ori[:, None] & inside, other=0.0) + \
        tl.load(KC + ptr, mask=from_cmp[:, None] & inside, other=0.0)


@triton.jit
def _block_scores(q_a, q_b, KO, KC, A_row, n0, W, WO, D, scale, da, db, BLOCK_N: tl.constexpr, DB: tl.constexpr,
                  DOT_FP32: tl.constexpr):
    """Keys ``n0 .. n0 + BLOCK_N`` of a row: scaled scores ``[BLOCK_H, BLOCK_N]`` (-inf where no key),
    the key tiles (main part, tail) and the valid mask."""
    cols = n0 + tl.arange(0, BLOCK_N)
    off = tl.load(A_row + cols, mask=cols < W, other=-1)
    valid = off >= 0
    off = tl.where(valid, off, 0)
    from_ori = valid & (cols < WO)
    from_cmp = valid & (cols >= WO)
    ka = _load_keys(KO, KC, off, from_ori, from_cmp, da, D)
    kb = ka
    if DOT_FP32:
        ka = ka.to(tl.float32)
        s = tl.dot(q_a, tl.trans(ka), input_precision="ieee")
    else:
        s = tl.dot(q_a, tl.trans(ka))
    if DB > 0:
        kb = _load_keys(KO, KC, off, from_ori, from_cmp, db, D)
        if DOT_FP32:
            kb = kb.to(tl.float32)
            s += tl.dot(q_b, tl.trans(kb), input_precision="ieee")
        else:
            s += tl.dot(q_b, tl.trans(kb))
    return tl.where(valid[None, :], s * scale, float("-inf")), ka, kb, valid


@triton.jit
def sparse_mla_fwd_kernel(Q, KO, KC, A, SINK, OUT, LSE,
                    stride_qr, stride_qh, stride_or, stride_oh, stride_ar,
                    H, D, W, WO, scale,
                    HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                    DA: tl.constexpr, DB: tl.constexpr, DOT_FP32: tl.constexpr, BF16_BY_BITS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    da = tl.arange(0, DA)
    q_row = Q + r * stride_qr + offs_h[:, None] * stride_qh
    q_a = tl.load(q_row + da[None, :], mask=hmask[:, None] & (da[None, :] < D), other=0.0)
    if DOT_FP32:
        q_a = q_a.to(tl.float32)
    q_b = q_a                        # placeholders when the head dim has no tail (DB == 0)
    db = da
    if DB > 0:
        db = DA + tl.arange(0, DB)
        q_b = tl.load(q_row + db[None, :], mask=hmask[:, None] & (db[None, :] < D), other=0.0)
        if DOT_FP32:
            q_b = q_b.to(tl.float32)
        acc_b = tl.zeros([BLOCK_H, DB], tl.float32)
    # pass 1: the row maximum over every key and the finite sink, so that P is rounded against the
    # global maximum exactly as the golden does (00 §8), not against a running one
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    if HAS_SINK:                     # the sink is one more logit with a zero value vector
        sink = tl.load(SINK + offs_h, mask=hmask, other=float("-inf")).to(tl.float32)
        finite = (sink == sink) & (tl.abs(sink) < float("inf"))
        m_i = tl.where(finite, sink, float("-inf"))
    count = tl.zeros([BLOCK_H], tl.int32)
    for n0 in range(0, W, BLOCK_N):
        s, ka, kb, valid = _block_scores(q_a, q_b, KO, KC, A + r * stride_ar, n0, W, WO, D, scale, da, db,
                                         BLOCK_N, DB, DOT_FP32)
        m_i = tl.maximum(m_i, tl.max(s, 1))
        count += tl.sum(valid.to(tl.int32), 0)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if HAS_SINK:
        l_i = tl.where(finite, tl.exp(sink - m_safe), 0.0)
    # pass 2: P = exp(S - m), rounded to the query dtype before P·V; l from the unrounded P
    acc_a = tl.zeros([BLOCK_H, DA], tl.float32)
    for n0 in range(0, W, BLOCK_N):
        s, ka, kb, valid = _block_scores(q_a, q_b, KO, KC, A + r * stride_ar, n0, W, WO, D, scale, da, db,
                                         BLOCK_N, DB, DOT_FP32)
        p = tl.exp(s - m_safe[:, None])
        l_i += tl.sum(p, 1)
        if BF16_BY_BITS:
            p_q = _round_bf16(p)
        else:
            p_q = p.to(Q.dtype.element_ty)
        if DOT_FP32:
            p_q = p_q.to(tl.float32)
            acc_a += tl.dot(p_q, ka, input_precision="ieee")
            if DB > 0:
                acc_b += tl.dot(p_q, kb, input_precision="ieee")
        else:
            acc_a += tl.dot(p_q, ka)
            if DB > 0:
                acc_b += tl.dot(p_q, kb)
    if HAS_SINK:                     # a +inf sink: l = inf, so out 0 and LSE +inf
        l_i = l_i + tl.where(sink == float("inf"), float("inf"), 0.0)
    has = count > 0
    l_safe = tl.where(has, l_i, 1.0)
    inv = tl.where(has, 1.0 / l_safe, 0.0)
    out_row = OUT + r * stride_or + offs_h[:, None] * stride_oh
    tl.store(out_row + da[None, :], (acc_a * inv[:, None]).to(OUT.dtype.element_ty),
             mask=hmask[:, None] & (da[None, :] < D))
    if DB > 0:
        tl.store(out_row + db[None, :], (acc_b * inv[:, None]).to(OUT.dtype.element_ty),
                 mask=hmask[:, None] & (db[None, :] < D))
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    tl.store(LSE + r * H + offs_h, tl.where(has, m_fin + tl.log(l_safe), 0.0), mask=hmask)


def head_split(D: int) -> tuple[int, int]:
    """``(DA, DB)``: a power-of-two main part and a tail of at least 16 (the dot's minimum), 0 when
    the head dim fits the main part."""
    DA = 16
    while DA * 2 <= D:
        DA *= 2
    return DA, (0 if D <= DA else max(16, triton.next_power_of_2(D - DA)))


def launch_config(H: int, D: int, dtype: torch.dtype, backend: str = "cuda") -> dict:
    """Constexprs and warps the dispatcher selects for a call (also what the AOT compile matrix
    enumerates).  16 keys per step; NVIDIA: 8 warps (a [16 heads, 512] fp32 accumulator and the key
    tile fit in registers: 193 per thread at D 512 on sm_90, no spill); AMD: 4 waves of 64 (gfx942's
    512 registers per lane, no scratch)."""
    DA, DB = head_split(D)
    # fp32 key tiles are twice as large: no software pipelining (one stage) keeps them within shared
    # memory and registers (gfx942 64 KB; sm_90 152 registers at D 576, no spill)
    stages = 1 if dtype == torch.float32 else (3 if backend == "cuda" else 2)
    return dict(BLOCK_H=16, BLOCK_N=16, DA=DA, DB=DB, num_warps=8 if backend == "cuda" else 4, num_stages=stages)


def supports(P: MlaProblem) -> bool:
    """Inputs this kernel covers (else the PyTorch path runs)."""
    if P.q.dtype == torch.float64:
        return False
    for src in (P.ori, P.cmp):
        if src is not None and (src.decode is not None or src.tensor.stride(-1) != 1):
            return False
    return True


def _offsets(src, addr, mask) -> torch.Tensor:
    """Element offsets of key rows into ``src.tensor`` (``-1`` where masked)."""
    i0, i1 = addr
    t = src.tensor
    off = i1 * t.stride(0) if src.layout == "TND" else i0 * t.stride(0) + i1 * t.stride(1)
    return torch.where(mask, off, torch.full((), -1, dtype=off.dtype, device=off.device))


def forward(P: MlaProblem, return_softmax_lse: bool):
    q = P.q
    qf = P.rows.flat(q)
    if qf.stride(-1) != 1:
        qf = qf.contiguous()
    R, H, D = qf.shape
    interpreted = q.device.type == "cpu"          # only under TRITON_INTERPRET=1 (backend.use_triton)
    bf16_by_bits = interpreted and q.dtype == torch.bfloat16
    # the interpreter's fp32 -> bf16 cast truncates: it writes fp32 and torch rounds (nearest even)
    out = torch.empty(R, H, D, dtype=torch.float32 if bf16_by_bits else q.dtype, device=q.device)
    lse = torch.empty(R, H, dtype=torch.float32, device=q.device)
    cfg = launch_config(H, D, q.dtype, "hip" if torch.version.hip else "cuda")
    dot_fp32 = interpreted or q.dtype == torch.float32
    ko = P.ori.tensor
    kc = P.cmp.tensor if P.cmp is not None else ko
    sinks = P.sinks if P.sinks is not None else lse                   # a placeholder pointer when absent
    W = max(1, P.ori_width + P.cmp_width)
    step = max(1, min(R, ADDRESS_BUDGET // (8 * W))) if R else 1
    for t0 in range(0, R, step):
        t1 = min(R, t0 + step)
        k = P.keys(t0, t1)
        parts = [_offsets(P.ori, k.ori_addr, k.ori_mask)]
        if P.cmp is not None:
            parts.append(_offsets(P.cmp, k.cmp_addr, k.cmp_mask))
        addr = torch.cat(parts, 1).contiguous()
        o, lse_rows = out[t0:t1], lse[t0:t1]
        grid = (t1 - t0, triton.cdiv(H, cfg["BLOCK_H"]))
        sparse_mla_fwd_kernel[grid](qf[t0:t1], ko, kc, addr, sinks, o, lse_rows,
                     qf.stride(0), qf.stride(1), o.stride(0), o.stride(1), addr.stride(0),
                     H, D, addr.size(1), k.ori_mask.size(1), float(P.scale),
                     HAS_SINK=P.sinks is not None, DOT_FP32=dot_fp32, BF16_BY_BITS=bf16_by_bits, **cfg)
    attn_out = P.rows.unflat(out.to(q.dtype), q)
    if not return_softmax_lse:
        return attn_out, torch.zeros((), dtype=stat_dtype(q), device=q.device)
    return attn_out, lse_from_rows(lse, q, "BSND" if P.rows.layout == "BSND" else "TND")
