// Fused sparse attention forward on the CPU (issue 15): for every query row, its keys (window
// keys, then compressed keys; K = V) are gathered, S = scale * q k^T is formed in fp32, the
// softmax with the sink is taken against the row's maximum, P is rounded to the query dtype and
// O = P V accumulates in fp32, then O / l and lse = m + log(l).  These are the rounding points of
// the golden (dsattn/sparse_mla/ref.py): no online rescaling, so results differ from it only by
// summation order.
//
// The GEMMs go through dsattn_native::gemm (gemm.h): ATen's batch-reduce ukernel where the CPU
// multiplies 16-bit operands natively (AMX), our vdpbf16ps micro-kernel (or oneDNN's, where faster)
// for bf16 on AVX512-BF16 without AMX; on each the half-precision rows are multiplied as they are
// with fp32 accumulation.
// Elsewhere (AVX2, AVX512F) the rows are widened to fp32 as they are gathered and dsattn's fp32 GEMM runs.  Products of
// half-precision values are exact in fp32 either way, so both paths have the golden's numerics.
//
// Layout of the work for one row (H heads padded to Hp, a multiple of 16; D padded to Dp):
//   keys  [npad, Dp]  gathered rows, zero past the row's n keys and past D (with packed operands
//                     they stream through a ring of RING rows, packed into V as they pass)
//   S^T   [npad, Hp]  = keys x q^T   (A = the gathered keys as they are, B = q^T packed once per row)
//   P     [Hp, npad]  exp(S - m) rounded to the query dtype, written transposed for the next GEMM
//   O     [Hp, Dp]    = P x V        (B = V packed in panels: one PANEL wide for AMX, 64-column strips else)
// Every buffer is cache-line aligned (dsattn_native::Buffer): the ukernel ran at half rate without.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include "attention.h"
#include "common.h"
#include "fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if DSATTN_HAVE_BRGEMM

namespace {

using dsattn_native::gemm;
using dsattn_native::gemm_release;

constexpr int64_t KEY_ALIGN = 64;  // the key count is padded to a multiple of this
constexpr int64_t RING = 128;      // keys per chunk of the forward's gather + S^T (a multiple of KEY_ALIGN)
constexpr int64_t DK_CHUNK = 128;  // keys per dK GEMM in the backward (a multiple of KEY_ALIGN)
using dsattn_native::Buffer;
using dsattn_native::PANEL;
using dsattn_native::round_up;

// exp(x) for x <= 0 (a score minus its row maximum), NaN propagated; Cephes' single-precision
// range reduction and polynomial (about 1 ulp, like torch.exp).  Written so that the loops below
// vectorise (no calls, no branches), compiled per ISA class by DSATTN_PER_ISA (isa.h).
inline float exp_nonpositive(float x) {
  // lo = -87.33654f (bits 0xC2AEAC4F): below it exp(x) < FLT_MIN, returned as 0.  x < lo is decided on the bits,
  // as a mask: x's bits lie in (lo's, -inf's] exactly where lo > x >= -inf (NaNs lie above, and propagate).  A
  // float comparison may trap, and GCC if-converts a select on one only with AVX-512's masks: the AVX2 and
  // baseline builds of every loop over this function stayed scalar (3.6 ns an exp on the Xeon's AVX2 build,
  // 0.69 with the mask; the same bits for every input).
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  const uint32_t below = 0u - static_cast<uint32_t>(u - 0xC2AEAC50u <= 0xFF800000u - 0xC2AEAC50u);
  const float xc = __builtin_bit_cast(float, (u & ~below) | (0xC2AEAC4Fu & below));
  // k = nearest integer to x / ln 2, by the 1.5 * 2^23 shifter (floorf would not vectorise
  // under -ftrapping-math)
  const float shifter = 12582912.0f;
  const float k = (xc * 1.44269504088896341f + shifter) - shifter;
  float r = xc - k * 0.693359375f;
  r = r + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  const float two_k = __builtin_bit_cast(float, bits);
  const float e = p * two_k;
  return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, e) & ~below);
}

// s[j, h] *= scale and m[h] = max(m[h], s[j, h]) over rows j < n (NaN propagates into m).
DSATTN_VECTOR_BODY void scale_and_max_body(float* __restrict__ s, int64_t n, int64_t Hp, float scale, float* __restrict__ m) {
  for (int64_t j = 0; j < n; ++j) {
    float* __restrict__ row = s + j * Hp;
    for (int64_t h = 0; h < Hp; ++h) {
      const float v = row[h] * scale;
      row[h] = v;
      m[h] = (v > m[h] || v != v) ? v : m[h];
    }
  }
}
DSATTN_PER_ISA(scale_and_max, (float* __restrict__ s, int64_t n, int64_t Hp, float scale, float* __restrict__ m), (s, n, Hp, scale, m))

// s[j, h] = exp(s[j, h] - m[h]) and l[h] += s[j, h] over rows j < n.
DSATTN_VECTOR_BODY void exp_and_sum_body(float* __restrict__ s, int64_t n, int64_t Hp, const float* __restrict__ m, float* __restrict__ l) {
  for (int64_t j = 0; j < n; ++j) {
    float* __restrict__ row = s + j * Hp;
    for (int64_t h = 0; h < Hp; ++h) {
      const float e = exp_nonpositive(row[h] - m[h]);
      row[h] = e;
      l[h] += e;
    }
  }
}
DSATTN_PER_ISA(exp_and_sum, (float* __restrict__ s, int64_t n, int64_t Hp, const float* __restrict__ m, float* __restrict__ l), (s, n, Hp, m, l))

inline uint16_t bf16_bits(float x) {              // round to nearest even, as c10::BFloat16
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return x != x ? uint16_t(0x7FC0) : static_cast<uint16_t>(r);
}

inline float bf16_float(uint16_t bits) { return __builtin_bit_cast(float, uint32_t(bits) << 16); }   // exact

// m[h] = max(m[h], s[j, h]) over rows j < n (NaN propagates into m); s is only read.
DSATTN_VECTOR_BODY void column_max_body(const float* __restrict__ s, int64_t n, int64_t Hp, float* __restrict__ m) {
  for (int64_t j = 0; j < n; ++j) {
    const float* __restrict__ row = s + j * Hp;
    for (int64_t h = 0; h < Hp; ++h) m[h] = (row[h] > m[h] || row[h] != row[h]) ? row[h] : m[h];
  }
}
DSATTN_PER_ISA(column_max, (const float* __restrict__ s, int64_t n, int64_t Hp, float* __restrict__ m), (s, n, Hp, m))

// The softmax's numerators for bf16 queries in one pass over S^T [n, Hp] (raw scores, not yet
// scaled): e = exp(scale s - m[h]) (the scaled score rounded to fp32 first, as the golden forms
// S), l[h] += e in key order, and P [Hp, npad] = bf16(e) written key-major through a 16 x 16 tile
// in L1 (each P row then gets 16 keys per store); P = 0 for the padded keys j >= n.
DSATTN_VECTOR_BODY void softmax_numerators_bf16_body(const float* __restrict__ s, int64_t n, int64_t npad, int64_t Hp, float scale,
                             const float* __restrict__ m, float* __restrict__ l, uint16_t* __restrict__ p) {
  constexpr int64_t T = 16;
  alignas(64) float e[T * T], tile[T * T];
  const int64_t n16 = n / T * T;
  for (int64_t j0 = 0; j0 < n16; j0 += T)
    for (int64_t h0 = 0; h0 < Hp; h0 += T) {
      for (int64_t j = 0; j < T; ++j)
        for (int64_t h = 0; h < T; ++h) {
          const float x = exp_nonpositive(s[(j0 + j) * Hp + h0 + h] * scale - m[h0 + h]);
          e[j * T + h] = x;
          l[h0 + h] += x;
        }
      dsattn_native::transpose32(e, T, T, T, tile, T);   // tile[h, j]
      for (int64_t h = 0; h < T; ++h)
        for (int64_t j = 0; j < T; ++j) p[(h0 + h) * npad + j0 + j] = bf16_bits(tile[h * T + j]);
    }
  for (int64_t j = n16; j < n; ++j)
    for (int64_t h = 0; h < Hp; ++h) {
      const float x = exp_nonpositive(s[j * Hp + h] * scale - m[h]);
      l[h] += x;
      p[h * npad + j] = bf16_bits(x);
    }
  for (int64_t h = 0; h < Hp; ++h) std::fill(p + h * npad + n, p + (h + 1) * npad, uint16_t(0));
}
DSATTN_PER_ISA(softmax_numerators_bf16, (const float* __restrict__ s, int64_t n, int64_t npad, int64_t Hp, float scale, const float* __restrict__ m, float* __restrict__ l, uint16_t* __restrict__ p), (s, n, npad, Hp, scale, m, l, p))

// [Hp, npad] from e = [n, Hp]: p[h, j] = bf16(e[j, h]), 0 for the padded keys j >= n (the backward's dS^T).
// Transposed 16 x 16 at a time through a tile in L1 (each P row then gets 16 keys per store).
DSATTN_VECTOR_BODY void p_from_scores_bf16_body(const float* __restrict__ e, int64_t n, int64_t npad, int64_t Hp, uint16_t* __restrict__ p) {
  constexpr int64_t T = 16;
  alignas(64) float tile[T * T];
  const int64_t n16 = n / T * T;
  for (int64_t j0 = 0; j0 < n16; j0 += T)
    for (int64_t h0 = 0; h0 < Hp; h0 += T) {
      dsattn_native::transpose32(e + j0 * Hp + h0, Hp, T, T, tile, T);   // tile[h, j]
      for (int64_t h = 0; h < T; ++h)
        for (int64_t j = 0; j < T; ++j) p[(h0 + h) * npad + j0 + j] = bf16_bits(tile[h * T + j]);
    }
  for (int64_t h = 0; h < Hp; ++h) {
    for (int64_t j = n16; j < n; ++j) p[h * npad + j] = bf16_bits(e[j * Hp + h]);
    std::fill(p + h * npad + n, p + (h + 1) * npad, uint16_t(0));
  }
}
DSATTN_PER_ISA(p_from_scores_bf16, (const float* __restrict__ e, int64_t n, int64_t npad, int64_t Hp, uint16_t* __restrict__ p), (e, n, npad, Hp, p))

