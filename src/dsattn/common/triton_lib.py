"""Triton building blocks shared by the kernels of every operator family (issue 13).

Imported only where Triton runs (:func:`dsattn.backend.use_triton`).  Everything here works in
the compiled kernels (NVIDIA, AMD) and under Triton's interpreter, where two casts need care:
fp32 -> bf16 truncates there (so :func:`round_bf16` rounds by bit arithmetic), and the fp8 types
differ between vendors (NVIDIA's e4m3fn, AMD gfx942's e4m3fnuz), so packed fp8 payloads are
decoded from their bits (:func:`fp8e4m3fn_to_f32`), exactly, on every target.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """fp32 -> nearest-even bfloat16 value, kept in fp32 (the interpreter's own cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp8e4m3fn_to_f32(byte):
    """OCP float8 e4m3fn bytes (uint8) -> fp32, exactly: sign, 4 exponent bits (bias 7), 3 mantissa
    bits, subnormals, and S.1111.111 = NaN (the 0xFF of unwritten cache rows)."""
    b = byte.to(tl.uint32)
    e = (b >> 3) & 0xF
    mant = b & 0x7
    normal = (((b & 0x80) << 24) | ((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    sub = mant.to(tl.float32) * 0.001953125                         # m / 8 * 2**-6
    sub = tl.where((b & 0x80) != 0, -sub, sub)
    v = tl.where(e == 0, sub, normal)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def round_to_q(x, Q_TY: tl.constexpr, BF16_BY_BITS: tl.constexpr, DOT_FP32: tl.constexpr):
    """fp32 -> the query dtype's value (the golden's rounding point), as the dot's operand type
    (fp32 when the dots run in fp32: under the interpreter, or for fp32 queries)."""
    if BF16_BY_BITS:
        x = round_bf16(x)
    else:
        x = x.to(Q_TY)
    if DOT_FP32:
        x = x.to(tl.float32)
    return x


@triton.jit
def load_packed_rows(KB, off, sel, C0: tl.constexpr, WIDTH: tl.constexpr, D, N, ROPE, TILE: tl.constexpr,
                     FP8: tl.constexpr, ROPE_BF16: tl.constexpr):
    """Dequantised key columns ``C0 .. C0 + WIDTH`` of packed rows at byte offsets ``off`` from ``KB``
    (``sel``: rows to read; others are 0 and never touched), in fp32.  A row is ``[N quantised
    bytes | ROPE x 16-bit | N / TILE fp32 scales]`` (:func:`dsattn.quant.quantize_kv_rows`):
    quantised columns are the payload (int8 or fp8 e4m3fn) times their tile's scale, rope columns
    are exact.  One byte-pointer tensor serves both kinds (a quantised column's byte, a rope
    column's low byte; the high byte is the next), and the scales are loaded once per tile, not
    per column: register pressure, not bandwidth, bounds this kernel.  ``C0`` is a multiple of
    ``TILE`` or the columns lie in one tile.  ``FP8``: 0 int8 payload, 1 fp8 decoded from its bits
    (any target, the interpreter), 2 fp8 by the hardware conversion (NVIDIA sm_89 and later)."""
    cols = C0 + tl.arange(0, WIDTH)
    row = KB + off[:, None]
    c = cols[None, :]
    nope = sel[:, None] & (c < N)
    rope = sel[:, None] & (c >= N) & (c < D)
    ptr = row + tl.where(c < N, c, 2 * c - N)
    lo = tl.load(ptr, mask=nope | rope, other=0)
    hi = tl.load(ptr + 1, mask=rope, other=0)
    if FP8 == 2:                     # the hardware conversion (NVIDIA sm_89+): fewer registers
        v = lo.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif FP8 == 1:
        v = fp8e4m3fn_to_f32(lo)
    else:
        v = lo.to(tl.int8, bitcast=True).to(tl.float32)
    scales = (KB + off + N + 2 * ROPE).to(tl.pointer_type(tl.float32))
    if WIDTH >= TILE:
        NT: tl.constexpr = WIDTH // TILE
        tiles = C0 // TILE + tl.arange(0, NT)
        sc = tl.load(scales[:, None] + tiles[None, :], mask=sel[:, None] & (tiles[None, :] * TILE < N), other=0.0)
        v = tl.reshape(tl.reshape(v, [v.shape[0], NT, TILE]) * sc[:, :, None], [v.shape[0], WIDTH])
    else:
        # (the tile's flag as a vector: the interpreter rejects a vector-bool & scalar-bool mask)
        sc = tl.load(scales + C0 // TILE, mask=sel & ((tl.zeros_like(off) + C0) < N), other=0.0)
        v = v * sc[:, None]
    bits = (lo.to(tl.uint16) | (hi.to(tl.uint16) << 8)).to(tl.int16, bitcast=True)
    if ROPE_BF16:
        r = bits.to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        r = bits.to(tl.float16, bitcast=True).to(tl.float32)
    return tl.where(rope, r, tl.where(nope, v, 0.0))


@triton.jit
def sink_logits(SINK, offs_h, hmask):
    """The sink of each head and whether it is finite (a ``-inf`` sink is no sink; ``+inf`` makes
    the row's output 0 and its LSE ``+inf``; 00 §12)."""
    sink = tl.load(SINK + offs_h, mask=hmask, other=float("-inf")).to(tl.float32)
    finite = (sink == sink) & (tl.abs(sink) < float("inf"))
    return sink, finite


@triton.jit
def finish_rows(acc_a, acc_b, m_i, l_i, has, OUT_ROW, LSE_ROW, SUM_ROW, offs_h, hmask, da, db, D_OUT,
                DB_OUT: tl.constexpr, STATS: tl.constexpr):
    """Normalise and store one row's heads: out = acc / l (0 where the row has no key; the tail
    ``acc_b`` only when ``DB_OUT``), then LSE = m + log l, or with ``STATS`` the maximum and the sum
    themselves (``kv_quant_sparse_flash_attention``'s softmax_max / softmax_sum), all 0 where the
    row has no key.  ``m_i`` is the maximum P was formed against, ``l_i`` the sum with the sink's term."""
    l_safe = tl.where(has, l_i, 1.0)
    inv = tl.where(has, 1.0 / l_safe, 0.0)
    tl.store(OUT_ROW + da[None, :], (acc_a * inv[:, None]).to(OUT_ROW.dtype.element_ty),
             mask=hmask[:, None] & (da[None, :] < D_OUT))
    if DB_OUT > 0:
        tl.store(OUT_ROW + db[None, :], (acc_b * inv[:, None]).to(OUT_ROW.dtype.element_ty),
                 mask=hmask[:, None] & (db[None, :] < D_OUT))
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    if STATS:
        tl.store(LSE_ROW + offs_h, tl.where(has, m_fin, 0.0), mask=hmask)
        tl.store(SUM_ROW + offs_h, tl.where(has, l_i, 0.0), mask=hmask)
    else:
        tl.store(LSE_ROW + offs_h, tl.where(has, m_fin + tl.log(l_safe), 0.0), mask=hmask)
