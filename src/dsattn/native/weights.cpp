// Linear layers over block-scaled quantised weights, read in place (W8A16 / W4A16): y [M, N] = x [M, K] W^T (+ bias),
// W held as its codes, never dequantised into memory, in one of two formats:
//   FP8    e4m3fn codes [N, K] (a byte a weight) with one scale per block of bn rows x bk columns (scale
//          [ceil(N / bn), ceil(K / bk)]: DeepSeek-V3.2 / GLM-5's fp32 weight_scale_inv, DeepSeek-V4's ue8m0);
//   MXFP4  e2m1 codes two a byte [N, K / 2] (element 2i in the low nibble) with one scale per row and 32 columns
//          (bn 1, bk 32: DeepSeek-V4's routed experts, ue8m0).
// Scales are fp32 or ue8m0 bytes read as they are (an expert's MXFP4 scales are an eighth of its codes' bytes:
// widened to fp32 they would be half).
//
// Every element is  y[m, n] = sum over K blocks b of  scale[n / bn, b] * (sum over k in b of code[n, k] x[m, k])
// in fp32: the codes' values are exact in fp32 (and bf16), the products of a block are summed first and scaled
// once, as a dequantised weight's product would be up to summation order (the tiled MXFP4 path folds the power-of-
// two scale into the decoded values instead: exact too, but for values past fp32's range).  Two paths:
//   streamed (M <= STREAM_ROWS, decode): each weight row is read once, its codes widened in registers and
//            multiplied into every row of x: bf16 x on AVX512-BF16 CPUs by table to bf16 and vdpbf16ps (FP8 with
//            VBMI's 64-entry byte table, MXFP4 with vpermw), else
//            through fp16 to fp32 (fp8.h, 6 instructions per 16 codes) against x widened to fp32 once; the threads
//            split N.  Bound by the weight bytes a second at one row of x.
//   tiled    (prefill): 32 rows of codes x one K block at a time decoded to the GEMM's operand type (exact) in a
//            thread's scratch, multiplied by x^T (packed once a call) on the kernels' GEMM (gemm.h: AMX,
//            vdpbf16ps, or dsattn's fp32), each block's product scaled into the rows' sums.
// Batch invariance: the streamed path sums each row of x on its own, in the same operations whatever the rows beside
// it; the tiled path's GEMM blocks over M, so a row's bits there follow M.  The batch-invariant mode (stream_rows_max
// >= M) streams every call, x in groups of STREAM_ROWS rows over chunks of weight rows held in L2: one order for every
// M, on every ISA cap (the route -- vdpbf16ps or fp32 -- follows x's dtype and the CPU, never M).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "common.h"
#include "fp8.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <type_traits>

#if DSATTN_HAVE_BRGEMM

namespace {

using dsattn_native::Buffer;
using dsattn_native::round_up;

constexpr int64_t STREAM_ROWS = 8;     // rows of x up to which the weight is streamed (decode)
constexpr int64_t PREFETCH_ROWS = 2;   // how far ahead the streamed path prefetches weight rows
constexpr int64_t TILE_N = 128;        // weight rows a tile decodes (fewer, larger GEMM calls)

enum class Codes { FP8, FP4 };

// bytes of a row of codes, and where code k of a row starts
template <Codes F> constexpr int64_t code_bytes(int64_t k) { return F == Codes::FP8 ? k : k / 2; }

struct QuantProblem {
  int64_t M, N, K, bn, bk, kblocks;
  const float* x;        // [M, Kx] fp32 (the streamed path: widened, zero past K up to Kx)
  int64_t Kx;
  const uint8_t* codes;  // [N, code_bytes(K)]
  const float* scale;    // [ceil(N / bn), kblocks] fp32, or null and:
  const uint8_t* scale_e8m0;      // the same as ue8m0 exponents (a checkpoint's own bytes: no widened copy)
  const float* bias;     // [N] or null
  float* y;              // [M, N] fp32
  const uint16_t* xb = nullptr;   // or x as [M, Kx] bf16 (the vdpbf16ps streamed path; zero past K)

  // the scale of block i (row-major over [ceil(N / bn), kblocks]): ue8m0 e is 2^(e - 127), e 0 the fp32 subnormal
  // 2^-127, e 255 NaN
  float block_scale(int64_t i) const {
    if (!scale_e8m0) return scale[i];
    const uint32_t e = scale_e8m0[i];
    const uint32_t bits = e == 255 ? 0x7FC00000u : e == 0 ? 0x00400000u : e << 23;
    return __builtin_bit_cast(float, bits);
  }