// The same in fp32 (the fp32 GEMM path); round_bf16: P rounded to bf16 first (bf16 queries).
DSATTN_VECTOR_BODY void p_from_scores_f32_body(const float* __restrict__ e, int64_t n, int64_t npad, int64_t Hp, float* __restrict__ p,
                       bool round_bf16) {
  dsattn_native::transpose32(e, Hp, n, Hp, p, npad);
  for (int64_t h = 0; h < Hp; ++h) {
    float* __restrict__ row = p + h * npad;
    if (round_bf16)
      for (int64_t j = 0; j < n; ++j) row[j] = bf16_float(bf16_bits(row[j]));
    std::fill(row + n, row + npad, 0.0f);
  }
}
DSATTN_PER_ISA(p_from_scores_f32, (const float* __restrict__ e, int64_t n, int64_t npad, int64_t Hp, float* __restrict__ p, bool round_bf16), (e, n, npad, Hp, p, round_bf16))

// The ukernel's packed B layout for 16-bit operands is [K/2][w][2] per panel of w columns (what
// cpublas::pack writes; the tests compare): key rows 2i and 2i+1 interleaved element by element.
// This writes pair i of rows (a, b) into every ``panel``-column panel of V [npad, Dp] (panel d0
// starts at d0 * npad; dsattn_native::wide_panel says how wide).
DSATTN_VECTOR_BODY void pack_pair_body(const uint16_t* __restrict__ a, const uint16_t* __restrict__ b, int64_t Dp, int64_t npad, int64_t i,
               uint16_t* __restrict__ v, int64_t panel) {
  for (int64_t d0 = 0; d0 < Dp; d0 += panel) {
    const int64_t w = std::min(panel, Dp - d0);
    uint16_t* __restrict__ o = v + d0 * npad + 2 * i * w;
    for (int64_t c = 0; c < w; ++c) {
      o[2 * c] = a[d0 + c];
      o[2 * c + 1] = b[d0 + c];
    }
  }
}
DSATTN_PER_ISA(pack_pair, (const uint16_t* __restrict__ a, const uint16_t* __restrict__ b, int64_t Dp, int64_t npad, int64_t i, uint16_t* __restrict__ v, int64_t panel), (a, b, Dp, npad, i, v, panel))

// A whole row-major [K, N] 16-bit matrix (K even) in the same layout, pair of rows by pair.
void pack_matrix(const uint16_t* rows, int64_t K, int64_t N, uint16_t* out, int64_t panel) {
  for (int64_t i = 0; i < K / 2; ++i) pack_pair(rows + 2 * i * N, rows + (2 * i + 1) * N, N, K, i, out, panel);
}

// ---- packed key rows, decoded as they are gathered ----
//
// A packed source holds per token N quantised columns (int8 or fp8 e4m3fn) in tiles of ``tile``
// with one scale per tile (fp32, or ue8m0: 2^(b - 127)), then R rope columns as 16-bit floats
// (bf16 or fp16).  Where the parts lie is the format's: dsattn's packed rows [payload | rope |
// fp32 scales], FlashMLA's V3.2 rows [payload | fp32 scales | rope] and its V4 blocks (block_size
// bodies [payload | rope], then their ue8m0 scales).  A row is dequantised in fp32 (payload x
// scale) and rounded once to the query dtype, as the golden (dequant_kv_rows) does.
struct PackedFormat {
  const uint8_t* base;
  int64_t tokens, N, R, tile;
  bool fp8, ue8m0, rope_fp16;
  // token t: body at base + (t / bs) * block_stride + (t % bs) * body_stride, its payload at
  // + payload_off, its rope at + rope_off; its scales at base + (t / bs) * block_stride +
  // scale_region + (t % bs) * scale_stride
  int64_t bs, block_stride, body_stride, payload_off, rope_off, scale_region, scale_stride;

  static constexpr int64_t FIELDS = 14;

  // from the entry point's int64 description (dsattn/sparse_mla/rows.py writes it)
  static PackedFormat from(const std::vector<int64_t>& f, const uint8_t* base) {
    return PackedFormat{base, f[0], f[1], f[2], f[3], f[4] != 0, f[5] != 0, f[6] != 0,
                        f[7], f[8], f[9], f[10], f[11], f[12], f[13]};
  }
  // the furthest byte a token's fields reach + 1 (tokens lie in increasing order of address)
  int64_t end_of(int64_t t) const {
    const int64_t blk = (t / bs) * block_stride, in = t % bs;
    const int64_t body = blk + in * body_stride;
    return std::max({body + payload_off + N, body + rope_off + 2 * R,
                     blk + scale_region + in * scale_stride + (N / tile) * (ue8m0 ? 1 : 4)});
  }
};

// One key of a row: a plain row of the query dtype (fmt null) or a packed token's fields.
struct KeyRef {
  const uint8_t* payload;   // plain: the row itself
  const uint8_t* rope;
  const uint8_t* scales;
  const PackedFormat* fmt;
};

inline KeyRef packed_key(const PackedFormat& f, int64_t t) {
  const int64_t blk = (t / f.bs) * f.block_stride, in = t % f.bs;
  const uint8_t* body = f.base + blk + in * f.body_stride;
  return KeyRef{body + f.payload_off, body + f.rope_off, f.base + blk + f.scale_region + in * f.scale_stride, &f};
}

using dsattn_native::cpu_has_avx512bw;
using dsattn_native::dequant_tile_fp8;
using dsattn_native::fp8_e4m3fn_float;
using DequantFp8 = dsattn_native::DequantFp8;
using dsattn_native::dequant_tile_fp8_scalar;
#if DSATTN_X86
using dsattn_native::fp8x16_float_avx512;
using dsattn_native::dequant_tile_fp8_avx2;
using dsattn_native::dequant_tile_fp8_avx512;

// The same decode and scale with the product rounded to bf16 (round to nearest even, NaN to 0x7FC0,
// as bf16_bits) in registers: the gather of a bf16 query's fp8 keys writes the ring row at once,
// with no fp32 staging row and no second pass; the bits are those of dequant_tile_fp8 followed by
// round_to_bf16 (the same fp32 product, the same rounding; test hook fp8_decode_matches).
__attribute__((target("avx512f,avx512bw,avx512vl")))
void dequant_tile_fp8_bf16_avx512(const uint8_t* __restrict__ x, int64_t n, float scale, uint16_t* __restrict__ out) {
  const __m512 vs = _mm512_set1_ps(scale);
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF), bf16_nan = _mm512_set1_epi32(0x7FC0);
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const __m512 v = _mm512_mul_ps(fp8x16_float_avx512(x + d), vs);
    const __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, half), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, bf16_nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), _mm512_cvtepi32_epi16(r));
  }
  for (; d < n; ++d) out[d] = bf16_bits(fp8_e4m3fn_float(x[d]) * scale);
}
#endif

DSATTN_VECTOR_BODY void dequant_tile_int8_body(const int8_t* __restrict__ x, int64_t n, float scale, float* __restrict__ out) {
  for (int64_t d = 0; d < n; ++d) out[d] = static_cast<float>(x[d]) * scale;
}
DSATTN_PER_ISA(dequant_tile_int8, (const int8_t* __restrict__ x, int64_t n, float scale, float* __restrict__ out), (x, n, scale, out))

DSATTN_VECTOR_BODY void round_to_bf16_body(const float* __restrict__ x, int64_t n, uint16_t* __restrict__ out) {
  for (int64_t d = 0; d < n; ++d) out[d] = bf16_bits(x[d]);
}
DSATTN_PER_ISA(round_to_bf16, (const float* __restrict__ x, int64_t n, uint16_t* __restrict__ out), (x, n, out))

inline float tile_scale(const KeyRef& k, int64_t t) {
  if (k.fmt->ue8m0) {
    const uint32_t b = k.scales[t];
    if (b == 0xFFu) return std::numeric_limits<float>::quiet_NaN();
    return b == 0 ? 0x1p-127f : __builtin_bit_cast(float, b << 23);
  }
  float s;
  std::memcpy(&s, k.scales + 4 * t, sizeof s);
  return s;
}

// The packed token's nope columns as fp32 (payload x tile scale) into vals [N].
inline void dequant_nope(const KeyRef& k, float* vals) {
  const PackedFormat& f = *k.fmt;
  for (int64_t t = 0; t < f.N / f.tile; ++t) {
    const float s = tile_scale(k, t);
    if (f.fp8)
      dequant_tile_fp8(k.payload + t * f.tile, f.tile, s, vals + t * f.tile);
    else
      dequant_tile_int8(reinterpret_cast<const int8_t*>(k.payload) + t * f.tile, f.tile, s, vals + t * f.tile);
  }
}

// the decode of every fp8 code against c10's conversion (NaN codes both NaN), by each version this
// CPU can run (scalar, AVX2, AVX-512)
bool fp8_codes_match() {
  uint8_t codes[256];
  for (int c = 0; c < 256; ++c) codes[c] = static_cast<uint8_t>(c);
  std::vector<DequantFp8> versions{dequant_tile_fp8_scalar};
#if DSATTN_X86
  if (dsattn_native::isa_has(dsattn_native::ISA_AVX2)) versions.push_back(dequant_tile_fp8_avx2);
  if (cpu_has_avx512bw()) versions.push_back(dequant_tile_fp8_avx512);
#endif
  for (const DequantFp8 version : versions) {
    float got[256];
    version(codes, 256, 1.0f, got);
    for (int c = 0; c < 256; ++c) {
      const float want = static_cast<float>(c10::Float8_e4m3fn(codes[c], c10::Float8_e4m3fn::from_bits()));
      if (!(got[c] == want || (got[c] != got[c] && want != want)) || std::signbit(got[c]) != std::signbit(want))
        return false;
    }
  }
  // the fused bf16 decode: the bits of the two-pass one, for every code at scales whose products are
  // normal, subnormal (ue8m0 2^-127), rounded up and NaN
#if DSATTN_X86
  if (cpu_has_avx512bw()) {
    const float scales[] = {1.0f, 0.0123f, 0x1p-127f, 3.0f / 7.0f, 448.0f, std::numeric_limits<float>::quiet_NaN()};
    for (const float scale : scales) {
      float wide[256];
      uint16_t two_pass[256], fused[256 + 5];
      dequant_tile_fp8(codes, 256, scale, wide);
      round_to_bf16(wide, 256, two_pass);
      dequant_tile_fp8_bf16_avx512(codes, 256, scale, fused);
      dequant_tile_fp8_bf16_avx512(codes + 3, 5, scale, fused + 256);      // (the scalar tail)
      if (std::memcmp(two_pass, fused, sizeof two_pass) != 0 || std::memcmp(two_pass + 3, fused + 256, 10) != 0)
        return false;
    }
  }
#endif
  return true;
}

