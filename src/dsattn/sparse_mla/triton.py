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
from ..common.triton_lib import finish_rows, load_packed_rows, round_to_q, sink_logits
from .problem import MlaProblem, lse_from_rows

ADDRESS_BUDGET = 16 << 20        # bytes of key offsets per launch


@triton.jit
def head_parts(row, hmask, da, db, D, DB: tl.constexpr, DOT_FP32: tl.constexpr):
    """A row's heads (``row``: ``[BLOCK_H, 1]`` pointers) as (main part ``da``, tail ``db``), in the
    dot's operand type; 0 where ``hmask`` is off.  Without a tail the second is the first."""
    a = tl.load(row + da[None, :], mask=hmask[:, None] & (da[None, :] < D), other=0.0)
    b = a
    if DB > 0:
        b = tl.load(row + db[None, :], mask=hmask[:, None] & (db[None, :] < D), other=0.0)
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


@triton.jit
def _load_keys(K, off, valid, C0: tl.constexpr, WIDTH: tl.constexpr, D, N, ROPE, TILE: tl.constexpr,
               PACKED: tl.constexpr, FP8: tl.constexpr, ROPE_BF16: tl.constexpr, Q_TY: tl.constexpr,
               BF16_BY_BITS: tl.constexpr, DOT_FP32: tl.constexpr):
    """Key rows ``[BLOCK_N, len(cols)]`` at element offsets ``off`` from ``K`` (ori and cmp rows
    alike: the host rebased the cmp offsets onto the ori tensor, so one pointer tensor serves both),
    in the dot's operand type; packed rows are dequantised in fp32 and rounded once to the query
    dtype, as the golden does."""
    if PACKED:
        k = round_to_q(load_packed_rows(K, off, valid, C0, WIDTH, D, N, ROPE, TILE, FP8, ROPE_BF16),
                       Q_TY, BF16_BY_BITS, DOT_FP32)
    else:
        cols = C0 + tl.arange(0, WIDTH)
        k = tl.load(K + off[:, None] + cols[None, :], mask=valid[:, None] & (cols[None, :] < D), other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
    return k


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _block_scores(q_a, q_b, q_row, hmask, K, A_row, n0, hi, D, N, ROPE, TILE: tl.constexpr, scale,
                  BLOCK_N: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, PACKED: tl.constexpr, FP8: tl.constexpr,
                  ROPE_BF16: tl.constexpr, Q_TY: tl.constexpr, BF16_BY_BITS: tl.constexpr, DOT_FP32: tl.constexpr,
                  Q_RELOAD: tl.constexpr):
    """Keys ``n0 .. n0 + BLOCK_N`` (below ``hi``) of a row: scaled scores ``[BLOCK_H, BLOCK_N]``
    (-inf where no key), the key tiles (main part, tail) and the valid mask.  ``Q_RELOAD``: the
    query's heads are read again here (from L1) instead of being held across the loop in ``q_a`` /
    ``q_b`` -- without wgmma (sm_80) the dot's A operand lives in registers, replicated in every
    warp, and at 576 it does not fit beside the accumulator."""
    if Q_RELOAD:
        db = tl.arange(0, DA)
        if DB > 0:
            db = DA + tl.arange(0, DB)
        # (the mask depends on the block, so the loads are not hoisted out of the loop)
        live = hmask & ((tl.zeros_like(hmask.to(tl.int32)) + n0) < hi)
        q_a, q_b = head_parts(q_row, live, tl.arange(0, DA), db, D, DB, DOT_FP32)
    cols = n0 + tl.arange(0, BLOCK_N)
    off = tl.load(A_row + cols, mask=cols < hi, other=-1)
    valid = off >= 0
    off = tl.where(valid, off, 0)
    ka = _load_keys(K, off, valid, 0, DA, D, N, ROPE, TILE, PACKED, FP8, ROPE_BF16, Q_TY,
                    BF16_BY_BITS, DOT_FP32)
    s = _dot(q_a, tl.trans(ka), DOT_FP32)
    kb = ka
    if DB > 0:
        kb = _load_keys(K, off, valid, DA, DB, D, N, ROPE, TILE, PACKED, FP8, ROPE_BF16, Q_TY,
                        BF16_BY_BITS, DOT_FP32)
        s += _dot(q_b, tl.trans(kb), DOT_FP32)
    return tl.where(valid[None, :], s * scale, float("-inf")), ka, kb, valid


@triton.jit
def range_max(q_a, q_b, q_row, hmask, K, A_row, lo, hi, m_i, count, D, N, ROPE, scale, TILE: tl.constexpr,
              PACKED: tl.constexpr, FP8: tl.constexpr, ROPE_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
              DA: tl.constexpr, DB: tl.constexpr, Q_TY: tl.constexpr, BF16_BY_BITS: tl.constexpr,
              DOT_FP32: tl.constexpr, Q_RELOAD: tl.constexpr):
    """Pass 1 over key columns ``[lo, hi)`` of a row's offset list: the running maximum of the scaled
    scores and the count of keys."""
    for n0 in range(lo, hi, BLOCK_N):
        s, ka, kb, valid = _block_scores(q_a, q_b, q_row, hmask, K, A_row, n0, hi, D, N, ROPE, TILE, scale, BLOCK_N,
                                         DA, DB, PACKED, FP8, ROPE_BF16, Q_TY, BF16_BY_BITS, DOT_FP32, Q_RELOAD)
        m_i = tl.maximum(m_i, tl.max(s, 1))
        count += tl.sum(valid.to(tl.int32), 0)
    return m_i, count


@triton.jit
def range_pv(q_a, q_b, q_row, hmask, K, A_row, lo, hi, m_safe, l_i, acc_a, acc_b, D, N, ROPE, scale,
             TILE: tl.constexpr, PACKED: tl.constexpr, FP8: tl.constexpr, ROPE_BF16: tl.constexpr,
             VALUE_TAIL: tl.constexpr, BLOCK_N: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, Q_TY: tl.constexpr,
             BF16_BY_BITS: tl.constexpr, DOT_FP32: tl.constexpr, Q_RELOAD: tl.constexpr):
    """Pass 2 over key columns ``[lo, hi)``: P = exp(S - m), rounded to the query dtype before P·V
    (the golden's point), the sum from the unrounded P."""
    for n0 in range(lo, hi, BLOCK_N):
        s, ka, kb, valid = _block_scores(q_a, q_b, q_row, hmask, K, A_row, n0, hi, D, N, ROPE, TILE, scale, BLOCK_N,
                                         DA, DB, PACKED, FP8, ROPE_BF16, Q_TY, BF16_BY_BITS, DOT_FP32, Q_RELOAD)
        p = tl.exp(s - m_safe[:, None])
        l_i += tl.sum(p, 1)
        p_q = round_to_q(p, Q_TY, BF16_BY_BITS, DOT_FP32)
        acc_a += _dot(p_q, ka, DOT_FP32)
        if DB > 0 and VALUE_TAIL:
            acc_b += _dot(p_q, kb, DOT_FP32)
    return l_i, acc_a, acc_b


@triton.jit
def sparse_mla_fwd_kernel(Q, K, A, SINK, OUT, LSE, SUM, MP, CP, LP, ACCP,
                          stride_qr, stride_qh, stride_or, stride_oh, stride_ar,
                          H, D, W, CHUNK, NSPLIT, N, ROPE, scale,
                          TILE: tl.constexpr, PHASE: tl.constexpr, SPLITS: tl.constexpr,
                          HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                          DA: tl.constexpr, DB: tl.constexpr, DOT_FP32: tl.constexpr, BF16_BY_BITS: tl.constexpr,
                          PACKED: tl.constexpr, FP8: tl.constexpr, ROPE_BF16: tl.constexpr,
                          VALUE_TAIL: tl.constexpr, STATS: tl.constexpr, Q_RELOAD: tl.constexpr):
    """PHASE 0: a whole row (keys ``[0, W)``), normalised into OUT / LSE.  Split-K (program axis 2 =
    split ``s``, keys ``[s·CHUNK, (s+1)·CHUNK)``): PHASE 1 writes the split's maximum MP and key
    count CP; PHASE 2 forms P against the row maximum over every split's MP and the sink, and
    writes the unnormalised partial sums LP and ACCP for :func:`sparse_mla_merge_kernel`.
    ``VALUE_TAIL`` False: the value is the key's main part only (QSFA: the 512 dequantised nope
    columns; the rope tail is key-only), so OUT is ``DA`` wide.  ``STATS``: see ``finish_rows``."""
    r = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    split = tl.program_id(2)
    lo = split * CHUNK
    hi = tl.minimum(W, lo + CHUNK)
    Q_TY = Q.dtype.element_ty
    da = tl.arange(0, DA)
    q_row = Q + r * stride_qr + offs_h[:, None] * stride_qh
    db = da
    if DB > 0:
        db = DA + tl.arange(0, DB)
    q_a, q_b = head_parts(q_row, hmask, da, db, D, DB, DOT_FP32)
    A_row = A + r * stride_ar
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    count = tl.zeros([BLOCK_H], tl.int32)
    if PHASE != 2:
        # pass 1: the maximum over the keys (and, for a whole row, the finite sink), so that P is
        # rounded against the row's global maximum exactly as the golden does (00 §8)
        m_i, count = range_max(q_a, q_b, q_row, hmask, K, A_row, lo, hi, m_i, count, D, N, ROPE, scale, TILE,
                               PACKED, FP8, ROPE_BF16, BLOCK_N, DA, DB, Q_TY, BF16_BY_BITS, DOT_FP32, Q_RELOAD)
        if PHASE == 1:
            part = (r * NSPLIT + split) * H + offs_h
            tl.store(MP + part, m_i, mask=hmask)
            tl.store(CP + part, count, mask=hmask)
            return
    else:                            # the row maximum: every split's maximum
        sp = tl.arange(0, SPLITS)
        parts = (r * NSPLIT + sp[None, :]) * H + offs_h[:, None]
        m_i = tl.max(tl.load(MP + parts, mask=hmask[:, None] & (sp[None, :] < NSPLIT), other=float("-inf")), 1)
    if HAS_SINK:                     # the sink is one more logit with a zero value vector
        sink, finite = sink_logits(SINK, offs_h, hmask)
        m_i = tl.maximum(m_i, tl.where(finite, sink, float("-inf")))
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    # pass 2: P = exp(S - m), rounded to the query dtype before P·V; l from the unrounded P
    acc_a = tl.zeros([BLOCK_H, DA], tl.float32)
    acc_b = tl.zeros([BLOCK_H, DB if DB > 0 else 16], tl.float32)
    l_i, acc_a, acc_b = range_pv(q_a, q_b, q_row, hmask, K, A_row, lo, hi, m_safe, l_i, acc_a, acc_b, D, N, ROPE,
                                 scale, TILE, PACKED, FP8, ROPE_BF16, VALUE_TAIL, BLOCK_N, DA, DB, Q_TY,
                                 BF16_BY_BITS, DOT_FP32, Q_RELOAD)
    if PHASE == 2:
        part = (r * NSPLIT + split) * H + offs_h
        tl.store(LP + part, l_i, mask=hmask)
        tl.store(ACCP + part[:, None] * D + da[None, :], acc_a, mask=hmask[:, None] & (da[None, :] < D))
        if DB > 0 and VALUE_TAIL:
            tl.store(ACCP + part[:, None] * D + db[None, :], acc_b, mask=hmask[:, None] & (db[None, :] < D))
        return
    if HAS_SINK:
        l_i += tl.where(finite, tl.exp(sink - m_safe), 0.0)
        l_i += tl.where(sink == float("inf"), float("inf"), 0.0)     # +inf sink: out 0, LSE +inf
    finish_rows(acc_a, acc_b, m_i, l_i, count > 0, OUT + r * stride_or + offs_h[:, None] * stride_oh,
                LSE + r * H, SUM + r * H, offs_h, hmask, da, db, D if VALUE_TAIL else DA,
                DB if VALUE_TAIL else 0, STATS)


@triton.jit
def sparse_mla_merge_kernel(SINK, OUT, LSE, SUM, MP, CP, LP, ACCP, stride_or, stride_oh, H, D, NSPLIT,
                            SPLITS: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr,
                            DA: tl.constexpr, DB: tl.constexpr, VALUE_TAIL: tl.constexpr, STATS: tl.constexpr):
    """The flash-decode merge of a split row: every split's partial sums were formed against the
    same row maximum, so merging by LSE is their plain sum; the sink's term is added once here."""
    r = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    sp = tl.arange(0, SPLITS)
    parts = (r * NSPLIT + sp[None, :]) * H + offs_h[:, None]
    pmask = hmask[:, None] & (sp[None, :] < NSPLIT)
    m_i = tl.max(tl.load(MP + parts, mask=pmask, other=float("-inf")), 1)
    count = tl.sum(tl.load(CP + parts, mask=pmask, other=0), 1)
    l_i = tl.sum(tl.load(LP + parts, mask=pmask, other=0.0), 1)
    da = tl.arange(0, DA)
    db = da
    if DB > 0:
        db = DA + tl.arange(0, DB)
    acc_a = tl.zeros([BLOCK_H, DA], tl.float32)
    acc_b = tl.zeros([BLOCK_H, DB if DB > 0 else 16], tl.float32)
    for s in range(0, NSPLIT):
        part = (r * NSPLIT + s) * H + offs_h
        acc_a += tl.load(ACCP + part[:, None] * D + da[None, :], mask=hmask[:, None] & (da[None, :] < D), other=0.0)
        if DB > 0 and VALUE_TAIL:
            acc_b += tl.load(ACCP + part[:, None] * D + db[None, :], mask=hmask[:, None] & (db[None, :] < D),
                             other=0.0)
    if HAS_SINK:
        sink, finite = sink_logits(SINK, offs_h, hmask)
        m_i = tl.maximum(m_i, tl.where(finite, sink, float("-inf")))
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        l_i += tl.where(finite, tl.exp(sink - m_safe), 0.0)
        l_i += tl.where(sink == float("inf"), float("inf"), 0.0)
    finish_rows(acc_a, acc_b, m_i, l_i, count > 0, OUT + r * stride_or + offs_h[:, None] * stride_oh,
                LSE + r * H, SUM + r * H, offs_h, hmask, da, db, D if VALUE_TAIL else DA,
                DB if VALUE_TAIL else 0, STATS)


def head_split(D: int) -> tuple[int, int]:
    """``(DA, DB)``: a power-of-two main part and a tail of at least 16 (the dot's minimum), 0 when
    the head dim fits the main part."""
    DA = 16
    while DA * 2 <= D:
        DA *= 2
    return DA, (0 if D <= DA else max(16, triton.next_power_of_2(D - DA)))


def launch_config(H: int, D: int, dtype: torch.dtype, backend: str = "cuda", arch: int = 90,
                  packed: bool = False) -> dict:
    """Constexprs and launch options the dispatcher selects for a call (also what the AOT compile
    matrix enumerates); ``arch``: NVIDIA compute capability x 10 (:func:`device_target`).

    16 heads x 16 keys per step.  NVIDIA: 8 warps, ptxas allowed 255 registers (``maxnreg``; left
    alone it may cap a kernel at 128 and spill): a [16 heads, 512] fp32 accumulator and the key
    tile fit (119 registers at D 512 and 171 at 576 on sm_90, bf16).  fp32 inputs: 16 warps capped
    at 128 registers (their ``ieee`` dots run on FMA units with fp32 operands twice as wide: at
    8 warps the split partial sums spill 2.5 KB).  Before sm_90 (no wgmma: the dot's A operand,
    the query, is held in registers by every warp) a head dim with a tail (576) reads the query
    again per key block (``Q_RELOAD``) instead of holding it across the loop.  AMD: 4 waves of 64
    (gfx942's 512 registers per lane, no scratch).  Software pipelining (stages) is dropped where
    its buffers would spill: fp32 key tiles (twice as large; gfx942's 64 KB) and packed rows with
    a head-dim tail (576: the dequantisation's temporaries)."""
    DA, DB = head_split(D)
    fp32 = dtype == torch.float32
    lean = fp32 or (packed and DB > 0)
    stages = 1 if lean else (3 if backend == "cuda" else 2)
    cfg = dict(BLOCK_H=16, BLOCK_N=16, DA=DA, DB=DB, Q_RELOAD=pre_hopper(backend, arch) and DB > 0,
               num_warps=8 if backend == "cuda" else 4, num_stages=stages)
    if backend == "cuda":
        cfg.update(num_warps=16, maxnreg=128) if fp32 else cfg.update(maxnreg=255)
    return cfg


def pre_hopper(backend: str, arch: int) -> bool:
    """NVIDIA GPUs before sm_90 (sm_80 / 86 / 89): no wgmma, the dots' operands are held in
    registers by every warp that takes part.  (Consumer Blackwell, sm_120, has no wgmma either,
    but its ptxas fits every configuration without a spill: ``gpu_static``.)"""
    return backend == "cuda" and arch < 90


def kernel_covers(dtype: torch.dtype, D: int, packed: bool, backend: str, arch: int) -> bool:
    """Whether the dispatcher runs the forward kernels (whole row, split-K, plan walk, QSFA) for this
    precision / head dim / target, or keeps the PyTorch path: the kernels must compile without a
    register spill (``python -m dsattn.gpu_static --check``).  Before sm_90 (:func:`pre_hopper`),
    a head dim with a tail (V3.2's 576) fits only in half precision
    over plain rows (reading the query per key block, ``Q_RELOAD``): packed rows add the
    dequantisation's temporaries (84-116 bytes of spill on sm_80) and fp32 doubles the operands
    (12 bytes at 16 warps), so those two keep the PyTorch path."""
    if pre_hopper(backend, arch) and head_split(D)[1] > 0:
        return not packed and dtype != torch.float32
    return dtype != torch.float64


def device_target(device: torch.device) -> tuple[str, int]:
    """``(backend, arch)`` for :func:`launch_config`: ``("hip", 0)`` on ROCm, ``("cuda", major x 10 +
    minor)`` on NVIDIA; the interpreter (CPU tensors) is given sm_90's configuration."""
    if device.type != "cuda":
        return "cuda", 90
    if torch.version.hip:
        return "hip", 0
    major, minor = torch.cuda.get_device_capability(device)
    return "cuda", 10 * major + minor


def supports(P: MlaProblem) -> bool:
    """Inputs this kernel covers (else the PyTorch path runs): float16 / bfloat16 / float32 queries,
    unit-stride KV rows; packed rows with a power-of-two tile of at most the head dim's main part,
    whose rope part and fp32 scales are 2- and 4-byte aligned in every row; and what
    :func:`kernel_covers` allows on the device."""
    packed = P.ori.decode is not None
    if not kernel_covers(P.q.dtype, P.ori.D, packed, *device_target(P.q.device)):
        return False
    for src in (s for s in (P.ori, P.cmp) if s is not None):
        t = src.tensor
        if t.stride(-1) != 1:
            return False
        if src.decode is None:
            continue
        pk = src.packed
        if pk is None:
            return False
        N = src.D - pk.rope_head_dim
        tile = pk.tile_size
        row_strides = [t.stride(i) for i in range(t.dim() - 1)]
        if (tile & (tile - 1) or tile > head_split(src.D)[0] or (N + 2 * pk.rope_head_dim) % 4
                or any(x % 4 for x in row_strides) or t.data_ptr() % 4):
            return False
    return True


SPLIT_MIN_KEYS = 256     # a split reads at least this many keys (fewer: the merge costs more than it saves)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (compute units) of the device: a host-side property, no sync.
    The interpreter is given a notional 4, so that small test shapes exercise the split path."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(rows: int, head_blocks: int, width: int, sms: int) -> int:
    """Split-K factor of a launch, from shapes and the device alone (never from tensor values, so it
    is fixed under CUDA graph capture): split only when the rows x head blocks programs cannot fill
    two waves of the device, and never below ``SPLIT_MIN_KEYS`` keys per split."""
    programs = max(1, rows * head_blocks)
    if programs >= 2 * sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), width // SPLIT_MIN_KEYS, 64))