  // e where block i's scale is 2^(e - 127), a normal power of two given as ue8m0 or fp32 alike; else 0
  uint32_t power_of_two_scale(int64_t i) const {
    if (scale_e8m0) return scale_e8m0[i] == 255 ? 0 : scale_e8m0[i];
    const uint32_t bits = __builtin_bit_cast(uint32_t, scale[i]);
    return (bits & 0x807FFFFFu) == 0 && bits != 0x7F800000u ? bits >> 23 : 0;
  }
};

// ---- streamed ----
// One weight row's block sums into acc[m] (16 lanes each), the codes of [k0, k0 + len) (len a multiple of 16,
// the last block's tail read through a zero-padded copy).

// e2m1 codes -> 2 x their values (integers, exact as int8: 0 1 2 3 4 6 8 12, bit 3 the sign); the factor 1/2 goes
// into the block's scale step
constexpr int8_t E2M1_TWICE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// what a decoded code is times its value: FP8 codes widen through fp16 to value / 256, FP4 codes to 2 x value
template <Codes F> constexpr float CODE_UNIT = F == Codes::FP8 ? 256.0f : 0.5f;

template <Codes F>
inline float code_value_scaled(const uint8_t* row, int64_t k) {   // the value / CODE_UNIT, as the vector paths give it
  if constexpr (F == Codes::FP8) {
    return dsattn_native::fp8_e4m3fn_float_div256(row[k]);
  } else {
    return static_cast<float>(E2M1_TWICE[(row[k / 2] >> (4 * (k & 1))) & 0xF]);
  }
}

template <int MR, Codes F>
inline void stream_rows_generic(const QuantProblem& p, int64_t n0, int64_t n1) {
  static const auto lut = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = dsattn_native::fp8_e4m3fn_float_div256(static_cast<uint8_t>(c));
    return t;
  }();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.codes + n * code_bytes<F>(p.K);
    const int64_t srow = (n / p.bn) * p.kblocks;
    float total[MR] = {};
    for (int64_t b = 0; b < p.kblocks; ++b) {
      const int64_t k0 = b * p.bk, k1 = std::min(p.K, k0 + p.bk);
      float acc[MR] = {};
      for (int64_t k = k0; k < k1; ++k) {
        const float w = F == Codes::FP8 ? lut[row[k]] : code_value_scaled<F>(row, k);
        for (int m = 0; m < MR; ++m) acc[m] += w * p.x[m * p.Kx + k];
      }
      for (int m = 0; m < MR; ++m) total[m] += (acc[m] * CODE_UNIT<F>) * p.block_scale(srow + b);
    }
    for (int m = 0; m < MR; ++m) p.y[m * p.N + n] = total[m] + (p.bias ? p.bias[n] : 0.0f);
  }
}

#if DSATTN_X86
// 16 e2m1 codes (8 bytes) -> 2 x their values: the nibbles put in element order, looked up as int8, widened
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m128i fp4x16_twice_i8(const uint8_t* x) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)), low = _mm_set1_epi8(0x0F);
  const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
  return _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(E2M1_TWICE)), nibbles);
}

// (helpers, not lambdas: a lambda's body does not take its function's target ISA)
template <int MR, Codes F>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma"), always_inline)) inline void step_avx512(
    const uint8_t* codes16, const float* x, int64_t Kx, __m512* acc) {
  __m512 w;
  if constexpr (F == Codes::FP8) w = dsattn_native::fp8x16_div256_avx512(codes16);
  else w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(fp4x16_twice_i8(codes16)));
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * Kx), acc[m]);
}

template <int MR, Codes F>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void step_avx2(const uint8_t* codes16, const float* x,
                                                                               int64_t Kx, __m256* acc) {
  __m256 lo, hi;
  if constexpr (F == Codes::FP8) {
    dsattn_native::fp8x16_div256_avx2(codes16, lo, hi);
  } else {
    const __m128i v = fp4x16_twice_i8(codes16);
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
  }
  for (int m = 0; m < MR; ++m)
    acc[m] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + m * Kx + 8), _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + m * Kx), acc[m]));
}

template <int MR, Codes F>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
void stream_rows_avx512(const QuantProblem& p, int64_t n0, int64_t n1) {
  alignas(64) uint8_t tail[16];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.codes + n * code_bytes<F>(p.K);
    const int64_t srow = (n / p.bn) * p.kblocks;
    __m512 total[MR];
    for (int m = 0; m < MR; ++m) total[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < p.kblocks; ++b) {
      const int64_t k0 = b * p.bk, k1 = std::min(p.K, k0 + p.bk);
      __m512 acc[MR];
      for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
      int64_t k = k0;
      for (; k + 16 <= k1; k += 16) {
        // the row PREFETCH_ROWS ahead, a line per 64 bytes: with the hardware prefetcher alone a decode call read
        // 9-11 GB/s on the AMX Xeon, with this 15-16 (read bandwidth 26); 4 rows ahead was no better
        if ((code_bytes<F>(k) & 63) == 0)           // (a prefetch past the last row never faults)
          _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_ROWS * code_bytes<F>(p.K) + code_bytes<F>(k)),
                       _MM_HINT_T0);
        step_avx512<MR, F>(row + code_bytes<F>(k), p.x + k, p.Kx, acc);
      }
      if (k < k1) {                                   // K's tail (x is zero there up to Kx; FP4's K: whole blocks)
        std::memset(tail, 0, 16);
        std::memcpy(tail, row + code_bytes<F>(k), code_bytes<F>(k1 - k));
        step_avx512<MR, F>(tail, p.x + k, p.Kx, acc);
      }
      const __m512 s = _mm512_set1_ps(p.block_scale(srow + b)), unit = _mm512_set1_ps(CODE_UNIT<F>);
      for (int m = 0; m < MR; ++m) total[m] = _mm512_fmadd_ps(_mm512_mul_ps(acc[m], unit), s, total[m]);
    }
    for (int m = 0; m < MR; ++m) p.y[m * p.N + n] = _mm512_reduce_add_ps(total[m]) + (p.bias ? p.bias[n] : 0.0f);
  }
}