// out[h, :] = o[h, :D] * inv[h], rounded to bf16 / kept in fp32.
DSATTN_VECTOR_BODY void normalize_bf16_body(const float* __restrict__ o, int64_t ldo, const float* __restrict__ inv, int64_t H, int64_t D,
                    uint16_t* __restrict__ out) {
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = bf16_bits(o[h * ldo + d] * inv[h]);
}
DSATTN_PER_ISA(normalize_bf16, (const float* __restrict__ o, int64_t ldo, const float* __restrict__ inv, int64_t H, int64_t D, uint16_t* __restrict__ out), (o, ldo, inv, H, D, out))

DSATTN_VECTOR_BODY void normalize_f32_body(const float* __restrict__ o, int64_t ldo, const float* __restrict__ inv, int64_t H, int64_t D,
                   float* __restrict__ out) {
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = o[h * ldo + d] * inv[h];
}
DSATTN_PER_ISA(normalize_f32, (const float* __restrict__ o, int64_t ldo, const float* __restrict__ inv, int64_t H, int64_t D, float* __restrict__ out), (o, ldo, inv, H, D, out))

// The work of one query row.  scalar_t: the query / cache dtype; mm_t: the GEMM operand type (the
// query dtype where the CPU multiplies it natively, packed; else fp32).
template <typename scalar_t, typename mm_t>
struct RowAttention {
  static constexpr bool packed = !std::is_same_v<mm_t, float>;
  int64_t H, D, Hp, Dp;
  float scale;
  const float* sinks;  // [H] or null
  bool sink_in_lse = true;  // false: lse = m + log(l) without the sink (FlashMLA's convention)

  int64_t vpanel = dsattn_native::wide_panel<mm_t>();   // V's panel width (packed operands)
  bool fp8_to_bf16_in_registers = cpu_has_avx512bw();   // (AVX-512 BW: the fused fp8 -> bf16 decode)
  // whether the GEMMs prefetch the next keys (only dsattn's micro-kernel reads a LinePrefetch list)
  bool gemm_prefetches = packed && dsattn_native::gemm_kind(c10::CppTypeToScalarType<mm_t>::value) ==
                                       dsattn_native::KIND_AVX512BF16;
  mm_t *keys, *ring, *q_b, *v_packed, *p;           // per-thread buffers (Workspace)
  float *s, *o, *m, *l, *inv, *vals;
  const char** lines;

  // Buffers that live as long as the thread: grown when a call needs more, never cleared (every
  // element a row reads is written first).
  struct Workspace {
    Buffer<mm_t> keys, ring, q_b, v_packed, p;
    Buffer<float> s, o, m, l, inv, vals;
    Buffer<const char*> lines;
  };

  template <typename T>
  static T* sized(Buffer<T>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
  }

  // whole_keys: room for all of a row's keys at once (the backward; the forward's packed path
  // streams them through the ring)
  void reserve(int64_t npad_max, bool whole_keys) {
    static thread_local Workspace ws;
    keys = whole_keys ? sized(ws.keys, npad_max * Dp) : nullptr;
    ring = packed ? sized(ws.ring, RING * Dp) : nullptr;
    q_b = sized(ws.q_b, Dp * Hp);
    v_packed = packed ? sized(ws.v_packed, npad_max * Dp) : nullptr;
    p = sized(ws.p, Hp * npad_max);
    s = sized(ws.s, npad_max * Hp);
    o = sized(ws.o, Hp * Dp);
    m = sized(ws.m, Hp);
    l = sized(ws.l, Hp);
    inv = sized(ws.inv, Hp);
    vals = sized(ws.vals, Dp);
    lines = gemm_prefetches ? sized(ws.lines, RING * lines_per_key(Dp)) : nullptr;
  }

  // The most cache lines key_lines lists for one key: a plain row's, or a packed token's payload,
  // rope and scales (each part possibly straddling one more line).
  static constexpr int64_t lines_per_key(int64_t Dp) { return (Dp * int64_t(sizeof(scalar_t)) + 63) / 64 + 6; }

  static const char** span_lines(const void* p, int64_t bytes, const char** at) {
    const char* c = static_cast<const char*>(p);
    for (int64_t b = 0; b < bytes; b += 64) *at++ = c + b;
    if (bytes > 0 && (reinterpret_cast<uintptr_t>(c) & 63) != 0) *at++ = c + bytes - 1;
    return at;
  }
  const char** key_lines(const scalar_t* row, const char** at) const { return span_lines(row, D * sizeof(scalar_t), at); }
  const char** key_lines(const KeyRef& k, const char** at) const {
    if (k.fmt == nullptr) return key_lines(reinterpret_cast<const scalar_t*>(k.payload), at);
    at = span_lines(k.payload, k.fmt->N, at);
    at = span_lines(k.rope, 2 * k.fmt->R, at);
    *at++ = reinterpret_cast<const char*>(k.scales);
    return at;
  }

  // the cache lines of the row's keys [i0, i1) (those it has), for a GEMM to prefetch as it runs
  template <typename Key>
  dsattn_native::LinePrefetch key_lines(const std::vector<Key>& rows, int64_t i0, int64_t i1) const {
    const char** at = lines;
    for (int64_t i = i0; i < std::min<int64_t>(i1, rows.size()); ++i) at = key_lines(rows[i], at);
    return dsattn_native::LinePrefetch{lines, at};
  }

  static inline mm_t as_operand(scalar_t x) { return static_cast<mm_t>(static_cast<float>(x)); }

  void load_query(const scalar_t* q) { dsattn_native::pack_query<scalar_t, mm_t>(q, H, D, Hp, Dp, q_b); }

  // Key slots [i0, i1) of the row's npad (the key rows, then zero rows: their P is zero too, but
  // 0 * NaN would not be) into dst [i1 - i0, Dp]; for the ukernel also V packed, pair by pair
  // while the rows are in L1 (i0 even).  The rows are scattered over the cache, so the copy would
  // wait on memory row after row: rows AHEAD places ahead are prefetched, into L2 (prefetcht1),
  // one line in four (the adjacent-line and stream prefetchers fetch the rest).  A decode row
  // stalls at the prefetches, the core's outstanding misses all in use; so fewer, earlier ones
  // help: 640 random 1 KB rows of a 4 GB cache took 150 us with every line prefetched 8 rows
  // ahead into L1, 135 us into L2 16 rows ahead, 108-112 us one line in four (one core); rows
  // of an L2- or L3-sized cache were as fast or faster.
  static constexpr int64_t PREFETCH_STRIDE = 256;

  void prefetch(const scalar_t* row) const {
    const int64_t bytes = D * static_cast<int64_t>(sizeof(scalar_t));
    for (int64_t b = 0; b < bytes; b += PREFETCH_STRIDE) __builtin_prefetch(reinterpret_cast<const char*>(row) + b, 0, 2);
  }

  void prefetch(const KeyRef& k) const {
    if (k.fmt == nullptr) return prefetch(reinterpret_cast<const scalar_t*>(k.payload));
    for (int64_t b = 0; b < k.fmt->N; b += PREFETCH_STRIDE) __builtin_prefetch(k.payload + b, 0, 2);
    __builtin_prefetch(k.rope, 0, 2);
    __builtin_prefetch(k.scales, 0, 2);
  }

  // a row of the query dtype into ``to`` [Dp] as GEMM operands, zero past D
  void copy_row(const scalar_t* src, mm_t* to) {
    if constexpr (std::is_same_v<scalar_t, mm_t>) {
      std::memcpy(to, src, D * sizeof(scalar_t));
    } else {
      for (int64_t d = 0; d < D; ++d) to[d] = as_operand(src[d]);
    }
    std::fill(to + D, to + Dp, mm_t(0));
  }

  // a packed token decoded into ``to``: nope = payload x scale in fp32 rounded once to the query
  // dtype, rope widened from its 16 bits to the query dtype
  void copy_row(const KeyRef& k, mm_t* to) {
    if (k.fmt == nullptr) return copy_row(reinterpret_cast<const scalar_t*>(k.payload), to);
    const PackedFormat& f = *k.fmt;
    if constexpr (std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<mm_t, at::BFloat16>) {
#if DSATTN_X86
      if (f.fp8 && fp8_to_bf16_in_registers) {
        for (int64_t t = 0; t < f.N / f.tile; ++t)
          dequant_tile_fp8_bf16_avx512(k.payload + t * f.tile, f.tile, tile_scale(k, t),
                                       reinterpret_cast<uint16_t*>(to) + t * f.tile);
      } else
#endif
      {
        dequant_nope(k, vals);
        round_to_bf16(vals, f.N, reinterpret_cast<uint16_t*>(to));
      }
    } else {
      dequant_nope(k, vals);
      for (int64_t d = 0; d < f.N; ++d) to[d] = as_operand(static_cast<scalar_t>(vals[d]));
    }
    mm_t* rope = to + f.N;
    if constexpr (std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<mm_t, at::BFloat16>) {
      if (!f.rope_fp16) {
        std::memcpy(rope, k.rope, 2 * f.R);
        std::fill(to + D, to + Dp, mm_t(0));
        return;
      }
    }
    for (int64_t d = 0; d < f.R; ++d) {
      uint16_t bits;
      std::memcpy(&bits, k.rope + 2 * d, 2);
      const float r = f.rope_fp16 ? static_cast<float>(c10::Half(bits, c10::Half::from_bits())) : bf16_float(bits);
      rope[d] = as_operand(static_cast<scalar_t>(r));
    }
    std::fill(to + D, to + Dp, mm_t(0));
  }