def _offsets(src, addr, mask, base: torch.Tensor) -> torch.Tensor:
    """Element offsets of key rows of ``src`` from ``base``'s first element (``-1`` where masked):
    ori and cmp rows are both addressed from the tensor at the lower address, so the kernel needs
    one pointer and every real offset is non-negative."""
    i0, i1 = addr
    t = src.tensor
    off = i1 * t.stride(0) if src.layout == "TND" else i0 * t.stride(0) + i1 * t.stride(1)
    off = off + (t.data_ptr() - base.data_ptr()) // t.element_size()
    return torch.where(mask, off, torch.full((), -1, dtype=off.dtype, device=off.device))


def packed_layout(packed, D: int, payload: torch.dtype, q_dtype: torch.dtype, device: torch.device) -> dict:
    """Runtime layout of packed rows (N quantised columns, rope width) and their constexprs, from a
    :class:`dsattn.quant.PackedKV` (None: plain rows)."""
    if packed is None:
        return dict(N=0, ROPE=0, TILE=1, PACKED=False, FP8=0, ROPE_BF16=False)
    return dict(N=D - packed.rope_head_dim, ROPE=packed.rope_head_dim, TILE=packed.tile_size, PACKED=True,
                FP8=fp8_mode(payload, device), ROPE_BF16=q_dtype != torch.float16)


