"""Triton forward of ``sparse_flash_mla`` (issue 13, item 1): one kernel for decode and prefill.

A program owns one query row and a block of heads (all heads share the single KV head, so heads
are the M dimension of both GEMMs).  The row's keys -- the window band of the ori branch, then
the compressed branch (top-k walk or causal prefix) -- arrive as one list of element offsets
into the two KV tensors (``-1``: no key), computed by the vectorised key selection of
:meth:`MlaProblem.keys` without any device read; the kernel gathers them block by block, so no
``[rows, keys, D]`` buffer exists.  Online softmax in fp32 with the sink inside it (``+inf``
sink: out 0, LSE ``+inf``), P rounded to the query dtype before P·V, LSE including the sink,
rows without a key 0 / 0 (spec 00 §8-9).  The head dim is split into a power-of-two main part
and a tail (576 = 512 + 64), so V3.2's 576 and V4's 512 both tile without padding to 1024.

Under Triton's interpreter (``TRITON_INTERPRET=1`` before triton is imported; CPU tensors) dots run in fp32 on P already rounded to the query
dtype: the interpreter's bf16 ``tl.dot`` is unreliable, and the rounding points are the same.
On a GPU fp32 dots use ``input_precision="ieee"`` (no TF32).
"""
from __future__ import annotations

import triton
import triton.language as tl

import torch

from ..common.checks import stat_dtype
from .problem import MlaProblem, lse_from_rows

BLOCK_N = 32                     # keys per step
ADDRESS_BUDGET = 16 << 20        # bytes of key offsets per launch


@triton.jit
def _round_bf16(x):
    """fp32 -> nearest-even bfloat16 value, kept in fp32 (the interpreter's own cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


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
    db = DA + tl.arange(0, DB)
    q_row = Q + r * stride_qr + offs_h[:, None] * stride_qh
    q_a = tl.load(q_row + da[None, :], mask=hmask[:, None] & (da[None, :] < D), other=0.0)
    q_b = tl.load(q_row + db[None, :], mask=hmask[:, None] & (db[None, :] < D), other=0.0)
    if DOT_FP32:
        q_a = q_a.to(tl.float32)
        q_b = q_b.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if HAS_SINK:                     # the sink is one more logit with a zero value vector
        sink = tl.load(SINK + offs_h, mask=hmask, other=float("-inf")).to(tl.float32)
        finite = (sink == sink) & (tl.abs(sink) < float("inf"))
        m_i = tl.where(finite, sink, float("-inf"))
        l_i = tl.where(finite, 1.0, 0.0)
    acc_a = tl.zeros([BLOCK_H, DA], tl.float32)
    acc_b = tl.zeros([BLOCK_H, DB], tl.float32)
    count = tl.zeros([BLOCK_H], tl.int32)
    for n0 in range(0, W, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        off = tl.load(A + r * stride_ar + cols, mask=cols < W, other=-1)
        valid = off >= 0
        off = tl.where(valid, off, 0)
        from_ori = valid & (cols < WO)
        from_cmp = valid & (cols >= WO)
        ka_ptr = off[:, None] + da[None, :]
        kb_ptr = off[:, None] + db[None, :]
        in_a, in_b = da[None, :] < D, db[None, :] < D
        # one branch per column: the other load is fully masked and touches no memory
        ka = tl.load(KO + ka_ptr, mask=from_ori[:, None] & in_a, other=0.0) + \
            tl.load(KC + ka_ptr, mask=from_cmp[:, None] & in_a, other=0.0)
        kb = tl.load(KO + kb_ptr, mask=from_ori[:, None] & in_b, other=0.0) + \
            tl.load(KC + kb_ptr, mask=from_cmp[:, None] & in_b, other=0.0)
        if DOT_FP32:
            ka = ka.to(tl.float32)
            kb = kb.to(tl.float32)
            s = tl.dot(q_a, tl.trans(ka), input_precision="ieee") + tl.dot(q_b, tl.trans(kb), input_precision="ieee")
        else:
            s = tl.dot(q_a, tl.trans(ka)) + tl.dot(q_b, tl.trans(kb))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if BF16_BY_BITS:                                             # P rounded to the query dtype
            p_q = _round_bf16(p)
        else:
            p_q = p.to(Q.dtype.element_ty)
        if DOT_FP32:
            p_q = p_q.to(tl.float32)
            acc_a = acc_a * alpha[:, None] + tl.dot(p_q, ka, input_precision="ieee")
            acc_b = acc_b * alpha[:, None] + tl.dot(p_q, kb, input_precision="ieee")
        else:
            acc_a = acc_a * alpha[:, None] + tl.dot(p_q, ka)
            acc_b = acc_b * alpha[:, None] + tl.dot(p_q, kb)
        m_i = m_new
        count += tl.sum(valid.to(tl.int32), 0)
    if HAS_SINK:                     # a +inf sink: l = inf, so out 0 and LSE +inf
        l_i = l_i + tl.where(sink == float("inf"), float("inf"), 0.0)
    has = count > 0
    l_safe = tl.where(has, l_i, 1.0)
    inv = tl.where(has, 1.0 / l_safe, 0.0)
    out_row = OUT + r * stride_or + offs_h[:, None] * stride_oh
    tl.store(out_row + da[None, :], (acc_a * inv[:, None]).to(OUT.dtype.element_ty),
             mask=hmask[:, None] & (da[None, :] < D))
    tl.store(out_row + db[None, :], (acc_b * inv[:, None]).to(OUT.dtype.element_ty),
             mask=hmask[:, None] & (db[None, :] < D))
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    tl.store(LSE + r * H + offs_h, tl.where(has, m_fin + tl.log(l_safe), 0.0), mask=hmask)


def head_split(D: int) -> tuple[int, int]:
    """``(DA, DB)``: a power-of-two main part and a tail of at least 16 (the dot's minimum)."""
    DA = 16
    while DA * 2 <= D:
        DA *= 2
    return DA, max(16, triton.next_power_of_2(max(D - DA, 1)))


def launch_config(H: int, D: int, dtype: torch.dtype) -> dict:
    """Constexprs the dispatcher selects for a call (also what the AOT compile matrix enumerates)."""
    DA, DB = head_split(D)
    block_h = 16 if H <= 16 else (32 if D <= 128 else 16)
    return dict(BLOCK_H=block_h, BLOCK_N=BLOCK_N, DA=DA, DB=DB)


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
    cfg = launch_config(H, D, q.dtype)
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