  template <typename Key>
  void gather(const std::vector<Key>& rows, int64_t npad, int64_t i0, int64_t i1, mm_t* dst) {
    constexpr int64_t AHEAD = 16;
    const int64_t n = static_cast<int64_t>(rows.size());
    for (int64_t i = i0; i < i1; ++i) {
      mm_t* to = dst + (i - i0) * Dp;
      if (i < n) {
        if (i + AHEAD < n) prefetch(rows[i + AHEAD]);
        copy_row(rows[i], to);
      } else {
        std::fill(to, to + Dp, mm_t(0));
      }
      if constexpr (packed)
        if (i % 2 == 1) {
          const auto* a = reinterpret_cast<const uint16_t*>(to - Dp);
          pack_pair(a, a + Dp, Dp, npad, i / 2, reinterpret_cast<uint16_t*>(v_packed), vpanel);
        }
    }
  }

  // keys [npad, Dp] whole (the backward multiplies them more than once)
  template <typename Key>
  void gather(const std::vector<Key>& rows, int64_t npad) { gather(rows, npad, 0, npad, keys); }

  // S^T [npad, Hp] = keys x q^T.  With packed operands the keys stream through a ring of RING
  // rows: each chunk's rows of S^T are multiplied while it is in L1 / L2 and only the packed V
  // stays.  A whole key copy (640 KB for V4's 640 keys) beside the packed V (as much again) filled
  // L2 and pushed V out before P V: gather + S + P V took 18 % longer per row that way (one
  // core, 640 random rows of a 2 MB cache).  Without packing, P V reads the keys themselves.
  template <typename Key>
  void gather_scores(const std::vector<Key>& rows, int64_t npad) {
    if constexpr (packed) {
      for (int64_t c0 = 0; c0 < npad; c0 += RING) {
        const int64_t m = std::min(RING, npad - c0);
        gather(rows, npad, c0, c0 + m, ring);
        // the next chunk's keys come into L2 while this chunk is multiplied (the micro-kernel's path)
        dsattn_native::LinePrefetch next = gemm_prefetches ? key_lines(rows, c0 + m, c0 + m + RING)
                                                           : dsattn_native::LinePrefetch{};
        for (int64_t h0 = 0; h0 < Hp; h0 += PANEL)
          gemm(m, std::min(PANEL, Hp - h0), Dp, Dp, std::min(PANEL, Hp - h0), Hp, false, ring, q_b + h0 * Dp,
                 s + c0 * Hp + h0, true, &next);
      }
    } else {
      gather(rows, npad);
      for (int64_t h0 = 0; h0 < Hp; h0 += PANEL)
        gemm(npad, std::min(PANEL, Hp - h0), Dp, Dp, Hp, Hp, false, keys, q_b + h0, s + h0, false);
    }
  }

  // P from the exponentials in s (the paths other than bf16, whose P softmax_numerators_bf16 writes)
  void p_from_scores(int64_t n, int64_t npad) {
    if constexpr (std::is_same_v<mm_t, float> && !std::is_same_v<scalar_t, at::Half>) {
      p_from_scores_f32(s, n, npad, Hp, p, std::is_same_v<scalar_t, at::BFloat16>);
    } else {                                          // fp16 rounding: c10's conversion, element by element
      for (int64_t h = 0; h < Hp; ++h) {
        mm_t* prow = p + h * npad;
        for (int64_t j = 0; j < n; ++j) prow[j] = as_operand(static_cast<scalar_t>(s[j * Hp + h]));
        std::fill(prow + n, prow + npad, mm_t(0));
      }
    }
  }

  void store(const float* inv, scalar_t* out) {
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      normalize_bf16(o, Dp, inv, H, D, reinterpret_cast<uint16_t*>(out));
    } else if constexpr (std::is_same_v<scalar_t, float>) {
      normalize_f32(o, Dp, inv, H, D, out);
    } else {
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<scalar_t>(o[h * Dp + d] * inv[h]);
    }
  }

  // One query row over its gathered keys -> out [H, D] (query dtype), lse [H]; when not null,
  // row_max [H]: the maximum scaled score, without the sink (-inf for a row without a key), and
  // stat_max / stat_sum [H]: the softmax's shift m and denominator l, sink included (0 and 0 for a
  // row without a key: kv_quant_sparse_flash_attention's softmax_max / softmax_sum).
  template <typename Key>
  void run(const scalar_t* q, const std::vector<Key>& rows, scalar_t* out, float* lse, float* row_max = nullptr,
           float* stat_max = nullptr, float* stat_sum = nullptr) {
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0) {                                   // no key: O = 0, lse = 0
      std::fill(out, out + H * D, scalar_t(0));
      std::fill(lse, lse + H, 0.0f);
      if (row_max != nullptr) std::fill(row_max, row_max + H, -std::numeric_limits<float>::infinity());
      if (stat_max != nullptr) std::fill(stat_max, stat_max + H, 0.0f);
      if (stat_sum != nullptr) std::fill(stat_sum, stat_sum + H, 0.0f);
      return;
    }
    const int64_t npad = round_up(n, KEY_ALIGN);
    load_query(q);
    gather_scores(rows, npad);
    // the softmax's shift: the row maximum of scale * s joined with the finite sinks; 0 where
    // nothing is finite.  bf16 queries: the maximum of the raw scores, scaled once (for scale > 0,
    // max fl(scale s) = fl(scale max s): rounding is monotonic), and one pass for e, l and P.
    constexpr bool fused = std::is_same_v<mm_t, at::BFloat16>;
    const bool scaled_later = fused && scale > 0.0f;
    std::fill(m, m + Hp, -std::numeric_limits<float>::infinity());
    if (scaled_later) {
      column_max(s, n, Hp, m);
      for (int64_t h = 0; h < Hp; ++h) m[h] *= scale;
    } else {
      scale_and_max(s, n, Hp, scale, m);
    }
    if (row_max != nullptr) std::copy(m, m + H, row_max);
    for (int64_t h = 0; h < Hp; ++h) {
      if (sinks != nullptr && h < H && std::isfinite(sinks[h])) m[h] = std::max(m[h], sinks[h]);
      if (!std::isfinite(m[h])) m[h] = 0.0f;
    }
    std::fill(l, l + Hp, 0.0f);
    if constexpr (fused) {                           // P = round(e) to bf16, [Hp, npad]
      softmax_numerators_bf16(s, n, npad, Hp, scaled_later ? scale : 1.0f, m, l, reinterpret_cast<uint16_t*>(p));
    } else {
      exp_and_sum(s, n, Hp, m, l);
      p_from_scores(n, npad);                        // P = round(e) to the query dtype, [Hp, npad]
    }
    // O = P x V, one call per panel of V (up to vpanel columns) over all the row's keys
    for (int64_t d0 = 0; d0 < Dp; d0 += vpanel) {
      const int64_t w = std::min(vpanel, Dp - d0);
      if constexpr (packed) {
        gemm(Hp, w, npad, npad, w, Dp, false, p, v_packed + d0 * npad, o + d0, true);
      } else {
        gemm(Hp, w, npad, npad, Dp, Dp, false, p, keys + d0, o + d0, false);
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      const float den = l[h] + (sinks != nullptr ? std::exp(sinks[h] - m[h]) : 0.0f);
      inv[h] = 1.0f / den;
      lse[h] = m[h] + std::log(sink_in_lse ? den : l[h]);
      if (stat_max != nullptr) stat_max[h] = m[h];
      if (stat_sum != nullptr) stat_sum[h] = den;
    }
    store(inv, out);
  }
};

// The index tables of a call: row r's keys are sources[i][rows[i][r, j]] for the entries >= 0,
// source by source (window keys, then compressed keys).
template <typename scalar_t>
struct KeyTables {
  std::vector<const scalar_t*> bases;
  std::vector<const int64_t*> index;
  std::vector<int64_t> widths;
  int64_t width = 0, D;

  KeyTables(const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& rows, int64_t dim) : D(dim) {
    for (size_t i = 0; i < sources.size(); ++i) {
      bases.push_back(static_cast<const scalar_t*>(sources[i].data_ptr()));   // (packed sources: bytes)
      index.push_back(rows[i].data_ptr<int64_t>());
      widths.push_back(rows[i].size(1));
      width += rows[i].size(1);
    }
  }
  int64_t npad_max() const { return round_up(std::max<int64_t>(width, 1), KEY_ALIGN); }

  // row r's work for parallel_rows: its keys, plus about 64 keys' worth for its query and output
  int64_t cost(int64_t r) const {
    int64_t n = 64;
    for (size_t i = 0; i < bases.size(); ++i) {
      const int64_t* idx = index[i] + r * widths[i];
      for (int64_t j = 0; j < widths[i]; ++j) n += idx[j] >= 0;
    }
    return n;
  }

  // visit(source, row, pointer) for each key of query row r, in order
  template <typename Visit>
  void each(int64_t r, Visit visit) const {
    for (size_t i = 0; i < bases.size(); ++i) {
      const int64_t* idx = index[i] + r * widths[i];
      for (int64_t j = 0; j < widths[i]; ++j)
        if (idx[j] >= 0) visit(static_cast<int>(i), idx[j], bases[i] + idx[j] * D);
    }
  }
};