__attribute__((target("avx2,fma,f16c"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <int MR, Codes F>
__attribute__((target("avx2,fma,f16c")))
void stream_rows_avx2(const QuantProblem& p, int64_t n0, int64_t n1) {
  alignas(32) uint8_t tail[16];
  alignas(32) float total[MR][8];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.codes + n * code_bytes<F>(p.K);
    const int64_t srow = (n / p.bn) * p.kblocks;
    for (int m = 0; m < MR; ++m) _mm256_store_ps(total[m], _mm256_setzero_ps());
    for (int64_t b = 0; b < p.kblocks; ++b) {
      const int64_t k0 = b * p.bk, k1 = std::min(p.K, k0 + p.bk);
      __m256 acc[MR];
      for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
      int64_t k = k0;
      for (; k + 16 <= k1; k += 16) {
        if ((code_bytes<F>(k) & 63) == 0)
          _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_ROWS * code_bytes<F>(p.K) + code_bytes<F>(k)),
                       _MM_HINT_T0);
        step_avx2<MR, F>(row + code_bytes<F>(k), p.x + k, p.Kx, acc);
      }
      if (k < k1) {
        std::memset(tail, 0, 16);
        std::memcpy(tail, row + code_bytes<F>(k), code_bytes<F>(k1 - k));
        step_avx2<MR, F>(tail, p.x + k, p.Kx, acc);
      }
      const __m256 s = _mm256_set1_ps(p.block_scale(srow + b)), unit = _mm256_set1_ps(CODE_UNIT<F>);
      for (int m = 0; m < MR; ++m)
        _mm256_store_ps(total[m], _mm256_fmadd_ps(_mm256_mul_ps(acc[m], unit), s, _mm256_load_ps(total[m])));
    }
    for (int m = 0; m < MR; ++m) p.y[m * p.N + n] = hsum256(_mm256_load_ps(total[m])) + (p.bias ? p.bias[n] : 0.0f);
  }
}
#endif

#if DSATTN_X86
// bf16 x on AVX512-BF16 CPUs with VBMI (Zen 4 / 5, Sapphire Rapids on): 64 codes at a time to bf16 by table (fp8.h,
// 9 instructions) and into every row of x by vdpbf16ps, 32 products an instruction.  The fp32 route spends 9
// instructions per 16 codes and one FMA per 16 products: at 8 rows of x it was bound by its FMA ports
// (4-6 GB/s of weights on the AMX Xeon).  The codes' values are exact in bf16 and their products with bf16 x exact
// in fp32: only the summation order differs from the fp32 route.
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,fma")))
void stream_rows_dpbf16(const QuantProblem& p, int64_t n0, int64_t n1) {
  const dsattn_native::Fp8Bf16Tables& tables = dsattn_native::fp8_bf16_tables();
  alignas(64) uint8_t tail[64];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.codes + n * p.K;
    const int64_t srow = (n / p.bn) * p.kblocks;
    __m512 total[MR];
    for (int m = 0; m < MR; ++m) total[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < p.kblocks; ++b) {
      const int64_t k0 = b * p.bk, k1 = std::min(p.K, k0 + p.bk);
      __m512 acc[MR];
      for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
      for (int64_t k = k0; k < k1; k += 64) {
        const uint8_t* codes = row + k;
        if (k + 64 > k1) {                          // K's tail (x is zero there up to Kx)
          std::memset(tail, 0, 64);
          std::memcpy(tail, row + k, k1 - k);
          codes = tail;
        }
        _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_ROWS * p.K + k), _MM_HINT_T0);
        __m512i w0, w1;
        dsattn_native::fp8x64_bf16_vbmi_regs(codes, tables, w0, w1);
        for (int m = 0; m < MR; ++m) {
          const uint16_t* xr = p.xb + m * p.Kx + k;
          acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)w0, (__m512bh)_mm512_loadu_si512(xr));
          acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)w1, (__m512bh)_mm512_loadu_si512(xr + 32));
        }
      }
      const __m512 s = _mm512_set1_ps(p.block_scale(srow + b));
      for (int m = 0; m < MR; ++m) total[m] = _mm512_fmadd_ps(acc[m], s, total[m]);
    }
    for (int m = 0; m < MR; ++m) p.y[m * p.N + n] = _mm512_reduce_add_ps(total[m]) + (p.bias ? p.bias[n] : 0.0f);
  }
}
#endif