def fp8_mode(payload: torch.dtype, device: torch.device) -> int:
    """How the kernel turns payload bytes into values (``load_packed_rows``' ``FP8``): 0 int8; fp8
    e4m3fn by the hardware conversion on NVIDIA sm_89+ (2), else from its bits (1: sm_80, AMD, whose
    native fp8 is the fnuz variant, and the interpreter)."""
    if payload == torch.int8:
        return 0
    if device.type == "cuda" and not torch.version.hip and torch.cuda.get_device_capability(device) >= (8, 9):
        return 2
    return 1


class RowAttention:
    """Launches the forward kernel for blocks of query rows whose keys are given as offset lists:
    the whole-row kernel, or split-K (maxima, partial sums, merge) when the rows cannot fill the
    device.  Shared by ``sparse_flash_mla`` / ``sparse_attn_sharedkv(_packed)`` and
    ``kv_quant_sparse_flash_attention`` (``value_tail=False``, ``stats=True``)."""

    def __init__(self, qf, kv: list, D: int, sinks, scale: float, packed=None, value_tail: bool = True,
                 stats: bool = False, splits: int | None = None):
        q_dtype, dev = qf.dtype, qf.device
        self.qf, self.D, self.dev, self.scale, self.splits = qf, D, dev, float(scale), splits
        H = qf.size(1)
        interpreted = dev.type == "cpu"          # only under TRITON_INTERPRET=1 (backend.use_triton)
        # the interpreter's fp32 -> bf16 cast truncates: it writes fp32 and torch rounds (nearest even)
        self.bf16_by_bits = interpreted and q_dtype == torch.bfloat16
        self.cfg = launch_config(H, D, q_dtype, *device_target(dev), packed=packed is not None)
        layout = packed_layout(packed, D, kv[0].dtype, q_dtype, dev)
        self.runtime = (layout.pop("N"), layout.pop("ROPE"))
        self.consts = dict(DOT_FP32=interpreted or q_dtype == torch.float32, BF16_BY_BITS=self.bf16_by_bits,
                           HAS_SINK=sinks is not None, VALUE_TAIL=value_tail, STATS=stats, **layout, **self.cfg)
        if packed is not None:                   # byte addressing of packed rows
            kv = [t.view(torch.uint8) for t in kv]
        # one pointer for every KV tensor: offsets are taken from the one at the lowest address
        self.base = min(kv, key=lambda t: t.data_ptr())
        self.sinks = sinks
        self.H, self.HB = H, triton.cdiv(H, self.cfg["BLOCK_H"])
        self.out_dim = D if value_tail else self.cfg["DA"]

    def outputs(self, R: int):
        """``(out [R, H, out_dim], lse or max [R, H], sum [R, H])`` to fill."""
        dt = torch.float32 if self.bf16_by_bits else self.qf.dtype
        f32 = dict(dtype=torch.float32, device=self.dev)
        return (torch.empty(R, self.H, self.out_dim, dtype=dt, device=self.dev), torch.empty(R, self.H, **f32),
                torch.empty(R, self.H, **f32) if self.consts["STATS"] else torch.empty(0, **f32))

    def offsets(self, src, addr, mask) -> torch.Tensor:
        return _offsets(src, addr, mask, self.base)

    def run(self, t0: int, t1: int, addr: torch.Tensor, out, lse, ssum) -> None:
        """Rows ``[t0, t1)`` of ``qf`` with key offsets ``addr [t1 - t0, W]`` into outputs rows ``[t0, t1)``."""
        cfg, H, HB, dev = self.cfg, self.H, self.HB, self.dev
        n, Wk = t1 - t0, addr.size(1)
        o, lse_rows = out[t0:t1], lse[t0:t1]
        sum_rows = ssum[t0:t1] if ssum.numel() else lse_rows
        sinks = self.sinks if self.sinks is not None else lse      # a placeholder pointer when absent
        S = self.splits if self.splits is not None else choose_splits(n, HB, Wk, sm_count(dev))
        chunk = max(1, triton.cdiv(triton.cdiv(Wk, S), cfg["BLOCK_N"])) * cfg["BLOCK_N"]
        S = max(1, triton.cdiv(Wk, chunk))
        qf = self.qf[t0:t1]
        common = (self.qf.stride(0), self.qf.stride(1), o.stride(0), o.stride(1), addr.stride(0),
                  H, self.D, Wk, chunk if S > 1 else Wk, S, *self.runtime, self.scale)
        if S == 1:
            sparse_mla_fwd_kernel[(n, HB, 1)](qf, self.base, addr, sinks, o, lse_rows, sum_rows, lse, lse, lse, lse,
                                              *common, PHASE=0, SPLITS=1, **self.consts)
            return
        mp = torch.empty(n, S, H, dtype=torch.float32, device=dev)
        cp = torch.empty(n, S, H, dtype=torch.int32, device=dev)
        lp = torch.empty(n, S, H, dtype=torch.float32, device=dev)
        accp = torch.empty(n, S, H, self.D, dtype=torch.float32, device=dev)
        sp2 = triton.next_power_of_2(S)
        for phase in (1, 2):
            sparse_mla_fwd_kernel[(n, HB, S)](qf, self.base, addr, sinks, o, lse_rows, sum_rows, mp, cp, lp, accp,
                                              *common, PHASE=phase, SPLITS=sp2, **self.consts)
        sparse_mla_merge_kernel[(n, HB)](sinks, o, lse_rows, sum_rows, mp, cp, lp, accp, o.stride(0), o.stride(1), H,
                                         self.D, S, SPLITS=sp2, HAS_SINK=self.consts["HAS_SINK"],
                                         BLOCK_H=cfg["BLOCK_H"], DA=cfg["DA"], DB=cfg["DB"],
                                         VALUE_TAIL=self.consts["VALUE_TAIL"], STATS=self.consts["STATS"])