// formats: one per source, null for rows of the query dtype, else how its packed tokens are decoded
template <typename scalar_t, typename mm_t>
void forward_rows(const at::Tensor& q, const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& rows,
                  const std::vector<const PackedFormat*>& formats, const float* sinks, double scale, bool sink_in_lse,
                  at::Tensor& out, at::Tensor& lse, float* row_max, float* stat_max, float* stat_sum) {
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const KeyTables<scalar_t> tables(sources, rows, D);
  const bool any_packed = std::any_of(formats.begin(), formats.end(), [](const PackedFormat* f) { return f != nullptr; });
  const scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  float* lp = lse.data_ptr<float>();
  // Rows [r0, r1), heads [h0, h0 + hs) of each: one thread's share.  Heads are independent (each has
  // its own scores, maximum, sum and output; the GEMMs sum every element over D or over the keys in
  // the same order whatever the head count), so a row split over head groups gives the bits it
  // gives whole (test_native_kernels checks it).
  auto rows_heads = [&](int64_t r0, int64_t r1, int64_t h0, int64_t hs) {
    RowAttention<scalar_t, mm_t> work{hs, D, round_up(hs, 16), round_up(D, 16), static_cast<float>(scale),
                                      sinks != nullptr ? sinks + h0 : nullptr, sink_in_lse};
    work.reserve(tables.npad_max(), /*whole_keys=*/!RowAttention<scalar_t, mm_t>::packed);
    std::vector<const scalar_t*> keys;
    std::vector<KeyRef> refs;                    // with packed sources: each key's fields
    (any_packed ? refs.reserve(tables.width) : keys.reserve(tables.width));
    for (int64_t r = r0; r < r1; ++r) {
      float* mx = row_max != nullptr ? row_max + r * H + h0 : nullptr;
      float* smax = stat_max != nullptr ? stat_max + r * H + h0 : nullptr;
      float* ssum = stat_sum != nullptr ? stat_sum + r * H + h0 : nullptr;
      const int64_t at = r * H * D + h0 * D;
      if (any_packed) {
        refs.clear();
        tables.each(r, [&](int i, int64_t t, const scalar_t* row) {
          refs.push_back(formats[i] != nullptr ? packed_key(*formats[i], t)
                                               : KeyRef{reinterpret_cast<const uint8_t*>(row), nullptr, nullptr, nullptr});
        });
        work.run(qp + at, refs, op + at, lp + r * H + h0, mx, smax, ssum);
      } else {
        keys.clear();
        tables.each(r, [&](int, int64_t, const scalar_t* row) { keys.push_back(row); });
        work.run(qp + at, keys, op + at, lp + r * H + h0, mx, smax, ssum);
      }
    }
    gemm_release<mm_t>();
  };
  // Fewer rows than threads (a decode step of one or a few requests): each row's heads are split into
  // groups of a multiple of 16 (the GEMM tiles' rows) so that every thread has work.
  const int64_t threads = at::get_num_threads();
  const int64_t groups = (R > 0 && R < threads) ? std::min((threads + R - 1) / R, H / 16) : 1;
  if (groups > 1) {
    const int64_t hg = round_up((H + groups - 1) / groups, 16), per_row = (H + hg - 1) / hg;
    at::parallel_for(0, R * per_row, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t h0 = (t % per_row) * hg;
        rows_heads(t / per_row, t / per_row + 1, h0, std::min(hg, H - h0));
      }
    });
    return;
  }
  dsattn_native::parallel_rows(R, [&](int64_t r) { return tables.cost(r); },
                               [&](int64_t r0, int64_t r1) { rows_heads(r0, r1, 0, H); });
}

// The element-wise part of the gradient for bf16 operands, rows j < n of S^T / dP^T [n, Hp]:
// P = exp(scale S - lse) (lse +inf on padded heads: P = 0), dS = bf16(P (dP - Dsum)), round(P),
// sink_dot[h] += P dP, psum[j] = sum_h P (the head mean's numerator).
DSATTN_VECTOR_BODY void gradient_terms_bf16_body(const float* __restrict__ s, const float* __restrict__ dp, int64_t n, int64_t Hp, float scale,
                         const float* __restrict__ lse, const float* __restrict__ dsum, float* __restrict__ ds_f32,
                         uint16_t* __restrict__ ds_bits, uint16_t* __restrict__ p_bits, float* __restrict__ sink_dot,
                         float* __restrict__ psum) {
  // The head loop has no float sum over heads in it (one would not vectorise without
  // reassociation): P goes to ``prow`` and is summed afterwards in 16 lanes, then across them (a
  // summation order, like the one torch's mean has in the golden).  A serial sum in head order
  // was a chain of 64 dependent adds per key: a tenth of the gradient's time.
  alignas(64) float prow[1024];
  for (int64_t j = 0; j < n; ++j) {
    float lanes[16] = {};
    for (int64_t h0 = 0; h0 < Hp; h0 += 1024) {
      const int64_t h1 = std::min(Hp, h0 + 1024);   // (Hp, h0: multiples of 16)
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t at = j * Hp + h;
        const float pv = exp_nonpositive(scale * s[at] - lse[h]);
        const uint16_t ds = bf16_bits(pv * (dp[at] - dsum[h]));
        ds_bits[at] = ds;
        ds_f32[at] = bf16_float(ds);
        p_bits[at] = bf16_bits(pv);
        sink_dot[h] += pv * dp[at];
        prow[h - h0] = pv;
      }
      for (int64_t h = 0; h < h1 - h0; h += 16)
        for (int64_t l = 0; l < 16; ++l) lanes[l] += prow[h + l];
    }
    float acc = 0.0f;
    for (int64_t l = 0; l < 16; ++l) acc += lanes[l];
    psum[j] = acc;
  }
}
DSATTN_PER_ISA(gradient_terms_bf16, (const float* __restrict__ s, const float* __restrict__ dp, int64_t n, int64_t Hp, float scale, const float* __restrict__ lse, const float* __restrict__ dsum, float* __restrict__ ds_f32, uint16_t* __restrict__ ds_bits, uint16_t* __restrict__ p_bits, float* __restrict__ sink_dot, float* __restrict__ psum), (s, dp, n, Hp, scale, lse, dsum, ds_f32, ds_bits, p_bits, sink_dot, psum))

// The backward's per-row element loops, kept out of backward_rows (a template compiled for the
// baseline ISA) so that they are compiled per ISA too.

// dst[j, :D] += scale * a[j, :D] + b[j, :D] for the n rows j of two [n, Dp] fp32 blocks, into the
// accumulator rows ``dst[j]`` (dK: the scaled dS^T q plus round(P)^T dO, as the golden sums them).
DSATTN_VECTOR_BODY void add_scaled_rows_body(float* const* __restrict__ dst, const float* __restrict__ a, const float* __restrict__ b,
                     int64_t n, int64_t D, int64_t Dp, float scale) {
  for (int64_t j = 0; j < n; ++j) {
    float* __restrict__ d = dst[j];
    const float *aj = a + j * Dp, *bj = b + j * Dp;
    for (int64_t k = 0; k < D; ++k) d[k] += scale * aj[k] + bj[k];
  }
}
DSATTN_PER_ISA(add_scaled_rows, (float* const* __restrict__ dst, const float* __restrict__ a, const float* __restrict__ b, int64_t n, int64_t D, int64_t Dp, float scale), (dst, a, b, n, D, Dp, scale))

// out[h] = sum_d x[h, d] y[h, d] over bf16 rows [H, D], in 16 fp32 lanes (no reassociated sum).
DSATTN_VECTOR_BODY void row_dots_bf16_body(const uint16_t* __restrict__ x, const uint16_t* __restrict__ y, int64_t H, int64_t D,
                   float* __restrict__ out) {
  for (int64_t h = 0; h < H; ++h) {
    float lanes[16] = {};
    const uint16_t *xh = x + h * D, *yh = y + h * D;
    int64_t d = 0;
    for (; d + 16 <= D; d += 16)
      for (int64_t l = 0; l < 16; ++l)
        lanes[l] += bf16_float(xh[d + l]) * bf16_float(yh[d + l]);
    float acc = 0.0f;
    for (int64_t l = 0; l < 16; ++l) acc += lanes[l];
    for (; d < D; ++d) acc += bf16_float(xh[d]) * bf16_float(yh[d]);
    out[h] = acc;
  }
}
DSATTN_PER_ISA(row_dots_bf16, (const uint16_t* __restrict__ x, const uint16_t* __restrict__ y, int64_t H, int64_t D, float* __restrict__ out), (x, y, H, D, out))

// dst [Hp, Dp] = src [H, D] zero padded (16-bit elements).
DSATTN_VECTOR_BODY void pad_rows16_body(const uint16_t* __restrict__ src, int64_t H, int64_t D, int64_t Hp, int64_t Dp, uint16_t* __restrict__ dst) {
  for (int64_t h = 0; h < Hp; ++h)
    for (int64_t d = 0; d < Dp; ++d) dst[h * Dp + d] = h < H && d < D ? src[h * D + d] : uint16_t(0);
}
DSATTN_PER_ISA(pad_rows16, (const uint16_t* __restrict__ src, int64_t H, int64_t D, int64_t Hp, int64_t Dp, uint16_t* __restrict__ dst), (src, H, D, Hp, Dp, dst))