#if DSATTN_X86
// 2 x the e2m1 values (0 1 2 3 4 6 8 12, bit 3 the sign) as bf16 bits, for vpermw (32 entries, the last 16 unused)
alignas(64) constexpr uint16_t E2M1_TWICE_BF16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40C0, 0x4100, 0x4140,
    0x8000, 0xBF80, 0xC000, 0xC040, 0xC080, 0xC0C0, 0xC100, 0xC140};

// the scales (2^-63 .. 2^63: ue8m0 exponents, fp32 powers of two alike) that fold into the codes: the folded values stay normal bf16, and their
// products with any x within 2^+-60 normal fp32 (vdpbf16ps reads and writes subnormals as zero, where the unfolded
// route applies an extreme scale by an IEEE FMA).  Released checkpoints' scales lie far inside.
constexpr uint32_t FOLD_EXP_LO = 127 - 63, FOLD_EXP_HI = 127 + 63;

// MXFP4 codes with bf16 x on AVX512-BF16 CPUs: a scale group (32 codes, 16 bytes) to bf16 by vpermw -- a byte's two
// nibbles are neighbouring weights, the very pair vdpbf16ps multiplies, so no shuffle -- the group's ue8m0 scale
// added to their exponents, then one vdpbf16ps per row of x (else one more FMA per row for the scale).  The fp32
// route spent ~10 instructions and two FMAs per 32 codes and read 5-6 GB/s of MXFP4 weights on the AMX Xeon (25-29 %
// of its copy bandwidth).  Exact as the fp32 route: the values are bf16, their products with bf16 x exact in fp32.
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
void stream_rows_fp4_dpbf16(const QuantProblem& p, int64_t n0, int64_t n1) {
  const __m512i table = _mm512_load_si512(E2M1_TWICE_BF16), nibble = _mm512_set1_epi32(0xF);
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
  const int64_t row_bytes = p.K / 2;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.codes + n * row_bytes;
    const int64_t srow = n * p.kblocks;                 // (bn 1, bk 32: a scale per row and group)
    __m512 total[MR];
    for (int m = 0; m < MR; ++m) total[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < p.kblocks; ++g) {
      if ((g & 3) == 0)                                  // a line of codes (4 groups) PREFETCH_ROWS rows ahead
        _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_ROWS * row_bytes + g * 16), _MM_HINT_T0);
      const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16)));
      const __m512i idx = _mm512_or_si512(_mm512_and_si512(d, nibble), _mm512_slli_epi32(_mm512_srli_epi32(d, 4), 16));
      const __m512i w = _mm512_permutexvar_epi16(idx, table);
      const uint32_t e = p.power_of_two_scale(srow + g);
      if (FOLD_EXP_LO <= e && e <= FOLD_EXP_HI) {
        // the scale folded into the bf16 codes (their exponents raised by e - 128: x2^(e-127), /2); the zero codes
        // keep their zero exponent
        const __m512bh ws = (__m512bh)_mm512_mask_add_epi16(w, _mm512_test_epi16_mask(w, magnitude), w,
                                                            _mm512_set1_epi16(static_cast<int16_t>((int(e) - 128) << 7)));
        for (int m = 0; m < MR; ++m)
          total[m] = _mm512_dpbf16_ps(total[m], ws, (__m512bh)_mm512_loadu_si512(p.xb + m * p.Kx + g * 32));
      } else {                                           // (another scale, or an extreme one: an FMA applies it)
        const __m512 s = _mm512_set1_ps(CODE_UNIT<Codes::FP4> * p.block_scale(srow + g));
        for (int m = 0; m < MR; ++m) {
          const __m512 prod = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w,
                                               (__m512bh)_mm512_loadu_si512(p.xb + m * p.Kx + g * 32));
          total[m] = _mm512_fmadd_ps(prod, s, total[m]);
        }
      }
    }
    for (int m = 0; m < MR; ++m) p.y[m * p.N + n] = _mm512_reduce_add_ps(total[m]) + (p.bias ? p.bias[n] : 0.0f);
  }
}
#endif

