"""Triton score kernel of ``lightning_indexer`` (issue 13, item 4).

A program scores one query row against a block of ``BLOCK_N`` keys: ``q [H, D] · k [BLOCK_N, D]^T``
(heads are the M dimension, fp32 accumulation), ReLU, then the head sum weighted by ``w`` -- the
fast path's fp32 arithmetic.  Key addresses are computed in the kernel from the row's batch
(BSND / TND row bases, or the paged block table), so no ``[rows, keys, D]`` gather and no
``[rows, keys]`` address list exist.  Scores of a bounded number of rows at a time
(``SCORE_BUDGET`` bytes) are then selected by :func:`dsattn.indexer.problem.select_topk` (selection
by the k-th value, in the golden's order: ties to the lower key index), so peak memory is that budget plus the
outputs, whatever the context length.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.triton_lib import fp8e4m3fn_to_f32
from .problem import IndexerProblem, select_topk

SCORE_BUDGET = 64 << 20      # bytes of fp32 scores per launch (rows x keys)


@triton.jit
def program_keys(NV, BATCH, BT, stride_bt, BS, PAGED: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's query row ``r``, its ``BLOCK_N`` key positions ``x``, which of them the row selects
    and (paged) each key's cache block from the row's block-table row (else 0)."""
    r = tl.program_id(0).to(tl.int64)
    x = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = x < tl.load(NV + r)
    blk = tl.zeros_like(x).to(tl.int64)
    if PAGED:
        b = tl.load(BATCH + r).to(tl.int64)
        blk = tl.load(BT + b * stride_bt + x // BS, mask=valid, other=0).to(tl.int64)
    return r, x, valid, blk


@triton.jit
def indexer_score_kernel(Q, K, WT, BATCH, NV, BASE, BT, OUT,
                         stride_qr, stride_qh, stride_wr, stride_key, stride_blk, stride_bt, stride_or,
                         H, D, W, BS,
                         PAGED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         DOT_FP32: tl.constexpr):
    r, x, valid, blk = program_keys(NV, BATCH, BT, stride_bt, BS, PAGED, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    if PAGED:
        off = blk * stride_blk + (x % BS) * stride_key
    else:
        off = tl.load(BASE + r) + x.to(tl.int64) * stride_key
    k = tl.load(K + off[:, None] + d[None, :], mask=valid[:, None] & (d[None, :] < D), other=0.0)
    q = tl.load(Q + r * stride_qr + offs_h[:, None] * stride_qh + d[None, :],
                mask=(offs_h[:, None] < H) & (d[None, :] < D), other=0.0)
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    w = tl.load(WT + r * stride_wr + offs_h, mask=offs_h < H, other=0.0)
    score = tl.sum(w[:, None] * tl.maximum(s, 0.0), 0)
    tl.store(OUT + r * stride_or + x, tl.where(valid, score, float("-inf")), mask=x < W)


def launch_config(H: int, D: int, dtype: torch.dtype, backend: str = "cuda") -> dict:
    """All heads in one program (the indexer has at most 64), 64 keys per program; 8 warps (NVIDIA:
    with 4 the paged variant's address arithmetic spills on sm_90), 4 waves of 64 on AMD.  fp32
    queries (``ieee`` dots on FMA units): 16 keys per program, ptxas allowed 255 registers (64 keys
    spill 1.2 KB on sm_90)."""
    fp32 = dtype == torch.float32
    cfg = dict(BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_D=max(16, triton.next_power_of_2(D)),
               BLOCK_N=16 if fp32 else 64, num_warps=8 if backend == "cuda" else 4, num_stages=2)
    if fp32 and backend == "cuda":
        cfg["maxnreg"] = 255
    return cfg


def supports(P: IndexerProblem) -> bool:
    return P.q.size(-2) <= 128 and P.q.size(-1) <= 512 and P.k.tensor.stride(-1) == 1


def _row_bases(P: IndexerProblem, b: torch.Tensor) -> torch.Tensor:
    """Element offset of key 0 of each row's request (BSND / TND; paged rows use the table)."""
    t = P.k.tensor
    if P.k.layout == "TND":
        return P.k.cu[b] * t.stride(0)
    return b * t.stride(0)


def _select_rows(P, topk: int, offset: torch.Tensor | None, launch):
    """Scores of a bounded number of rows at a time (``SCORE_BUDGET`` bytes), written by
    ``launch(t0, t1, b, n, score)`` (one kernel launch over those rows' keys), then selected in the
    golden's order -> ``(indices [R, topk] int32, values [R, topk] float32)`` over flattened rows."""
    dev = P.q.device
    R, W = P.rows.R, P.k.capacity
    paged = P.k.layout not in ("BSND", "TND")
    idx_out = torch.empty(R, topk, dtype=torch.int32, device=dev)
    val_out = torch.empty(R, topk, dtype=torch.float32, device=dev)
    step = max(1, min(R, SCORE_BUDGET // (4 * max(W, 1)))) if R else 1
    for t0 in range(0, R, step):
        t1 = min(R, t0 + step)
        b = P.rows.batch[t0:t1]
        n = P.num_valid(t0, t1)
        if P.content and paged:          # a needed table entry of -1 raises, as on the PyTorch path
            x = torch.arange(W, device=dev)[None, :]
            P.k.locate(b[:, None], x, x < n[:, None], check=True)
        score = torch.empty(t1 - t0, max(W, 1), dtype=torch.float32, device=dev)
        if W:
            launch(t0, t1, b, n, score)
        else:
            score.fill_(float("-inf"))
        idx_out[t0:t1], val_out[t0:t1] = select_topk(score[:, :W] if W else score[:, :0], n, topk,
                                                     None if offset is None else offset[t0:t1])
    return idx_out, val_out


def lightning_indexer(P: IndexerProblem, topk: int, offset: torch.Tensor | None):
    """Returns ``(indices [R, topk] int32, values [R, topk] float32)`` over flattened rows."""
    q = P.q
    qf = P.rows.flat_unit_stride(q)
    H, D = qf.size(1), qf.size(2)
    interpreted = q.device.type == "cpu"
    cfg = launch_config(H, D, q.dtype, "hip" if torch.version.hip else "cuda")
    t = P.k.tensor
    paged = P.k.layout not in ("BSND", "TND")
    key_stride = t.stride(0) if P.k.layout == "TND" else t.stride(1)
    bt = P.k.block_table if paged else P.rows.batch
    w = P.w if P.w.stride(-1) == 1 else P.w.contiguous()

    def launch(t0, t1, b, n, score):
        grid = (t1 - t0, triton.cdiv(P.k.capacity, cfg["BLOCK_N"]))
        indexer_score_kernel[grid](qf[t0:t1], t, w[t0:t1], b.to(torch.int32).contiguous(),
                                   n.to(torch.int32).contiguous(), _row_bases(P, b).contiguous(), bt, score,
                                   qf.stride(0), qf.stride(1), w.stride(0), key_stride, t.stride(0),
                                   bt.stride(0) if paged else 0, score.stride(0), H, D, P.k.capacity,
                                   t.size(1) if paged else 1, PAGED=paged,
                                   DOT_FP32=interpreted or q.dtype == torch.float32, **cfg)
    return _select_rows(P, topk, offset, launch)


# ---- quant_lightning_indexer: keys decoded from their codes in the kernel (no dequantised copy)


@triton.jit
def quant_indexer_score_kernel(Q, QS, KB, KS, WT, BATCH, NV, BASE, BT, OUT,
                               stride_qr, stride_qh, stride_qsr, stride_wr, stride_vblk, stride_vrow, stride_sblk,
                               stride_srow, stride_bt, stride_or, H, D, W, BS,
                               PAGED: tl.constexpr, HAS_QS: tl.constexpr, FP8: tl.constexpr, BLOCK_H: tl.constexpr,
                               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
    """One query row against ``BLOCK_N`` quantised keys: key ``x`` of the row's request is flat pool row
    ``BASE[r] + x`` (BSND / TND) or its block-table entry's (paged), i.e. block ``row // BS``, slot
    ``row % BS``; its codes (int8, or fp8 e4m3fn: ``FP8`` 1 decoded from the bits, 2 by the hardware)
    at byte ``block * stride_vblk + slot * stride_vrow`` of ``KB``, its fp32 scale at element
    ``block * stride_sblk + slot * stride_srow`` of ``KS``.  The codes' exact values are multiplied in
    the query's dtype (exact: int8 and e4m3 fit bf16 / fp16), and the scales multiply each code product
    before the relu: ``relu(qs[h] ks[x] q[h] . codes[x])``."""
    r, x, valid, blk = program_keys(NV, BATCH, BT, stride_bt, BS, PAGED, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    if PAGED:
        slot = (x % BS).to(tl.int64)
    else:
        row = tl.load(BASE + r) + x.to(tl.int64)
        blk = row // BS
        slot = row % BS
    codes = tl.load(KB + (blk * stride_vblk + slot * stride_vrow)[:, None] + d[None, :],
                    mask=valid[:, None] & (d[None, :] < D), other=0)
    if FP8 == 2:
        k = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif FP8 == 1:
        k = fp8e4m3fn_to_f32(codes)
    else:
        k = codes.to(tl.int8, bitcast=True).to(tl.float32)
    ks = tl.load(KS + blk * stride_sblk + slot * stride_srow, mask=valid, other=0.0)
    hmask = offs_h < H
    q = tl.load(Q + r * stride_qr + offs_h[:, None] * stride_qh + d[None, :], mask=hmask[:, None] & (d[None, :] < D),
                other=0.0)
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    if HAS_QS:
        qs = tl.load(QS + r * stride_qsr + offs_h, mask=hmask, other=0.0)
    else:
        qs = tl.where(hmask, 1.0, 0.0)
    w = tl.load(WT + r * stride_wr + offs_h, mask=hmask, other=0.0)
    score = tl.sum(w[:, None] * tl.maximum((qs[:, None] * ks[None, :]) * s, 0.0), 0)
    tl.store(OUT + r * stride_or + x, tl.where(valid, score, float("-inf")), mask=x < W)


def fp8_mode(device: torch.device, interpreted: bool) -> int:
    """How the kernel decodes fp8 codes: by the hardware (NVIDIA sm_89+), else from their bits."""
    if not interpreted and device.type == "cuda" and not torch.version.hip:
        return 2 if torch.cuda.get_device_capability(device) >= (8, 9) else 1
    return 1


def quant_supports(P) -> bool:
    return P.q.size(-2) <= 128 and P.q.size(-1) <= 512


def quant_lightning_indexer(P, topk: int, offset: torch.Tensor | None):
    """``quant_lightning_indexer`` over flattened rows -> ``(indices [R, topk] int32, values [R, topk] float32)``."""
    q, dev = P.q, P.q.device
    qf = P.rows.flat_unit_stride(q)
    H, D = qf.size(1), qf.size(2)
    interpreted = dev.type == "cpu"
    cfg = launch_config(H, D, q.dtype, "hip" if torch.version.hip else "cuda")
    pool = P.pool
    scales = pool.scales if pool.scales.dtype == torch.float32 else pool.scales.float()
    paged = P.k.layout not in ("BSND", "TND")
    bt = P.k.block_table if paged else P.rows.batch
    qs = P.q_scale if P.q_scale is not None else P.w                   # (not read without query scales)
    w = P.w if P.w.stride(-1) == 1 else P.w.contiguous()
    fp8 = fp8_mode(dev, interpreted) if pool.dtype == torch.float8_e4m3fn else 0

    def launch(t0, t1, b, n, score):
        base = P.k.cu[b] if P.k.layout == "TND" else b * pool.bs           # flat row of each row's key 0
        grid = (t1 - t0, triton.cdiv(P.k.capacity, cfg["BLOCK_N"]))
        quant_indexer_score_kernel[grid](
            qf[t0:t1], qs[t0:t1], pool.values, scales, w[t0:t1], b.to(torch.int32).contiguous(),
            n.to(torch.int32).contiguous(), base.to(torch.int64).contiguous(), bt, score,
            qf.stride(0), qf.stride(1), qs.stride(0), w.stride(0), pool.values.stride(0), pool.values.stride(1),
            scales.stride(0), scales.stride(1), bt.stride(0) if paged else 0, score.stride(0), H, D, P.k.capacity,
            max(pool.bs, 1), PAGED=paged, HAS_QS=P.q_scale is not None, FP8=fp8,
            DOT_FP32=interpreted or q.dtype == torch.float32, **cfg)
    return _select_rows(P, topk, offset, launch)