// ---- backward (the golden's sparse_flash_mla_grad, dsattn/sparse_mla/ref.py) ----
//
// Per query row, over its gathered keys K [n, D] (K = V):
//   S = scale q K^T, P = exp(S - lse), dP = dO K^T, Dsum = rowsum(dO * O),
//   dS = round(P (dP - Dsum)) to the query dtype,
//   dq = scale dS K, dK = scale dS^T q + round(P)^T dO (scattered to the key rows, fp32),
//   dsinks -= exp(sink - lse) rowsum(P dP) (rows with a key and a finite lse),
//   pmean[j] = mean over heads of P[:, j] (for the L1-norm outputs).
// The GEMMs run as in the forward: S^T and dP^T = K [q^T | dO^T]; dq = dS K with K packed by key
// pairs; dK = dS^T q and round(P)^T dO with q and dO packed by head pairs.  Every product is of
// half-precision-representable values, summed in fp32: the golden's numerics up to summation order.
template <typename scalar_t, typename mm_t>
void backward_rows(const at::Tensor& q, const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                   const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& rows, const float* sinks,
                   double scale_d, const int64_t* group, at::Tensor& dq, std::vector<at::Tensor>& dsrc,
                   at::Tensor& dsinks, at::Tensor& pmean) {
  constexpr bool packed = !std::is_same_v<mm_t, float>;
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hp = round_up(H, 16), Dp = round_up(D, 16);
  const float scale = static_cast<float>(scale_d);
  const KeyTables<scalar_t> tables(sources, rows, D);
  const int64_t width = tables.width, npad_max = tables.npad_max();
  const scalar_t *qp = q.data_ptr<scalar_t>(), *dop = dout.data_ptr<scalar_t>(), *op = out.data_ptr<scalar_t>();
  const float* lp = lse.data_ptr<float>();
  scalar_t* dqp = dq.data_ptr<scalar_t>();
  float* pm = pmean.data_ptr<float>();
  // Key gradients are summed in an order fixed by each request alone: its rows go in groups (``group``:
  // one id per row, equal for the rows of a group, which are consecutive; canonical blocks of a request's
  // rows), a group's rows add their contributions in row order into a thread's accumulator, and the
  // groups' partial sums are added to dsrc in group order.  Whatever the thread count, and whichever other
  // requests share the call, a key only this request reads gets the same bits (batch invariance).
  // Groups go in chunks: the threads build the chunk's partial sums (each kept compact: the rows it
  // touched), then add them in order, each thread taking a slice of the columns.  dsinks: per-row terms,
  // summed in row order.
  std::vector<int64_t> gstart;
  for (int64_t r = 0; r < R; ++r)
    if (r == 0 || group == nullptr || group[r] != group[r - 1]) gstart.push_back(r);
  gstart.push_back(R);
  const int64_t ng = static_cast<int64_t>(gstart.size()) - 1;
  std::vector<int64_t> gcost(ng, 0), gkeys(ng, 0);
  for (int64_t g = 0; g < ng; ++g)
    for (int64_t r = gstart[g]; r < gstart[g + 1]; ++r) {
      const int64_t c = tables.cost(r);
      gcost[g] += c, gkeys[g] += c - 64;
    }
  struct Partial {                                   // one group's sums over the key rows it touched
    std::vector<float> values;
    std::vector<int> source;
    std::vector<int64_t> row;
  };
  const int threads = at::get_num_threads();
  std::vector<std::vector<Buffer<float>>> acc(threads);          // per thread: dense accumulators per source
  std::vector<std::vector<std::vector<uint8_t>>> touched(threads);
  std::vector<float> sink_terms(sinks != nullptr ? R * H : 0, 0.0f);
  std::vector<float*> dsrc_ptr;
  for (auto& d : dsrc) dsrc_ptr.push_back(d.data_ptr<float>());
  const int64_t budget = std::max<int64_t>(int64_t(16) << 20, 4 * threads * width * D);   // floats per chunk
  std::vector<Partial> partial;
  int64_t source_rows = 0;
  for (const auto& d : dsrc) source_rows += d.size(0);
  for (int64_t g0 = 0; g0 < ng;) {
    // a chunk: at least a group per thread where there are enough, within the budget beyond that (a
    // partial holds at most the group's keys, and at most every source row once)
    int64_t g1 = g0, total = 0;
    while (g1 < ng && (g1 - g0 < threads || total + std::min(gkeys[g1], source_rows) * D <= budget))
      total += std::min(gkeys[g1++], source_rows) * D;
    partial.assign(g1 - g0, Partial{});
  dsattn_native::parallel_rows(g1 - g0, [&](int64_t g) { return gcost[g0 + g]; }, [&](int64_t a0, int64_t a1) {
    const int tid = at::get_thread_num();
    auto& my = acc[tid];
    auto& mark = touched[tid];
    if (my.empty())
      for (const auto& d : dsrc) {
        my.emplace_back(d.numel(), 0.0f);
        mark.emplace_back(d.size(0), uint8_t(0));
      }
    std::vector<std::pair<int, int64_t>> hit;        // the group's touched (source, row), in first-touch order
    std::vector<float*> dst_rows(width);             // each key's accumulator row
    RowAttention<scalar_t, mm_t> work{H, D, Hp, Dp, scale, sinks};
    work.reserve(npad_max, /*whole_keys=*/true);
    Buffer<mm_t> do_b(Dp * Hp), q_pairs(Hp * Dp), do_pairs(Hp * Dp), q_plain(Hp * Dp), do_plain(Hp * Dp),
        ds_rows(npad_max * Hp), p_rows(npad_max * Hp), ds_t(Hp * npad_max);
    Buffer<float> dp(npad_max * Hp), dsum(Hp), cq(Hp * Dp), ck(DK_CHUNK * Dp), ck2(DK_CHUNK * Dp), dsf(npad_max * Hp),
        sink_dot(Hp), lse_pad(Hp), psum(npad_max), scales(Hp, scale);
    std::vector<const scalar_t*> keys;
    std::vector<std::pair<int, int64_t>> where;      // (source, row) of each gathered key
    keys.reserve(width);
    where.reserve(width);
    for (int64_t g = g0 + a0; g < g0 + a1; ++g) {
    hit.clear();
    for (int64_t r = gstart[g]; r < gstart[g + 1]; ++r) {
      keys.clear();
      where.clear();
      tables.each(r, [&](int source, int64_t row, const scalar_t* ptr) {
        keys.push_back(ptr);
        where.emplace_back(source, row);
      });
      const int64_t n = static_cast<int64_t>(keys.size());
      scalar_t* dqr = dqp + r * H * D;
      float* pmr = pm + r * width;
      std::fill(pmr, pmr + width, 0.0f);
      if (n == 0) {
        std::fill(dqr, dqr + H * D, scalar_t(0));
        continue;
      }
      const int64_t npad = round_up(n, KEY_ALIGN);
      const scalar_t *qr = qp + r * H * D, *dor = dop + r * H * D, *orow = op + r * H * D;
      const float* lr = lp + r * H;
      work.gather(keys, npad);                        // keys [npad, Dp] and, packed, keys by key pairs
      work.load_query(qr);                            // q^T
      dsattn_native::pack_query<scalar_t, mm_t>(dor, H, D, Hp, Dp, do_b.data());   // dO^T
      // S^T = K q^T and dP^T = K dO^T
      for (int64_t h0 = 0; h0 < Hp; h0 += PANEL) {
        const int64_t w = std::min(PANEL, Hp - h0);
        if constexpr (packed) {
          gemm(npad, w, Dp, Dp, w, Hp, false, work.keys, work.q_b + h0 * Dp, work.s + h0, true);
          gemm(npad, w, Dp, Dp, w, Hp, false, work.keys, do_b.data() + h0 * Dp, dp.data() + h0, true);
        } else {
          gemm(npad, w, Dp, Dp, Hp, Hp, false, work.keys, work.q_b + h0, work.s + h0, false);
          gemm(npad, w, Dp, Dp, Hp, Hp, false, work.keys, do_b.data() + h0, dp.data() + h0, false);
        }
      }
      std::fill(dsum.begin(), dsum.end(), 0.0f);    // Dsum = rowsum(dO * O)
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        row_dots_bf16(reinterpret_cast<const uint16_t*>(dor), reinterpret_cast<const uint16_t*>(orow), H, D, dsum.data());
      } else {
        for (int64_t h = 0; h < H; ++h) {
          float acc_d = 0.0f;
          for (int64_t d = 0; d < D; ++d) acc_d += static_cast<float>(dor[h * D + d]) * static_cast<float>(orow[h * D + d]);
          dsum[h] = acc_d;
        }
      }
      std::fill(sink_dot.begin(), sink_dot.end(), 0.0f);
      if constexpr (std::is_same_v<mm_t, at::BFloat16>) {
        for (int64_t h = 0; h < Hp; ++h) lse_pad[h] = h < H ? lr[h] : std::numeric_limits<float>::infinity();
        gradient_terms_bf16(work.s, dp.data(), n, Hp, scale, lse_pad.data(), dsum.data(), dsf.data(),
                            reinterpret_cast<uint16_t*>(ds_rows.data()), reinterpret_cast<uint16_t*>(p_rows.data()),
                            sink_dot.data(), psum.data());
        for (int64_t j = 0; j < n; ++j) pmr[j] = psum[j] / static_cast<float>(H);
      } else {
        for (int64_t j = 0; j < n; ++j) {
          float acc_p = 0.0f;
          for (int64_t h = 0; h < Hp; ++h) {
            float pv = 0.0f, dsv = 0.0f, pr = 0.0f;
            if (h < H) {
              pv = std::exp(scale * work.s[j * Hp + h] - lr[h]);
              const float dpv = dp[j * Hp + h];
              dsv = static_cast<float>(static_cast<scalar_t>(pv * (dpv - dsum[h])));   // round to the query dtype
              pr = static_cast<float>(static_cast<scalar_t>(pv));
              sink_dot[h] += pv * dpv;
              acc_p += pv;
            }
            dsf[j * Hp + h] = dsv;
            ds_rows[j * Hp + h] = static_cast<mm_t>(dsv);
            p_rows[j * Hp + h] = static_cast<mm_t>(pr);
          }
          pmr[j] = acc_p / static_cast<float>(H);
        }
      }
      std::fill(ds_rows.begin() + n * Hp, ds_rows.begin() + npad * Hp, mm_t(0));   // padded keys: no gradient
      std::fill(p_rows.begin() + n * Hp, p_rows.begin() + npad * Hp, mm_t(0));
      if (sinks != nullptr)
        for (int64_t h = 0; h < H; ++h)
          sink_terms[r * H + h] = std::isfinite(lr[h]) ? -(std::exp(sinks[h] - lr[h]) * sink_dot[h]) : 0.0f;
      // dq = scale dS K   (A = dS [Hp, npad], B = K by key pairs / plain)
      if constexpr (std::is_same_v<mm_t, at::BFloat16>) {
        p_from_scores_bf16(dsf.data(), n, npad, Hp, reinterpret_cast<uint16_t*>(ds_t.data()));   // (exact: bf16 values)
      } else {
        for (int64_t h = 0; h < Hp; ++h)
          for (int64_t j = 0; j < npad; ++j) ds_t[h * npad + j] = j < n ? ds_rows[j * Hp + h] : mm_t(0);
      }
      for (int64_t d0 = 0; d0 < Dp; d0 += work.vpanel) {
        const int64_t w = std::min(work.vpanel, Dp - d0);
        if constexpr (packed)
          gemm(Hp, w, npad, npad, w, Dp, false, ds_t.data(), work.v_packed + d0 * npad, cq.data() + d0, true);
        else
          gemm(Hp, w, npad, npad, Dp, Dp, false, ds_t.data(), work.keys + d0, cq.data() + d0, false);
      }
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        normalize_bf16(cq.data(), Dp, scales.data(), H, D, reinterpret_cast<uint16_t*>(dqr));   // bf16(scale * cq)
      } else {
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) dqr[h * D + d] = static_cast<scalar_t>(scale * cq[h * Dp + d]);
      }
      // dK = scale dS^T q + round(P)^T dO   (B = q, dO [Hp, Dp], by head pairs / plain)
      if constexpr (std::is_same_v<scalar_t, mm_t> && sizeof(mm_t) == 2) {
        pad_rows16(reinterpret_cast<const uint16_t*>(qr), H, D, Hp, Dp, reinterpret_cast<uint16_t*>(q_plain.data()));
        pad_rows16(reinterpret_cast<const uint16_t*>(dor), H, D, Hp, Dp, reinterpret_cast<uint16_t*>(do_plain.data()));
      } else for (int64_t h = 0; h < Hp; ++h)
        for (int64_t d = 0; d < Dp; ++d) {
          const bool in = h < H && d < D;
          if constexpr (std::is_same_v<scalar_t, mm_t>) {
            q_plain[h * Dp + d] = in ? qr[h * D + d] : mm_t(0);
            do_plain[h * Dp + d] = in ? dor[h * D + d] : mm_t(0);
          } else {
            q_plain[h * Dp + d] = in ? static_cast<mm_t>(static_cast<float>(qr[h * D + d])) : mm_t(0);
            do_plain[h * Dp + d] = in ? static_cast<mm_t>(static_cast<float>(dor[h * D + d])) : mm_t(0);
          }
        }
      if constexpr (packed) {                                   // B = q, dO by head pairs
        const auto by_pairs = [&](const Buffer<mm_t>& plain, Buffer<mm_t>& pairs) {
          pack_matrix(reinterpret_cast<const uint16_t*>(plain.data()), Hp, Dp, reinterpret_cast<uint16_t*>(pairs.data()),
                      work.vpanel);
        };
        by_pairs(q_plain, q_pairs);
        by_pairs(do_plain, do_pairs);
      }
      // C [m, Dp] = A [m, Hp] x B [Hp, Dp] for the m keys of one chunk
      auto dk_gemm = [&](int64_t m, const mm_t* a, const Buffer<mm_t>& b_plain, const Buffer<mm_t>& b_pairs,
                         float* c) {
        for (int64_t d0 = 0; d0 < Dp; d0 += work.vpanel) {
          const int64_t w = std::min(work.vpanel, Dp - d0);
          if constexpr (packed)
            gemm(m, w, Hp, Hp, w, Dp, false, a, b_pairs.data() + d0 * Hp, c + d0, true);
          else
            gemm(m, w, Hp, Hp, Dp, Dp, false, a, b_plain.data() + d0, c + d0, false);
        }
      };
      for (int64_t j = 0; j < n; ++j) {
        const auto [src, row] = where[j];
        dst_rows[j] = my[src].data() + row * D;
        if (!mark[src][row]) mark[src][row] = 1, hit.emplace_back(src, row);
      }
      // a chunk of keys at a time, so that both products and the rows they are added to stay in L2
      for (int64_t j0 = 0; j0 < n; j0 += DK_CHUNK) {
        const int64_t m = std::min(DK_CHUNK, npad - j0);       // (npad and DK_CHUNK: multiples of 64)
        dk_gemm(m, ds_rows.data() + j0 * Hp, q_plain, q_pairs, ck.data());    // dS^T q
        dk_gemm(m, p_rows.data() + j0 * Hp, do_plain, do_pairs, ck2.data());  // round(P)^T dO
        add_scaled_rows(dst_rows.data() + j0, ck.data(), ck2.data(), std::min(m, n - j0), D, Dp, scale);
      }
      // pmean is per key slot of the row's index tables: spread the gathered order back
      int64_t k = n;
      for (int64_t i = static_cast<int64_t>(tables.bases.size()) - 1, col = width; i >= 0; --i) {
        const int64_t w = tables.widths[i];
        col -= w;
        const int64_t* idx = tables.index[i] + r * w;
        for (int64_t j = w - 1; j >= 0; --j) pmr[col + j] = idx[j] >= 0 ? pmr[--k] : 0.0f;
      }
    }
    // the group's partial sums, compact; the accumulator rows back to zero
    Partial& part = partial[g - g0];
    part.values.resize(hit.size() * D);
    part.source.resize(hit.size());
    part.row.resize(hit.size());
    for (size_t t = 0; t < hit.size(); ++t) {
      const auto [src, row] = hit[t];
      float* a = my[src].data() + row * D;
      std::copy(a, a + D, part.values.data() + t * D);
      std::fill(a, a + D, 0.0f);
      mark[src][row] = 0;
      part.source[t] = src, part.row[t] = row;
    }
    }
    gemm_release<mm_t>();
  });
    // the chunk's partial sums into dsrc in group order; threads take 16-column slices
    const int64_t slices = (D + 15) / 16;
    at::parallel_for(0, slices, 1, [&](int64_t s0, int64_t s1) {
      const int64_t k0 = s0 * 16, k1 = std::min(D, s1 * 16);
      for (const Partial& part : partial)
        for (size_t t = 0; t < part.row.size(); ++t) {
          float* __restrict__ d = dsrc_ptr[part.source[t]] + part.row[t] * D;
          const float* __restrict__ c = part.values.data() + t * D;
          for (int64_t k = k0; k < k1; ++k) d[k] += c[k];
        }
    });
    g0 = g1;
  }
  if (sinks != nullptr) {
    float* ds = dsinks.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r)
      for (int64_t h = 0; h < H; ++h) ds[h] += sink_terms[r * H + h];
  }
}

}  // namespace

