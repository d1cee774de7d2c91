// FP8 e4m3fn codes -> fp32, exact, on every x86 CPU class: the decode the packed attention rows
// (attention.cpp) and the quantised indexer keys (indexer.cpp) share.  Included inside each
// translation unit.
#pragma once

#include "isa.h"
#if DSATTN_X86
#include <immintrin.h>
#endif

#include <cstdint>
#include <limits>

namespace dsattn_native {

// fp8 e4m3fn bits -> float, exact, in vectorisable integer steps (no table, no denormal input):
// normal codes rebias the exponent by 120, subnormal ones are m x 2^-9, 0x7F / 0xFF are NaN.
inline float fp8_e4m3fn_float(uint8_t x) {
  const uint32_t em = x & 0x7Fu;
  const float normal = __builtin_bit_cast(float, (em << 20) + (120u << 23));
  float v = em >= 8u ? normal : static_cast<float>(em) * 0x1p-9f;
  v = em == 0x7Fu ? std::numeric_limits<float>::quiet_NaN() : v;
  return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, v) | (uint32_t(x & 0x80u) << 24));
}

// out[0, n) = payload x scale in fp32, one tile of n columns.  GCC leaves the conversion's selects
// as branches, so the vector versions are written out: 16 (AVX-512) or 8 (AVX2) codes at a time,
// the same integer steps as fp8_e4m3fn_float.
inline void dequant_tile_fp8_scalar(const uint8_t* __restrict__ x, int64_t n, float scale, float* __restrict__ out) {
  for (int64_t d = 0; d < n; ++d) out[d] = fp8_e4m3fn_float(x[d]) * scale;
}

// 16 fp8 e4m3fn codes -> their exact fp32 values (the steps of fp8_e4m3fn_float, 16 lanes at a time).
#if DSATTN_X86
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m512 fp8x16_float_avx512(const uint8_t* x) {
  const __m512 sub_unit = _mm512_set1_ps(0x1p-9f);
  const __m512i low7 = _mm512_set1_epi32(0x7F), bias = _mm512_set1_epi32(120 << 23), eight = _mm512_set1_epi32(8),
                nan = _mm512_set1_epi32(0x7FC00000), sign = _mm512_set1_epi32(0x80);
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  const __m512i em = _mm512_and_si512(b, low7);
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(em, 20), bias);
  const __m512i sub = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(em), sub_unit));
  __m512i bits = _mm512_mask_blend_epi32(_mm512_cmpge_epu32_mask(em, eight), sub, normal);
  bits = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(em, low7), bits, nan);
  return _mm512_castsi512_ps(_mm512_or_si512(bits, _mm512_slli_epi32(_mm512_and_si512(b, sign), 24)));
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
inline void dequant_tile_fp8_avx512(const uint8_t* __restrict__ x, int64_t n, float scale, float* __restrict__ out) {
  const __m512 vs = _mm512_set1_ps(scale);
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) _mm512_storeu_ps(out + d, _mm512_mul_ps(fp8x16_float_avx512(x + d), vs));
  dequant_tile_fp8_scalar(x + d, n - d, scale, out + d);
}

__attribute__((target("avx2")))
inline void dequant_tile_fp8_avx2(const uint8_t* __restrict__ x, int64_t n, float scale, float* __restrict__ out) {
  const __m256 vs = _mm256_set1_ps(scale), sub_unit = _mm256_set1_ps(0x1p-9f);
  const __m256i low7 = _mm256_set1_epi32(0x7F), bias = _mm256_set1_epi32(120 << 23), seven = _mm256_set1_epi32(7),
                nan = _mm256_set1_epi32(0x7FC00000), sign = _mm256_set1_epi32(0x80);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + d)));
    const __m256i em = _mm256_and_si256(b, low7);
    const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(em, 20), bias);
    const __m256i sub = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(em), sub_unit));
    __m256i bits = _mm256_blendv_epi8(sub, normal, _mm256_cmpgt_epi32(em, seven));
    bits = _mm256_blendv_epi8(bits, nan, _mm256_cmpeq_epi32(em, low7));
    bits = _mm256_or_si256(bits, _mm256_slli_epi32(_mm256_and_si256(b, sign), 24));
    _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_castsi256_ps(bits), vs));
  }
  dequant_tile_fp8_scalar(x + d, n - d, scale, out + d);
}
#endif