template <int MR, Codes F>
void stream_rows(const QuantProblem& p, int64_t n0, int64_t n1) {
#if DSATTN_X86
  if (p.xb) {
    if constexpr (F == Codes::FP8) return stream_rows_dpbf16<MR>(p, n0, n1);
    else return stream_rows_fp4_dpbf16<MR>(p, n0, n1);
  }
  if (dsattn_native::isa_has(dsattn_native::ISA_AVX512)) return stream_rows_avx512<MR, F>(p, n0, n1);
  if (dsattn_native::isa_has(dsattn_native::ISA_AVX2)) return stream_rows_avx2<MR, F>(p, n0, n1);
#endif
  stream_rows_generic<MR, F>(p, n0, n1);
}

template <Codes F>
void stream_rows_of(const QuantProblem& p, int64_t n0, int64_t n1) {
  switch (p.M) {
    case 1: return stream_rows<1, F>(p, n0, n1);
    case 2: return stream_rows<2, F>(p, n0, n1);
    case 3: return stream_rows<3, F>(p, n0, n1);
    case 4: return stream_rows<4, F>(p, n0, n1);
    case 5: return stream_rows<5, F>(p, n0, n1);
    case 6: return stream_rows<6, F>(p, n0, n1);
    case 7: return stream_rows<7, F>(p, n0, n1);
    default: return stream_rows<8, F>(p, n0, n1);
  }
}

constexpr int64_t STREAM_CHUNK_BYTES = 512 << 10;   // codes a chunk of weight rows holds (kept in L2 across x's groups)

// Any M on the streamed path (the batch-invariant mode): x in groups of STREAM_ROWS rows, each group over a chunk of
// weight rows that stays in L2 while every group passes.  A row of x meets each weight row in the same operations in
// the same order whatever its group's size, M or the threads (the threads split N only): its results do not depend
// on the rows beside it.
template <Codes F>
void stream_groups(const QuantProblem& p) {
  const int64_t row_bytes = std::max<int64_t>(1, code_bytes<F>(p.K));
  const int64_t chunk = std::max<int64_t>(16, (STREAM_CHUNK_BYTES / row_bytes) / 16 * 16);
  at::parallel_for(0, (p.N + chunk - 1) / chunk, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * chunk, n1 = std::min(p.N, n0 + chunk);
      for (int64_t m0 = 0; m0 < p.M; m0 += STREAM_ROWS) {
        QuantProblem g = p;
        g.M = std::min(STREAM_ROWS, p.M - m0);
        if (p.x) g.x = p.x + m0 * p.Kx;
        if (p.xb) g.xb = p.xb + m0 * p.Kx;
        g.y = p.y + m0 * p.N;
        stream_rows_of<F>(g, n0, n1);
      }
    }
  });
}

template <Codes F>
void stream(const QuantProblem& p) {
  if (p.M > STREAM_ROWS) return stream_groups<F>(p);
  // grains of 16 rows: a thread's share of a decode call is contiguous weight bytes
  at::parallel_for(0, (p.N + 15) / 16, 1, [&](int64_t g0, int64_t g1) {
    stream_rows_of<F>(p, g0 * 16, std::min(p.N, g1 * 16));
  });
}

// ---- tiled ----

// codes [rows, len] of one block -> their exact values as mm_t, row stride ld (pairs padded with zero).  bf16 by
// table where the CPU has VBMI (fp8.h: 9 instructions per 64 codes), else the fp32 values' high halves (exact:
// every e4m3 value is a bf16 value).
#if DSATTN_X86
// 64-code runs of one row by table; returns how many codes it decoded
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) int64_t fp8_bf16_runs_vbmi(const uint8_t* x, int64_t n, uint16_t* out) {
  const dsattn_native::Fp8Bf16Tables& tables = dsattn_native::fp8_bf16_tables();
  int64_t d = 0;
  for (; d + 64 <= n; d += 64) dsattn_native::fp8x64_bf16_vbmi(x + d, out + d, tables);
  return d;
}
#endif

template <typename mm_t>
void decode_block(const uint8_t* codes, int64_t ldc, int64_t rows, int64_t len, int64_t ld, mm_t* out, float* wide) {
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* src = codes + i * ldc;
    mm_t* dst = out + i * ld;
    int64_t k = 0;
    if constexpr (std::is_same_v<mm_t, float>) {
      dsattn_native::dequant_tile_fp8(src, len, 1.0f, dst);
      k = len;
    } else if constexpr (std::is_same_v<mm_t, c10::BFloat16>) {
      uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
#if DSATTN_X86
      if (dsattn_native::isa_has_avx512vbmi()) k = fp8_bf16_runs_vbmi(src, len, bits);
#endif
      dsattn_native::dequant_tile_fp8(src + k, len - k, 1.0f, wide);
      for (int64_t j = 0; j < len - k; ++j) bits[k + j] = static_cast<uint16_t>(__builtin_bit_cast(uint32_t, wide[j]) >> 16);
      k = len;
    } else {
      dsattn_native::dequant_tile_fp8(src, len, 1.0f, wide);
      for (; k < len; ++k) dst[k] = static_cast<mm_t>(wide[k]);
    }
    for (k = len; k < ld; ++k) dst[k] = mm_t(0);
  }
}