namespace {

// The checks both entry points share: q [R, H, D], each source [N_i, D] in q's dtype, each index
// table int64 [R, W_i] whose entries are -1 or a row of its source (every read is in range).
// A packed source (``formats[i]`` given): its bytes, contiguous, with every token's fields inside
// them; its index entries are token numbers.
void check_operands(const at::Tensor& q, const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& rows,
                    const std::vector<const PackedFormat*>& formats = {}) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.device().is_cpu(), "q: expected a contiguous CPU [R, H, D] tensor");
  TORCH_CHECK(sources.size() == rows.size(), "sources and rows: one index table per source");
  const int64_t R = q.size(0), D = q.size(2);
  for (size_t i = 0; i < sources.size(); ++i) {
    const PackedFormat* f = i < formats.size() ? formats[i] : nullptr;
    int64_t count = 0;
    if (f == nullptr) {
      TORCH_CHECK(sources[i].dim() == 2 && sources[i].size(1) == D && sources[i].is_contiguous() &&
                      sources[i].scalar_type() == q.scalar_type(),
                  "sources[", i, "]: expected a contiguous [N, D] tensor of q's dtype");
      count = sources[i].size(0);
    } else {
      TORCH_CHECK(sources[i].is_contiguous() && sources[i].element_size() == 1 && sources[i].device().is_cpu(),
                  "sources[", i, "]: a packed source must be contiguous CPU bytes");
      TORCH_CHECK(f->N + f->R == D && f->N > 0 && f->R >= 0 && f->tile > 0 && f->N % f->tile == 0 && f->bs > 0 &&
                      f->tokens >= 0 && f->block_stride >= 0 && f->body_stride >= 0 && f->scale_stride >= 0,
                  "formats[", i, "]: N + R must be q's head dim ", D, " with N a multiple of the tile");
      TORCH_CHECK(f->tokens == 0 || f->end_of(f->tokens - 1) <= sources[i].numel(), "formats[", i,
                  "]: its last token reaches past the source's ", sources[i].numel(), " bytes");
      count = f->tokens;
    }
    TORCH_CHECK(rows[i].dim() == 2 && rows[i].size(0) == R && rows[i].scalar_type() == at::kLong && rows[i].is_contiguous(),
                "rows[", i, "]: expected a contiguous int64 [R, W] tensor");
    const int64_t* idx = rows[i].data_ptr<int64_t>();
    for (int64_t k = 0; k < rows[i].numel(); ++k)
      TORCH_CHECK_INDEX(idx[k] < count, "rows[", i, "]: key row ", idx[k], " is out of range [0, ", count, ")");
  }
}

// The sinks as fp32 [H] (held by ``holder``), or null without them.
const float* sink_values(const c10::optional<at::Tensor>& sinks, int64_t H, at::Tensor& holder) {
  if (!sinks.has_value()) return nullptr;
  holder = sinks->to(at::kFloat).contiguous();
  TORCH_CHECK(holder.numel() == H, "sinks: expected [H]");
  return holder.data_ptr<float>();
}

}  // namespace

// out [R, H, D] (q's dtype) and lse [R, H] (fp32) of the rows of q [R, H, D] over the key rows
// sources[i][rows[i][r, j]] (rows: int64 [R, W_i], -1 = no key), with the sink sinks [H] (fp32);
// written into ``out_into`` / ``lse_into`` when given (contiguous, e.g. a slice of the caller's
// output: no copy), else into new tensors.  sink_in_lse false: the lse leaves the sink out (the
// output still includes it), as FlashMLA reports it.  max_into (fp32 [R, H], contiguous): each row's
// maximum scaled score without the sink, -inf for a row without a key (FlashMLA's max_logits).
// format_fields: per source, empty for rows of q's dtype, or the PackedFormat fields of a packed
// source (its bytes; index entries are its token numbers), decoded in the gather.  stats_into (fp32
// [2, R, H], contiguous): the softmax's shift and denominator, sink included (0 and 0 without a key).
std::vector<at::Tensor> sparse_attention_forward(const at::Tensor& q, const std::vector<at::Tensor>& sources,
                                                 const std::vector<at::Tensor>& rows,
                                                 const c10::optional<at::Tensor>& sinks, double scale,
                                                 const c10::optional<at::Tensor>& out_into,
                                                 const c10::optional<at::Tensor>& lse_into, bool sink_in_lse,
                                                 const c10::optional<at::Tensor>& max_into,
                                                 const std::vector<std::vector<int64_t>>& format_fields,
                                                 const c10::optional<at::Tensor>& stats_into) {
  TORCH_CHECK(format_fields.empty() || format_fields.size() == sources.size(),
              "formats: one per source (an empty one for rows of q's dtype)");
  std::vector<PackedFormat> storage(format_fields.size());
  std::vector<const PackedFormat*> formats(sources.size(), nullptr);
  for (size_t i = 0; i < format_fields.size(); ++i) {
    if (format_fields[i].empty()) continue;
    TORCH_CHECK(static_cast<int64_t>(format_fields[i].size()) == PackedFormat::FIELDS, "formats[", i, "]: expected ",
                PackedFormat::FIELDS, " integers");
    storage[i] = PackedFormat::from(format_fields[i], static_cast<const uint8_t*>(sources[i].data_ptr()));
    formats[i] = &storage[i];
  }
  check_operands(q, sources, rows, formats);
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  at::Tensor sinks_f;
  const float* sink_ptr = sink_values(sinks, H, sinks_f);
  auto out = out_into.has_value() ? *out_into : at::empty({R, H, D}, q.options());
  auto lse = lse_into.has_value() ? *lse_into : at::empty({R, H}, q.options().dtype(at::kFloat));
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous() &&
                  out.device().is_cpu(), "out: expected a contiguous CPU tensor shaped and typed like q");
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == R && lse.size(1) == H && lse.scalar_type() == at::kFloat &&
                  lse.is_contiguous() && lse.device().is_cpu(), "lse: expected a contiguous CPU fp32 [R, H] tensor");
  if (max_into.has_value())
    TORCH_CHECK(max_into->dim() == 2 && max_into->size(0) == R && max_into->size(1) == H &&
                    max_into->scalar_type() == at::kFloat && max_into->is_contiguous() && max_into->device().is_cpu(),
                "max: expected a contiguous CPU fp32 [R, H] tensor");
  if (stats_into.has_value())
    TORCH_CHECK(stats_into->dim() == 3 && stats_into->size(0) == 2 && stats_into->size(1) == R &&
                    stats_into->size(2) == H && stats_into->scalar_type() == at::kFloat && stats_into->is_contiguous() &&
                    stats_into->device().is_cpu(),
                "stats: expected a contiguous CPU fp32 [2, R, H] tensor");
  dsattn_native::dispatch_gemm(q.scalar_type(), [&](auto s, auto m) {
    float* stats = stats_into.has_value() ? stats_into->data_ptr<float>() : nullptr;
    forward_rows<decltype(s), decltype(m)>(q, sources, rows, formats, sink_ptr, scale, sink_in_lse, out, lse,
                                           max_into.has_value() ? max_into->data_ptr<float>() : nullptr, stats,
                                           stats != nullptr ? stats + R * H : nullptr);
  });
  return {out, lse};
}