// 64 fp8 e4m3fn codes -> their exact bf16 values by table (AVX-512 VBMI: Zen 4 and Ice Lake on): the two
// bytes of each magnitude's bf16 are looked up in 128-entry byte tables (one vpermi2b each), the sign is
// or-ed into the high byte and the bytes are interleaved into words: 9 instructions per 64 codes, where
// an arithmetic decode takes 26 (a subnormal lookup and a NaN blend).
struct Fp8Bf16Tables {
  alignas(64) uint8_t lo[128], hi[128];
  alignas(64) uint8_t order[2][64];                  // word i = (lo byte i, hi byte i): indices i, 64 + i
  Fp8Bf16Tables() {
    for (int em = 0; em < 128; ++em) {
      const uint32_t bits = __builtin_bit_cast(uint32_t, fp8_e4m3fn_float(static_cast<uint8_t>(em))) >> 16;
      lo[em] = static_cast<uint8_t>(bits & 0xFF), hi[em] = static_cast<uint8_t>(bits >> 8);
    }
    for (int half = 0; half < 2; ++half)
      for (int i = 0; i < 32; ++i)
        order[half][2 * i] = static_cast<uint8_t>(32 * half + i), order[half][2 * i + 1] = static_cast<uint8_t>(64 + 32 * half + i);
  }
};

inline const Fp8Bf16Tables& fp8_bf16_tables() {
  static const Fp8Bf16Tables tables;
  return tables;
}

#if DSATTN_X86
// (the tables are read as memory operands: a caller with its registers taken, a GEMM tile, keeps them)
// (the 64 values in two registers, codes 0-31 and 32-63, in order)
__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) inline void fp8x64_bf16_vbmi_regs(
    const uint8_t* x, const Fp8Bf16Tables& t, __m512i& first, __m512i& second) {
  // (vpermi2b reads an index's low 7 bits only: the sign bit of a code needs no masking off)
  const __m512i b = _mm512_loadu_si512(x);
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t.lo), b, _mm512_load_si512(t.lo + 64));
  const __m512i hi = _mm512_or_si512(_mm512_permutex2var_epi8(_mm512_load_si512(t.hi), b, _mm512_load_si512(t.hi + 64)),
                                     _mm512_and_si512(b, _mm512_set1_epi8(static_cast<char>(0x80))));
  first = _mm512_permutex2var_epi8(lo, _mm512_load_si512(t.order[0]), hi);
  second = _mm512_permutex2var_epi8(lo, _mm512_load_si512(t.order[1]), hi);
}

__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) inline void fp8x64_bf16_vbmi(
    const uint8_t* x, uint16_t* out, const Fp8Bf16Tables& t) {
  __m512i first, second;
  fp8x64_bf16_vbmi_regs(x, t, first, second);
  _mm512_storeu_si512(out, first);
  _mm512_storeu_si512(out + 32, second);
}
#endif

// e4m3fn codes -> their values x 2^-8, for a streamed product that scales its sums per block anyway: a
// code's bits shifted left by 7 are the fp16 bits of that value (the 4-bit exponent lands in fp16's 5-bit field
// with a bias 8 short, the subnormals land on fp16 subnormals, both exact), and F16C widens fp16 to fp32 in
// one instruction: 6 instructions per 16 codes where the exact decode above takes 10.  0x7F / 0xFF stay NaN.
inline float fp8_e4m3fn_float_div256(uint8_t x) { return fp8_e4m3fn_float(x) * 0x1p-8f; }

#if DSATTN_X86
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"), always_inline)) inline __m512 fp8x16_div256_avx512(const uint8_t* x) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7F));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7), _mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16(-0x8000)));
  h = _mm256_mask_mov_epi16(h, _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7E00));
  return _mm512_cvtph_ps(h);
}

// 16 codes as two 8-lane halves (AVX2 + F16C)
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void fp8x16_div256_avx2(const uint8_t* x, __m256& lo, __m256& hi) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7F));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7), _mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16(-0x8000)));
  h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7E00), _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7F)));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
#endif

using DequantFp8 = void (*)(const uint8_t*, int64_t, float, float*);

// AVX-512 F + BW + VL: what the AVX-512 decoders above are compiled for (the avx512 class and up)
inline bool cpu_has_avx512bw() { return isa_has(ISA_AVX512); }

// chosen once per process, from what the CPU runs
inline DequantFp8 dequant_tile_fp8_best() {
#if DSATTN_X86
  if (cpu_has_avx512bw()) return dequant_tile_fp8_avx512;
  if (isa_has(ISA_AVX2)) return dequant_tile_fp8_avx2;
#endif
  return dequant_tile_fp8_scalar;
}

inline void dequant_tile_fp8(const uint8_t* x, int64_t n, float scale, float* out) {
  static const DequantFp8 best = dequant_tile_fp8_best();
  best(x, n, scale, out);
}

}  // namespace dsattn_native