#if DSATTN_X86
// the e2m1 values (bit 3 the sign) as fp32, for vpermps
alignas(64) constexpr float E2M1_FLOAT[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// fp32 lanes -> their bf16 bits rounded to nearest even, in the low (lo) and high (hi) halves of one dword: the pair
// (lo, hi) as two neighbouring bf16.  Exact for value x power-of-two scale; rounds as static_cast otherwise (a NaN
// to the quiet NaN, whatever its payload: adding the rounding bias to some would carry into the sign).
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512i bf16_rne_avx512(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)),
                                     _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}

__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512i bf16_pairs_avx512(__m512 lo, __m512 hi) {
  return _mm512_mask_blend_epi16(0x55555555u, bf16_rne_avx512(hi), _mm512_srli_epi32(bf16_rne_avx512(lo), 16));
}

// groups [g0, g0 + groups) of one row's codes -> value x the group's scale, 32 mm_t (fp32 or bf16) a group: the
// 16 bytes widened to dwords, each nibble looked up by vpermps (it reads an index's low 4 bits: the low nibble as
// it is), scaled, the two nibbles' values interleaved back into element order
template <typename mm_t>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void fp4_groups_avx512(const QuantProblem& p,
                                                                                       const uint8_t* codes, int64_t s0,
                                                                                       int64_t groups, mm_t* out) {
  const __m512 table = _mm512_load_ps(E2M1_FLOAT);
  const __m512i even = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(8));
  for (int64_t g = 0; g < groups; ++g) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * 16)));
    const __m512 s = _mm512_set1_ps(p.block_scale(s0 + g));
    const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(d, table), s);
    const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table), s);
    if constexpr (std::is_same_v<mm_t, float>) {
      _mm512_storeu_ps(out + g * 32, _mm512_permutex2var_ps(lo, even, hi));
      _mm512_storeu_ps(out + g * 32 + 16, _mm512_permutex2var_ps(lo, odd, hi));
    } else {
      _mm512_storeu_si512(out + g * 32, bf16_pairs_avx512(lo, hi));
    }
  }
}

// the same with AVX2, to fp32: 8 bytes at a time, the magnitude looked up (8 entries) and the sign put back
__attribute__((target("avx2,fma"))) void fp4_groups_avx2(const QuantProblem& p, const uint8_t* codes, int64_t s0,
                                                         int64_t groups, float* out) {
  const __m256 table = _mm256_load_ps(E2M1_FLOAT);
  const __m256i seven = _mm256_set1_epi32(7), eight = _mm256_set1_epi32(8);
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s = _mm256_set1_ps(p.block_scale(s0 + g));
    for (int h = 0; h < 2; ++h) {
      const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + g * 16 + h * 8)));
      const __m256i n[2] = {d, _mm256_srli_epi32(d, 4)};
      __m256 v[2];
      for (int j = 0; j < 2; ++j) {
        const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(n[j], eight), 28);
        v[j] = _mm256_mul_ps(_mm256_or_ps(_mm256_permutevar8x32_ps(table, _mm256_and_si256(n[j], seven)),
                                          _mm256_castsi256_ps(sign)), s);
      }
      const __m256 a = _mm256_unpacklo_ps(v[0], v[1]), b = _mm256_unpackhi_ps(v[0], v[1]);
      _mm256_storeu_ps(out + g * 32 + h * 16, _mm256_permute2f128_ps(a, b, 0x20));
      _mm256_storeu_ps(out + g * 32 + h * 16 + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
  }
}
#endif

// e2m1 codes [rows, len] (len a multiple of 32) of K chunk [k0, k0 + len) -> value x its group's scale as mm_t (fp32,
// or bf16 where every scale is a power of two: exact, a value has 2 significant bits), but past fp32's range
template <typename mm_t>   // (float or c10::BFloat16)
void decode_block_fp4(const QuantProblem& p, int64_t n0, int64_t rows, int64_t k0, int64_t len, int64_t ld, mm_t* out,
                      float* wide) {
  const int64_t groups = p.kblocks;
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* row = p.codes + (n0 + i) * code_bytes<Codes::FP4>(p.K);
    const int64_t srow = (n0 + i) * groups;
    mm_t* dst = out + i * ld;
    bool done = false;
#if DSATTN_X86
    if (dsattn_native::isa_has(dsattn_native::ISA_AVX512)) {
      fp4_groups_avx512(p, row + k0 / 2, srow + k0 / 32, len / 32, dst);
      done = true;
    } else if constexpr (std::is_same_v<mm_t, float>) {
      if (dsattn_native::isa_has(dsattn_native::ISA_AVX2)) {
        fp4_groups_avx2(p, row + k0 / 2, srow + k0 / 32, len / 32, dst);
        done = true;
      }
    }
#endif
    if (!done) {
      for (int64_t k = 0; k < len; k += 32) {
        const float s = 0.5f * p.block_scale(srow + (k0 + k) / 32);
        for (int64_t j = k; j < k + 32; ++j) wide[j] = code_value_scaled<Codes::FP4>(row, k0 + j) * s;
      }
      for (int64_t k = 0; k < len; ++k) dst[k] = static_cast<mm_t>(wide[k]);
    }
    for (int64_t k = len; k < ld; ++k) dst[k] = mm_t(0);
  }
}