// Gradients of the forward above: (dq [R, H, D] q's dtype, dsources: one fp32 [N_i, D] per source,
// dsinks [H] fp32 (zeros without sinks), pmean [R, W] fp32: P averaged over heads per index slot).
// dq_into: dq is written there (rows of the op's output: no block copy, no fresh block to fault in).
// groups: int64 [R], the rows' key-gradient groups (consecutive rows with one id; without it every row
// is its own group); dsources_into: fp32 [N_i, D] tensors the key gradients are added to (returned).
std::vector<at::Tensor> sparse_attention_backward(const at::Tensor& q, const at::Tensor& dout, const at::Tensor& out,
                                                  const at::Tensor& lse, const std::vector<at::Tensor>& sources,
                                                  const std::vector<at::Tensor>& rows,
                                                  const c10::optional<at::Tensor>& sinks, double scale,
                                                  const c10::optional<at::Tensor>& dq_into,
                                                  const c10::optional<at::Tensor>& groups,
                                                  const std::vector<at::Tensor>& dsources_into) {
  check_operands(q, sources, rows);
  for (const auto* t : {&dout, &out})
    TORCH_CHECK(t->sizes() == q.sizes() && t->scalar_type() == q.scalar_type() && t->is_contiguous(),
                "dout, out: expected contiguous tensors shaped and typed like q");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == R && lse.size(1) == H && lse.scalar_type() == at::kFloat && lse.is_contiguous(),
              "lse: expected a contiguous fp32 [R, H] tensor");
  int64_t width = 0;
  std::vector<at::Tensor> dsrc;
  TORCH_CHECK(dsources_into.empty() || dsources_into.size() == sources.size(),
              "dsources: expected one tensor per source, got ", dsources_into.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    width += rows[i].size(1);
    if (dsources_into.empty()) {
      dsrc.push_back(at::zeros({sources[i].size(0), D}, q.options().dtype(at::kFloat)));
    } else {
      const auto& d = dsources_into[i];
      TORCH_CHECK(d.dim() == 2 && d.size(0) == sources[i].size(0) && d.size(1) == D && d.scalar_type() == at::kFloat &&
                      d.is_contiguous() && d.device().is_cpu(),
                  "dsources[", i, "]: expected a contiguous CPU fp32 [", sources[i].size(0), ", ", D, "] tensor");
      dsrc.push_back(d);
    }
  }
  const int64_t* group = nullptr;
  if (groups.has_value()) {
    TORCH_CHECK(groups->dim() == 1 && groups->size(0) == R && groups->scalar_type() == at::kLong &&
                    groups->is_contiguous() && groups->device().is_cpu(),
                "groups: expected a contiguous CPU int64 [", R, "] tensor");
    group = groups->data_ptr<int64_t>();
  }
  at::Tensor sinks_f;
  const float* sink_ptr = sink_values(sinks, H, sinks_f);
  auto dq = dq_into.has_value() ? *dq_into : at::empty_like(q);
  TORCH_CHECK(dq.sizes() == q.sizes() && dq.scalar_type() == q.scalar_type() && dq.is_contiguous() &&
                  dq.device().is_cpu(), "dq: expected a contiguous CPU tensor shaped and typed like q");
  auto dsinks = at::zeros({H}, q.options().dtype(at::kFloat));
  auto pmean = at::empty({R, width}, q.options().dtype(at::kFloat));
  dsattn_native::dispatch_gemm(q.scalar_type(), [&](auto s, auto m) {
    backward_rows<decltype(s), decltype(m)>(q, dout, out, lse, sources, rows, sink_ptr, scale, group, dq, dsrc, dsinks,
                                            pmean);
  });
  std::vector<at::Tensor> result{dq};
  result.insert(result.end(), dsrc.begin(), dsrc.end());
  result.push_back(dsinks);
  result.push_back(pmean);
  return result;
}

// Which GEMM the kernels use for a query dtype: "amx" or "avx512bf16" (native half-precision
// products, fp32 sums) or "fp32".
std::string attention_gemm(const std::string& dtype) {
  const auto dt = dtype == "bfloat16" ? at::kBFloat16 : dtype == "float16" ? at::kHalf : at::kFloat;
  return dsattn_native::gemm_kind_name(dsattn_native::gemm_kind(dt));
}

// Test hook: the packed V layout written by pack_pair equals cpublas::pack's for a random bf16
// [K, N] matrix (K even, N <= 64: the widths cpublas::pack writes).  None where the CPU has no
// packed bf16 GEMM.
c10::optional<bool> packed_layout_matches(int64_t K, int64_t N) {
  if (!dsattn_native::cpu_runs_amx(at::kBFloat16)) return c10::nullopt;
  TORCH_CHECK(K % 2 == 0 && N % 16 == 0 && N <= 64, "K even, N a multiple of 16 up to 64");
  const auto B = at::randn({K, N}).to(at::kBFloat16).contiguous();
  const auto* b = reinterpret_cast<const uint16_t*>(B.data_ptr());
  std::vector<uint16_t> ours(K * N), theirs(K * N);
  pack_matrix(b, K, N, ours.data(), N);
  at::native::cpublas::pack(K, N, N, N, at::kBFloat16, at::kBFloat16, b, theirs.data());
  return ours == theirs;
}

// Test hook: C [M, N] = A [M, K] B [K, N] for random bf16 A, B through pack_pair's panels (up to
// PANEL columns each) and the 16-bit GEMM this process runs (AMX ukernel or the vdpbf16ps
// micro-kernel), as the forward's P V runs; returns the largest |C - C_ref| / (|A| |B|)_ij against an
// fp64 matmul of the same values.  None where bf16 runs the fp32 path.
c10::optional<double> packed_gemm_error(int64_t M, int64_t K, int64_t N) {
  if (!dsattn_native::packed_gemm(at::kBFloat16)) return c10::nullopt;
  const bool any_width = dsattn_native::gemm_kind(at::kBFloat16) == dsattn_native::KIND_AVX512BF16;
  TORCH_CHECK(K % 2 == 0 && (N % 16 == 0 || any_width), "K even, N a multiple of 16 (any N on the vdpbf16ps path)");
  TORCH_CHECK(M > 0 && N > 0 && K > 0, "M, N, K > 0");
  const auto A = at::randn({M, K}).to(at::kBFloat16).contiguous();
  const auto B = at::randn({K, N}).to(at::kBFloat16).contiguous();
  Buffer<uint16_t> packed(K * N);
  const int64_t panel = dsattn_native::wide_panel<at::BFloat16>();
  pack_matrix(reinterpret_cast<const uint16_t*>(B.data_ptr()), K, N, packed.data(), panel);
  auto C = at::empty({M, N}, at::kFloat);
  const auto* bp = reinterpret_cast<const at::BFloat16*>(packed.data());
  for (int64_t d0 = 0; d0 < N; d0 += panel) {
    const int64_t w = std::min(panel, N - d0);
    gemm(M, w, K, K, w, N, false, A.data_ptr<at::BFloat16>(), bp + d0 * K, C.data_ptr<float>() + d0, true);
  }
  dsattn_native::gemm_release<at::BFloat16>();
  const auto A64 = A.to(at::kDouble), B64 = B.to(at::kDouble);
  const auto bound = at::matmul(A64.abs(), B64.abs());
  return ((C.to(at::kDouble) - at::matmul(A64, B64)).abs() / bound).max().item<double>();
}

// test hook: the packed rows' fp8 decode against c10's conversion, all 256 codes
bool fp8_decode_matches() { return fp8_codes_match(); }

#else  // !DSATTN_HAVE_BRGEMM

std::vector<at::Tensor> sparse_attention_forward(const at::Tensor&, const std::vector<at::Tensor>&,
                                                 const std::vector<at::Tensor>&, const c10::optional<at::Tensor>&, double,
                                                 const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, bool,
                                                 const c10::optional<at::Tensor>&,
                                                 const std::vector<std::vector<int64_t>>&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "this torch has no cpublas::brgemm: the compiled attention is not available");
}
std::vector<at::Tensor> sparse_attention_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, const std::vector<at::Tensor>&,
                                                  const std::vector<at::Tensor>&, const c10::optional<at::Tensor>&,
                                                  double, const c10::optional<at::Tensor>&,
                                                  const c10::optional<at::Tensor>&, const std::vector<at::Tensor>&) {
  TORCH_CHECK(false, "this torch has no cpublas::brgemm: the compiled attention is not available");
}
bool fp8_decode_matches() { return false; }
std::string attention_gemm(const std::string&) { return "unavailable"; }
c10::optional<bool> packed_layout_matches(int64_t, int64_t) { return c10::nullopt; }
c10::optional<double> packed_gemm_error(int64_t, int64_t, int64_t) { return c10::nullopt; }

#endif