def forward(P: MlaProblem, return_softmax_lse: bool, splits: int | None = None):
    """Run the kernel over every query row; ``splits`` overrides :func:`choose_splits` (tests)."""
    q = P.q
    qf = P.rows.flat_unit_stride(q)
    R = qf.size(0)
    att = RowAttention(qf, [src.tensor for src in (P.ori, P.cmp) if src is not None], P.ori.D, P.sinks, P.scale,
                       packed=P.ori.packed if P.ori.decode is not None else None, splits=splits)
    out, lse, _ = att.outputs(R)
    W = max(1, P.ori_width + P.cmp_width)
    step = max(1, min(R, ADDRESS_BUDGET // (8 * W))) if R else 1
    for t0 in range(0, R, step):
        t1 = min(R, t0 + step)
        k = P.keys(t0, t1)
        parts = [att.offsets(P.ori, k.ori_addr, k.ori_mask)]
        if P.cmp is not None:
            parts.append(att.offsets(P.cmp, k.cmp_addr, k.cmp_mask))
        att.run(t0, t1, torch.cat(parts, 1).contiguous(), out, lse, _)
    attn_out = P.rows.unflat(out.to(q.dtype), q)
    if not return_softmax_lse:
        return attn_out, torch.zeros((), dtype=stat_dtype(q), device=q.device)
    return attn_out, lse_from_rows(lse, q, "BSND" if P.rows.layout == "BSND" else "TND")


# ----------------------------------------------------------------------------------------------
# backward (issue 13, item 5)

@triton.jit
def _load_row(X, r, stride_r, stride_h, offs_h, rmask, da, db, D, DB: tl.constexpr, DOT_FP32: tl.constexpr):
    """One row's heads ``[BLOCK_H, D]`` as (main part, tail); 0 where ``rmask`` is off (padding rows
    may hold anything, NaN included, and must not reach a gradient)."""
    return head_parts(X + r * stride_r + offs_h[:, None] * stride_h, rmask, da, db, D, DB, DOT_FP32)


@triton.jit
def sparse_mla_bwd_kernel(Q, DO, O, LSE, K, A, G, VALID, SINK, DQ, DKV, DSINK, PM,
                          stride_qr, stride_qh, stride_dor, stride_doh, stride_or, stride_oh, stride_dqr, stride_dqh,
                          stride_ar, H, D, W, scale, inv_h,
                          HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                          DA: tl.constexpr, DB: tl.constexpr, DOT_FP32: tl.constexpr, BF16_BY_BITS: tl.constexpr):
    """One query row x a block of heads: P recomputed from the forward LSE, dS = P·(dP - rowsum(dO·O))
    rounded to the query dtype (the golden's rounding point), dq = scale·dS·K stored directly; each
    key block's dK = scale·dSᵀ·q + round(P)ᵀ·dO is added to the fp32 KV gradient by atomics at
    the key's gradient row ``G`` (keys shared by many rows -- the window band, HCA's prefix -- are
    summed in whatever order the atomics land: fp32, not bit-reproducible run to run); P summed over
    the block's heads / H goes to PM (the L1-norm outputs) and the sink's gradient to DSINK, both
    by atomics across head blocks and rows."""
    r = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    # (the row flag broadcast as a vector: the interpreter rejects a scalar-bool & vector-bool mask)
    rmask = hmask & ((tl.zeros([BLOCK_H], tl.int32) + tl.load(VALID + r).to(tl.int32)) != 0)
    Q_TY = Q.dtype.element_ty
    da = tl.arange(0, DA)
    db = da
    if DB > 0:
        db = DA + tl.arange(0, DB)
    q_a, q_b = _load_row(Q, r, stride_qr, stride_qh, offs_h, rmask, da, db, D, DB, DOT_FP32)
    do_a, do_b = _load_row(DO, r, stride_dor, stride_doh, offs_h, rmask, da, db, D, DB, DOT_FP32)
    o_a, o_b = _load_row(O, r, stride_or, stride_oh, offs_h, rmask, da, db, D, DB, False)
    dsum = tl.sum(do_a.to(tl.float32) * o_a.to(tl.float32), 1)
    if DB > 0:
        dsum += tl.sum(do_b.to(tl.float32) * o_b.to(tl.float32), 1)
    lse = tl.load(LSE + r * H + offs_h, mask=rmask, other=0.0)
    dq_a = tl.zeros([BLOCK_H, DA], tl.float32)
    dq_b = tl.zeros([BLOCK_H, DB if DB > 0 else 16], tl.float32)
    pdp = tl.zeros([BLOCK_H], tl.float32)
    count = tl.zeros([BLOCK_H], tl.int32)
    for n0 in range(0, W, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        off = tl.load(A + r * stride_ar + cols, mask=cols < W, other=-1)
        valid = off >= 0
        off = tl.where(valid, off, 0)
        grow = tl.load(G + r * stride_ar + cols, mask=valid, other=0)
        ka = _load_keys(K, off, valid, 0, DA, D, 0, 0, 1, False, 0, False, Q_TY, BF16_BY_BITS, DOT_FP32)
        s = _dot(q_a, tl.trans(ka), DOT_FP32)
        dp = _dot(do_a, tl.trans(ka), DOT_FP32)
        kb = ka
        if DB > 0:
            kb = _load_keys(K, off, valid, DA, DB, D, 0, 0, 1, False, 0, False, Q_TY, BF16_BY_BITS, DOT_FP32)
            s += _dot(q_b, tl.trans(kb), DOT_FP32)
            dp += _dot(do_b, tl.trans(kb), DOT_FP32)
        p = tl.exp(tl.where(valid[None, :] & rmask[:, None], s * scale - lse[:, None], float("-inf")))
        pdp += tl.sum(p * dp, 1)
        count += tl.sum(valid.to(tl.int32), 0)
        ds_q = round_to_q(tl.where(p != 0.0, p * (dp - dsum[:, None]), 0.0), Q_TY, BF16_BY_BITS, DOT_FP32)
        p_q = round_to_q(p, Q_TY, BF16_BY_BITS, DOT_FP32)
        dq_a += _dot(ds_q, ka, DOT_FP32)
        dk_a = scale * _dot(tl.trans(ds_q), q_a, DOT_FP32) + _dot(tl.trans(p_q), do_a, DOT_FP32)
        tl.atomic_add(DKV + grow[:, None] * D + da[None, :], dk_a, mask=valid[:, None] & (da[None, :] < D))
        if DB > 0:
            dq_b += _dot(ds_q, kb, DOT_FP32)
            dk_b = scale * _dot(tl.trans(ds_q), q_b, DOT_FP32) + _dot(tl.trans(p_q), do_b, DOT_FP32)
            tl.atomic_add(DKV + grow[:, None] * D + db[None, :], dk_b, mask=valid[:, None] & (db[None, :] < D))
        tl.atomic_add(PM + r * W + cols, tl.sum(p, 0) * inv_h, mask=valid)
    dq_row = DQ + r * stride_dqr + offs_h[:, None] * stride_dqh
    tl.store(dq_row + da[None, :], (scale * dq_a).to(DQ.dtype.element_ty), mask=hmask[:, None] & (da[None, :] < D))
    if DB > 0:
        tl.store(dq_row + db[None, :], (scale * dq_b).to(DQ.dtype.element_ty),
                 mask=hmask[:, None] & (db[None, :] < D))
    if HAS_SINK:                     # rows with a key and a finite LSE (a +inf sink's rows: none)
        sink = tl.load(SINK + offs_h, mask=hmask, other=float("-inf")).to(tl.float32)
        has = rmask & (count > 0) & (tl.abs(lse) < float("inf"))
        g = tl.exp(tl.where(has, sink - lse, float("-inf"))) * pdp
        tl.atomic_add(DSINK + offs_h, -g, mask=has)


def backward_supports(P: MlaProblem) -> bool:
    """The gradient kernel covers half-precision queries, unpacked KV and head dims without a tail
    (V4's 512 and below).  It holds q, dO, dq and dK tiles at once, and two cases spill registers,
    so they keep the PyTorch path:
    - V3.2's 576 (ptxas: 100-144 bytes at 8 warps, more at 16), which the spec's V4 training does
      not need (20 §2.2: D = 512);
    - fp32 queries (``ieee`` fp32 dots on FMA units: 88-460 bytes on NVIDIA at 8 or 16 warps,
      380 on gfx942)."""
    return (supports(P) and head_split(P.ori.D)[1] == 0 and P.q.dtype != torch.float32
            and all(src.decode is None for src in (P.ori, P.cmp) if src is not None))


def _grad_rows(src, addr, mask, first: int) -> torch.Tensor:
    """Row of each key in the flat fp32 gradient buffer (ori rows first, then cmp rows)."""
    i0, i1 = addr
    n = src.tensor.size(1) if src.layout == "BSND" else 0
    row = i1 if src.layout == "TND" else i0 * n + i1
    return torch.where(mask, row + first, torch.zeros((), dtype=row.dtype, device=row.device))


def backward(P: MlaProblem, dout, attn_out, softmax_lse):
    """The gradient through :func:`sparse_mla_bwd_kernel`; same outputs as the other backends' (``dispatch.backward``)."""
    from .problem import grad_results, l1_outputs, lse_to_rows
    q, rows = P.q, P.rows
    dev = q.device
    qf, dof, of = (rows.flat_unit_stride(x) for x in (q, dout, attn_out))
    lse_rows = lse_to_rows(softmax_lse, rows).float().contiguous()
    R, H, D = qf.shape
    interpreted = dev.type == "cpu"
    bf16_by_bits = interpreted and q.dtype == torch.bfloat16
    cfg = launch_config(H, D, q.dtype, *device_target(dev))
    cfg["num_stages"] = 1                    # the kernel holds q, dO, dq and dK tiles: no room to pipeline
    del cfg["Q_RELOAD"]                      # (only 512-wide heads reach it: no tail)
    srcs = [src for src in (P.ori, P.cmp) if src is not None]
    base = min((src.tensor for src in srcs), key=lambda t: t.data_ptr())
    n_ori = P.ori.tensor.numel() // D
    dkv = torch.zeros(n_ori + (P.cmp.tensor.numel() // D if P.cmp is not None else 0), D, dtype=torch.float32,
                      device=dev)
    dq = torch.empty(R, H, D, dtype=torch.float32 if bf16_by_bits else q.dtype, device=dev)
    dsinks = torch.zeros(H, dtype=torch.float32, device=dev) if P.sinks is not None else None
    sdt = stat_dtype(q)
    cmp_l1 = torch.zeros(R, P.cmp_idx.size(1), dtype=sdt, device=dev) if P.cmp_idx is not None else None
    ori_l1 = torch.zeros(R, P.ori_idx.size(1), dtype=sdt, device=dev) if P.ori_idx is not None else None
    W = max(1, P.ori_width + P.cmp_width)
    HB = triton.cdiv(H, cfg["BLOCK_H"])
    step = max(1, min(R, ADDRESS_BUDGET // (20 * W))) if R else 1
    for t0 in range(0, R, step):
        t1 = min(R, t0 + step)
        k = P.keys(t0, t1)
        addr = [_offsets(P.ori, k.ori_addr, k.ori_mask, base)]
        grow = [_grad_rows(P.ori, k.ori_addr, k.ori_mask, 0)]
        if P.cmp is not None:
            addr.append(_offsets(P.cmp, k.cmp_addr, k.cmp_mask, base))
            grow.append(_grad_rows(P.cmp, k.cmp_addr, k.cmp_mask, n_ori))
        addr, grow = torch.cat(addr, 1).contiguous(), torch.cat(grow, 1).contiguous()
        n, Wk = t1 - t0, addr.size(1)
        pmean = torch.zeros(n, Wk, dtype=torch.float32, device=dev)
        dq_rows = dq[t0:t1]
        sparse_mla_bwd_kernel[(n, HB)](
            qf[t0:t1], dof[t0:t1], of[t0:t1], lse_rows[t0:t1], base, addr, grow, k.valid.to(torch.int8),
            P.sinks if P.sinks is not None else lse_rows, dq_rows, dkv,
            dsinks if dsinks is not None else lse_rows, pmean,
            qf.stride(0), qf.stride(1), dof.stride(0), dof.stride(1), of.stride(0), of.stride(1), dq.stride(0),
            dq.stride(1), addr.stride(0),
            H, D, Wk, float(P.scale), 1.0 / H, HAS_SINK=P.sinks is not None, DOT_FP32=interpreted or
            q.dtype == torch.float32, BF16_BY_BITS=bf16_by_bits, **cfg)
        l1_outputs(P, k, pmean, t0, t1, cmp_l1, ori_l1)
    dori = dkv[:n_ori].view(P.ori.tensor.shape)
    dcmp = dkv[n_ori:].view(P.cmp.tensor.shape) if P.cmp is not None else None
    return grad_results(P, dq.to(q.dtype), dori, dcmp, dsinks, ori_l1, cmp_l1)