template <typename scalar_t, typename mm_t, Codes F>
void tiled(const QuantProblem& p, const scalar_t* x) {
  constexpr bool packed = !std::is_same_v<mm_t, float>;
  const int64_t M = p.M, N = p.N, K = p.K;
  const int64_t Kp = packed ? round_up(K, 2) : K, Mp = round_up(M, 16);
  // FP8: a chunk is a block (its scale applied to the chunk's product); FP4: 256 columns (8 groups, scales folded)
  constexpr int64_t FP4_CHUNK = 256;
  const int64_t chunk = F == Codes::FP8 ? p.bk : FP4_CHUNK, chunks = (K + chunk - 1) / chunk;
  const int64_t bkp = packed ? round_up(chunk, 2) : chunk;
  const int64_t panel = dsattn_native::wide_panel<mm_t>();
  Buffer<mm_t> xt(Kp * Mp);
  dsattn_native::pack_query(x, M, K, Mp, Kp, xt.data(), panel);   // x^T: the GEMM's B operand, as a query row's q^T
  // a thread takes TILE_N weight rows: each block of their codes is decoded once and multiplied by every panel of x^T
  at::parallel_for(0, (N + TILE_N - 1) / TILE_N, 1, [&](int64_t c0, int64_t c1) {
    Buffer<mm_t> a(TILE_N * bkp);
    Buffer<float> wide(bkp), prod(TILE_N * std::min(panel, Mp)), sums(TILE_N * Mp);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * TILE_N, rows = std::min(TILE_N, N - n0);
      std::fill(sums.begin(), sums.begin() + rows * Mp, 0.0f);
      for (int64_t b = 0; b < chunks; ++b) {
        const int64_t k0 = b * chunk, len = std::min(chunk, K - k0), kc = packed ? round_up(len, 2) : len;
        if constexpr (F == Codes::FP4) {
          decode_block_fp4(p, n0, rows, k0, len, bkp, a.data(), wide.data());
          for (int64_t t0 = 0; t0 < Mp; t0 += panel) {       // scales folded in: the products add into the sums
            const int64_t w = std::min(panel, Mp - t0);
            if constexpr (packed)
              dsattn_native::gemm(rows, w, kc, bkp, w, Mp, b > 0, a.data(), xt.data() + t0 * Kp + k0 * w,
                                  sums.data() + t0, true);
            else
              dsattn_native::gemm(rows, w, kc, bkp, Mp, Mp, b > 0, a.data(), xt.data() + k0 * Mp + t0,
                                  sums.data() + t0, false);
          }
          continue;
        }
        decode_block(p.codes + n0 * K + k0, K, rows, len, bkp, a.data(), wide.data());
        for (int64_t t0 = 0; t0 < Mp; t0 += panel) {
          const int64_t w = std::min(panel, Mp - t0);
          if constexpr (packed)
            dsattn_native::gemm(rows, w, kc, bkp, w, w, false, a.data(), xt.data() + t0 * Kp + k0 * w, prod.data(), true);
          else
            dsattn_native::gemm(rows, w, kc, bkp, Mp, w, false, a.data(), xt.data() + k0 * Mp + t0, prod.data(), false);
          for (int64_t i = 0; i < rows; ++i) {
            const float s = p.block_scale(((n0 + i) / p.bn) * p.kblocks + b);
            float* si = sums.data() + i * Mp + t0;
            const float* pi = prod.data() + i * w;
            for (int64_t t = 0; t < w; ++t) si[t] += pi[t] * s;
          }
        }
      }
      if (p.bias)
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t t = 0; t < M; ++t) sums[i * Mp + t] += p.bias[n0 + i];
      dsattn_native::transpose32(sums.data(), Mp, rows, M, p.y + n0, N);
    }
    dsattn_native::gemm_release<mm_t>();
  });
}

// whether every fp32 scale times an e2m1 value is exact in bf16: powers of two (subnormal ones too), zero, inf, NaN
bool powers_of_two(const at::Tensor& scale) {
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(scale.data_ptr<float>());
  for (int64_t i = 0, n = scale.numel(); i < n; ++i) {
    const uint32_t e = (bits[i] >> 23) & 0xFF, m = bits[i] & 0x7FFFFF;
    if (m != 0 && e != 255 && (e != 0 || (m & (m - 1)) != 0)) return false;
  }
  return true;
}

}  // namespace

// y = x W^T (+ bias) for W given as codes of ``format`` ("fp8": e4m3fn [N, K]; "fp4": e2m1 pairs [N, K / 2], K a
// multiple of 32, bn 1, bk 32) as uint8, with fp32 or ue8m0 (uint8) scales per (bn x bk) block; x [M, K] bf16 / fp16 / fp32, y [M, N]
// in x's dtype.  The Python ops (dsattn.weights) have checked every argument.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, int64_t bn, int64_t bk,
                        const c10::optional<at::Tensor>& bias, const std::string& format, int64_t stream_rows_max) {
  TORCH_CHECK(format == "fp8" || format == "fp4", "quant_linear: format fp8 or fp4, got ", format);
  const bool fp4 = format == "fp4";
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.scalar_type() == at::kByte &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kByte) && scale.is_contiguous(),
              "quant_linear: x [M, K] contiguous, codes uint8 2-D contiguous, scale fp32 or ue8m0 (uint8) contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.size(1) == (fp4 ? K / 2 : K) && bn > 0 && bk > 0 && bk % 16 == 0 &&
                  (!fp4 || (bn == 1 && bk == 32 && K % 32 == 0)),
              "quant_linear: shapes");
  const int64_t kblocks = (K + bk - 1) / bk;
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == (N + bn - 1) / bn && scale.size(1) == kblocks,
              "quant_linear: scale shape");
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y.to(x.scalar_type());
  at::Tensor b32;
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  if (K == 0) {
    y.zero_();
    if (bias.has_value()) y.add_(b32);
    return y.to(x.scalar_type());
  }
  const bool e8m0 = scale.scalar_type() == at::kByte;
  QuantProblem p{M, N, K, bn, bk, kblocks, nullptr, 0, codes.data_ptr<uint8_t>(),
               e8m0 ? nullptr : scale.data_ptr<float>(), e8m0 ? scale.data_ptr<uint8_t>() : nullptr,
               bias.has_value() ? b32.data_ptr<float>() : nullptr, y.data_ptr<float>()};
  // streamed up to STREAM_ROWS rows (measured on the AMX Xeon, bf16 x, weights past the cache: streamed 8-10 GB/s at
  // 8 rows, tiled 5-6 with AMX, 3 with vdpbf16ps); stream_rows_max >= M streams every row, in groups of STREAM_ROWS
  // (the batch-invariant mode: one summation order for every M)
  const int64_t limit = stream_rows_max < 0 ? STREAM_ROWS : stream_rows_max;
  if (M <= limit) {
    // bf16 x: vdpbf16ps where the CPU has it (FP8: blocks of whole 64-code runs and VBMI; MXFP4: always); otherwise
    // x widened to fp32.  Rows
    // padded with zeros to a multiple of 64 / 16 (the last block's tail)
    const bool bf16_units = x.scalar_type() == at::kBFloat16 && dsattn_native::isa_has(dsattn_native::ISA_AVX512_BF16);
    const bool dpbf16 = bf16_units && (fp4 || (bk % 64 == 0 && dsattn_native::isa_has_avx512vbmi()));
    p.Kx = round_up(K, dpbf16 ? 64 : 16);
    at::Tensor xf = at::zeros({M, p.Kx}, x.options().dtype(dpbf16 ? at::kBFloat16 : at::kFloat));
    xf.narrow(1, 0, K).copy_(x);
    if (dpbf16)
      p.xb = reinterpret_cast<const uint16_t*>(xf.data_ptr());
    else
      p.x = xf.data_ptr<float>();
    fp4 ? stream<Codes::FP4>(p) : stream<Codes::FP8>(p);
  } else {
    // MXFP4 decodes value x scale into the GEMM's operand: in bf16 exact where every scale is a power of two
    // (ue8m0 always; fp32 scales checked), else the operands stay fp32
    const bool fp4_bf16 = fp4 && x.scalar_type() == at::kBFloat16 && (e8m0 || powers_of_two(scale));
    dsattn_native::dispatch_gemm(x.scalar_type(), [&](auto s, auto m) {
      using scalar_t = decltype(s);
      using mm_t = decltype(m);
      const scalar_t* xp = reinterpret_cast<const scalar_t*>(x.data_ptr());
      if (!fp4) return tiled<scalar_t, mm_t, Codes::FP8>(p, xp);
      if constexpr (std::is_same_v<mm_t, c10::BFloat16>)
        if (fp4_bf16) return tiled<scalar_t, mm_t, Codes::FP4>(p, xp);
      tiled<scalar_t, float, Codes::FP4>(p, xp);
    });
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

#else  // !DSATTN_HAVE_BRGEMM

at::Tensor quant_linear(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                        const c10::optional<at::Tensor>&, const std::string&, int64_t) {
  TORCH_CHECK(false, "this torch has no cpublas::brgemm: the compiled quantised linear is not available");
}

#endif
