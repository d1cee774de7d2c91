// Lightning-indexer top-k on the CPU (issue 15): for every query row t, the scores
//   score[t, j] = sum_h w[t, h] * relu(q[t, h] . k_b[j]),   j < n[t]
// against the keys of its request b, and the best topk of them in
// the golden's order (score descending, ties to the lower key; dsattn/indexer/ref.py).  The dot
// products are exact products of the half-precision inputs summed in fp32, as the golden's.
//
// Rows of one request share its keys.  A run of SHARED_ROWS or more (a prefill) is scored in blocks
// of rows: each block of KEY_BLOCK keys is packed once as the GEMM's B operand (K^T: [Dp/2][w][2]
// panels for the oneDNN ukernel where the CPU multiplies bf16 / fp16 natively, plain fp32
// otherwise) and every row's query is the A operand as it lies: C [H, keys] = q_t K^T, summed over
// heads in vertical adds.  A lone row (decode) reads its keys once, so packing them would double
// its traffic: its q^T is packed instead and the keys are the A operand straight from the cache,
// CHUNK at a time: C [keys, Hp] = k q^T.  No [rows, keys]
// score buffer exists: each chunk's scores are filtered against the row's running k-th best and
// only candidates that beat it are kept (fewer than 2 topk + CHUNK per row), so memory is
// O(threads x ROW_BLOCK x topk) plus one packed key block per thread, whatever the context length.
// The candidates stay in key order; a radix selection trims them to the best topk when they reach
// 2 topk, and one stable radix sort by score orders them at the end (ties: lower key first).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include "common.h"
#if DSATTN_X86
#include <immintrin.h>
#endif
#include "fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if DSATTN_HAVE_BRGEMM

namespace {

using dsattn_native::gemm;
using dsattn_native::gemm_release;

constexpr int64_t CHUNK = 128;  // keys per chunk: a unit of the running top-k (and the shared path's fp32 scores)
// A decode row streams its keys from memory as the GEMM's A operand.  AMX tile loads that miss the
// caches wait one after another (the ukernel's hot spots are its key tile loads), so the chunk's
// GEMM runs in slices of SLICE keys and each slice's rows are first prefetched into L2 all at once:
// the misses then overlap.  B 32 x 32K keys (V4's indexer at 128K), both cores, runs interleaved:
// 20.2-20.9 ms in whole chunks, 19.1 in slices without the prefetch, 16.8-17.3 with it; slices of
// 16 / 64 / 128 keys: 20.5 / 18.3 / 19.7; prefetching a slice or more ahead: 22-24 (slower).  A slice's
// fp32 products [SLICE, Hp] (8 KB at 64 heads) are summed over heads right after its GEMM, while in L1.
constexpr int64_t SLICE = 32;
// A call of one row (a one-request decode) with at least this many keys splits them over the threads.
constexpr int64_t SPLIT_KEYS = 1024;
// Runs of at least SHARED_ROWS rows of one request (a prefill) take the shared-key path, in blocks of
// up to ROW_BLOCK rows over KEY_BLOCK keys at a time (packed once per block: 256 KB at D 128 bf16).
constexpr int64_t SHARED_ROWS = 8;
constexpr int64_t ROW_BLOCK = 64;
constexpr int64_t KEY_BLOCK = 1024;
using dsattn_native::PANEL;
using dsattn_native::round_up;

// ---- the head sum: score[key] = sum_h w[h] * relu(c[key, h]) ----
//
// One order of operations on every path, so that a row's scores never depend on which path its
// batch sends it down (a request alone, or in a run of rows long enough for the shared-key path),
// on where a key falls in a block, or on the vector width.  Heads are padded to Hp (a multiple of
// 16; padded heads have w = 0 and score 0).  Lane l (0..15) accumulates heads l, l + 16, l + 32, ...
// in order, one fused multiply-add each from +0; the 16 lanes are then summed in the fixed tree
//   S_G = (p[4G] + p[4G+2]) + (p[4G+1] + p[4G+3]),  total = (S_0 + S_1) + (S_2 + S_3),
// which is what lane_sums16 computes for 16 keys at once in key-major layout.  relu(x) is
// max(0, x) with x kept when NaN (as torch), and -0.0 kept as -0.0.

inline float relu_keep_nan(float x) { return x > 0.0f || x != x ? x : (x == 0.0f ? x : 0.0f); }

inline float tree16(const float* p) {
  float s[4];
  for (int g = 0; g < 4; ++g) s[g] = (p[4 * g] + p[4 * g + 2]) + (p[4 * g + 1] + p[4 * g + 3]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

#if DSATTN_X86
// The lane sums of 16 vectors as one vector: lane j holds tree16 of v[j]'s lanes.  A tree of
// shuffles and adds (45 instructions) where 16 separate horizontal sums would take about 130.
__attribute__((target("avx512f"))) inline __m512 lane_sums16(__m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)      // per 128-bit lane: elements e + e+2 of rows 2i, 2i + 1 interleaved
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {    // per 128-bit lane: (e0 + e2) + (e1 + e3) of rows 4i .. 4i + 3
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)      // 128-bit lanes: S_0 + S_1 and S_2 + S_3
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// Key-major scores c [M, Hp] (the one-row path): 16 keys at a time, a lane vector per key.
__attribute__((target("avx512f"))) void head_sum_keys_avx512(const float* c, int64_t M, int64_t Hp, const float* w,
                                                             float* out) {
  const __m512 zero = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= M; j += 16) {         // (a fixed count: the 16 accumulators stay in registers)
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = zero;
    for (int64_t h = 0; h < Hp; h += 16) {
      const __m512 wh = _mm512_loadu_ps(w + h);
      for (int r = 0; r < 16; ++r)       // MAXPS returns its second operand for NaN (and for -0.0)
        acc[r] = _mm512_fmadd_ps(_mm512_max_ps(zero, _mm512_loadu_ps(c + (j + r) * Hp + h)), wh, acc[r]);
    }
    _mm512_storeu_ps(out + j, lane_sums16(acc));
  }
  if (j < M) {                           // the last keys: the same steps, missing keys left at zero
    const int64_t keys = M - j;
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = zero;
    for (int64_t h = 0; h < Hp; h += 16) {
      const __m512 wh = _mm512_loadu_ps(w + h);
      for (int r = 0; r < keys; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_max_ps(zero, _mm512_loadu_ps(c + (j + r) * Hp + h)), wh, acc[r]);
    }
    _mm512_mask_storeu_ps(out + j, __mmask16((1u << keys) - 1), lane_sums16(acc));
  }
}

// Head-major scores c [H, ldc] (the shared-key path): 16 keys per vector, a vector per lane.
__attribute__((target("avx512f"))) void head_sum_heads_avx512(const float* c, int64_t H, int64_t ldc, int64_t n,
                                                              const float* w, float* out) {
  const __m512 zero = _mm512_setzero_ps();
  const int64_t Hp = round_up(H, 16);
  const int64_t Hfull = H / 16 * 16;
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    __m512 p[16];
    for (int l = 0; l < 16; ++l) p[l] = zero;
    if (m == 0xFFFF) {
      for (int64_t h0 = 0; h0 < Hfull; h0 += 16)
        for (int l = 0; l < 16; ++l)
          p[l] = _mm512_fmadd_ps(_mm512_max_ps(zero, _mm512_loadu_ps(c + (h0 + l) * ldc + j)), _mm512_set1_ps(w[h0 + l]),
                                 p[l]);
    } else {
      for (int64_t h0 = 0; h0 < Hfull; h0 += 16)
        for (int l = 0; l < 16; ++l)
          p[l] = _mm512_fmadd_ps(_mm512_max_ps(zero, _mm512_maskz_loadu_ps(m, c + (h0 + l) * ldc + j)),
                                 _mm512_set1_ps(w[h0 + l]), p[l]);
    }
    if (Hfull < Hp)
      for (int l = 0; l < 16; ++l) {
        const int64_t h = Hfull + l;     // a padded head adds max(0, +0) * 0 = +0, as in key-major
        const __m512 x = h < H ? _mm512_maskz_loadu_ps(m, c + h * ldc + j) : zero;
        p[l] = _mm512_fmadd_ps(_mm512_max_ps(zero, x), _mm512_set1_ps(h < H ? w[h] : 0.0f), p[l]);
      }
    __m512 s[4];
    for (int g = 0; g < 4; ++g)
      s[g] = _mm512_add_ps(_mm512_add_ps(p[4 * g], p[4 * g + 2]), _mm512_add_ps(p[4 * g + 1], p[4 * g + 3]));
    _mm512_mask_storeu_ps(out + j, m, _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3])));
  }
}
#endif

// Without AVX-512: the same lanes and tree, one key at a time (fma() is the same fused step).
void head_sum_keys_scalar(const float* c, int64_t M, int64_t Hp, const float* w, float* out) {
  for (int64_t j = 0; j < M; ++j) {
    float p[16] = {};
    for (int64_t h = 0; h < Hp; ++h) p[h % 16] = std::fma(relu_keep_nan(c[j * Hp + h]), w[h], p[h % 16]);
    out[j] = tree16(p);
  }
}

void head_sum_heads_scalar(const float* c, int64_t H, int64_t ldc, int64_t n, const float* w, float* out) {
  const int64_t Hp = round_up(H, 16);
  for (int64_t j = 0; j < n; ++j) {
    float p[16] = {};
    for (int64_t h = 0; h < Hp; ++h)
      p[h % 16] = std::fma(h < H ? relu_keep_nan(c[h * ldc + j]) : 0.0f, h < H ? w[h] : 0.0f, p[h % 16]);
    out[j] = tree16(p);
  }
}

using HeadSumKeys = void (*)(const float*, int64_t, int64_t, const float*, float*);
using HeadSumHeads = void (*)(const float*, int64_t, int64_t, int64_t, const float*, float*);

// out[j] = sum_h w[h] * relu(c[j, h]) over Hp heads, c key-major [M, Hp] (w zero past the real heads)
void head_sum_keys(const float* c, int64_t M, int64_t Hp, const float* w, float* out) {
  static const HeadSumKeys fn =
#if DSATTN_X86
      dsattn_native::isa_has(dsattn_native::ISA_AVX512) ? head_sum_keys_avx512 :
#endif
      head_sum_keys_scalar;
  fn(c, M, Hp, w, out);
}

// out[j] = sum_h w[h] * relu(c[h, j]) for j < n over H rows of c (row stride ldc): the same bits
void head_sum_by_rows(const float* c, int64_t H, int64_t ldc, int64_t n, const float* w, float* out) {
  static const HeadSumHeads fn =
#if DSATTN_X86
      dsattn_native::isa_has(dsattn_native::ISA_AVX512) ? head_sum_heads_avx512 :
#endif
      head_sum_heads_scalar;
  fn(c, H, ldc, n, w, out);
}

// Test hook: both layouts give the same bits, on every implementation this CPU runs, for keys
// of random scores (NaN, -0.0, ties included) with H heads.
bool head_sums_match(int64_t H, int64_t n) {
  const int64_t Hp = round_up(H, 16);
  std::vector<float> keys(n * Hp, 0.0f), heads(H * n), w(Hp, 0.0f), want(n), got(n);
  uint32_t state = 12345u + uint32_t(H * 31 + n);
  auto next = [&] { state = state * 1664525u + 1013904223u; return float(int32_t(state >> 8) - (1 << 23)) / (1 << 20); };
  for (int64_t h = 0; h < H; ++h) w[h] = next();
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < H; ++h) {
      float x = next();
      if ((j * 7 + h) % 29 == 0) x = -0.0f;
      if ((j * 5 + h) % 97 == 3) x = std::numeric_limits<float>::quiet_NaN();
      keys[j * Hp + h] = heads[h * n + j] = x;
    }
  std::vector<HeadSumKeys> key_fns{head_sum_keys_scalar};
  std::vector<HeadSumHeads> head_fns{head_sum_heads_scalar};
#if DSATTN_X86
  if (dsattn_native::isa_has(dsattn_native::ISA_AVX512)) key_fns.push_back(head_sum_keys_avx512), head_fns.push_back(head_sum_heads_avx512);
#endif
  head_sum_keys_scalar(keys.data(), n, Hp, w.data(), want.data());
  auto same = [&] { return std::memcmp(want.data(), got.data(), n * sizeof(float)) == 0; };
  bool ok = true;
  for (auto f : key_fns) f(keys.data(), n, Hp, w.data(), got.data()), ok = ok && same();
  for (auto f : head_fns) f(heads.data(), H, n, n, w.data(), got.data()), ok = ok && same();
  return ok;
}

// The golden's order as one unsigned key: scores descending (NaN first, as torch.topk ranks it),
// then the lower key index; sorting keys ascending sorts candidates in that order.
inline uint64_t order_key(float v, int64_t i) {
  const uint32_t u = __builtin_bit_cast(uint32_t, v);
  const uint32_t ascending = v != v ? 0xFFFFFFFFu : (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(~ascending) << 32) | static_cast<uint32_t>(i);
}
inline float order_value(uint64_t key) {
  const uint32_t ascending = ~static_cast<uint32_t>(key >> 32);
  return __builtin_bit_cast(float, (ascending & 0x80000000u) ? (ascending & 0x7FFFFFFFu) : ~ascending);
}

// The k-th smallest (k >= 1) of n distinct keys, by most-significant-digit radix selection.  Each
// round takes the 8 bits below the highest bit in which the remaining keys differ (the top bits of
// a row's scores are nearly all alike: a fixed digit would put most keys in one bucket), counts
// them, and keeps only the bucket that holds the k-th (copied to ``scratch``, which must hold n).
// Nothing branches on the data, where a comparison selection (std::nth_element) of random scores
// mispredicts about every other compare.
uint64_t kth_smallest(const uint64_t* a, size_t n, size_t k, uint64_t* scratch) {
  const uint64_t* cur = a;
  size_t m = n;
  while (true) {
    uint64_t lo = cur[0], hi = cur[0];
    for (size_t i = 1; i < m; ++i) lo = std::min(lo, cur[i]), hi = std::max(hi, cur[i]);
    if (k == 1 || k == m) return k == 1 ? lo : hi;
    if (m <= 32) {                                        // a few left: a comparison selection is cheaper
      if (cur != scratch) std::copy(cur, cur + m, scratch);
      std::nth_element(scratch, scratch + (k - 1), scratch + m);
      return scratch[k - 1];
    }
    const int shift = std::max(0, 63 - __builtin_clzll(lo ^ hi) - 7);
    // two interleaved histograms: keys that share a digit do not wait on each other's increment
    uint32_t count[2][256] = {};
    size_t i = 0;
    for (; i + 1 < m; i += 2) ++count[0][(cur[i] >> shift) & 0xFF], ++count[1][(cur[i + 1] >> shift) & 0xFF];
    if (i < m) ++count[0][(cur[i] >> shift) & 0xFF];
    uint32_t d = 0;
    while (k > count[0][d] + count[1][d]) k -= count[0][d] + count[1][d], ++d;
    size_t w = 0;
    for (size_t j = 0; j < m; ++j) {                      // (in place when cur is scratch: w <= j)
      const uint64_t x = cur[j];
      scratch[w] = x;
      w += ((x >> shift) & 0xFF) == d;
    }
    cur = scratch, m = w;
  }
}

// Keeps the keys <= bar of a[0, n), in their order; returns how many.
size_t keep_up_to(uint64_t* a, size_t n, uint64_t bar) {
  size_t w = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t x = a[i];
    a[w] = x;
    w += x <= bar;
  }
  return w;
}

// Sorts a[0, n) by the high 32 bits of its keys (the score's order), stably: keys that tie there keep
// their order.  Least-significant-digit radix sort over the 8-bit digits in which the keys differ,
// every histogram taken in one pass; ``tmp`` holds n.  Returns where the sorted keys are (a or tmp).
uint64_t* sort_by_score(uint64_t* a, size_t n, uint64_t* tmp) {
  if (n < 2) return a;
  uint32_t diff = 0;
  const uint32_t first = static_cast<uint32_t>(a[0] >> 32);
  uint32_t count[4][256] = {};
  for (size_t i = 0; i < n; ++i) {
    const uint32_t h = static_cast<uint32_t>(a[i] >> 32);
    diff |= h ^ first;
    ++count[0][h & 0xFF], ++count[1][(h >> 8) & 0xFF], ++count[2][(h >> 16) & 0xFF], ++count[3][h >> 24];
  }
  for (int digit = 0; digit < 4; ++digit) {
    if (((diff >> (8 * digit)) & 0xFF) == 0) continue;    // every key has this digit: the order stands
    const int shift = 32 + 8 * digit;
    uint32_t at = 0;
    for (uint32_t& c : count[digit]) {
      const uint32_t m = c;
      c = at;
      at += m;
    }
    for (size_t i = 0; i < n; ++i) tmp[count[digit][(a[i] >> shift) & 0xFF]++] = a[i];
    std::swap(a, tmp);
  }
  return a;
}

// Appends to out the order keys of the scores[j] (keys first + j) that enter: all of them when
// ``open``, else those with a score strictly greater than ``bar`` or a NaN over a number bar;
// returns how many it appended.  Stores one key per score past the count (out has room for count).
size_t enter_scalar(const float* scores, int64_t count, int64_t first, float bar, bool open, uint64_t* out) {
  size_t size = 0;
  for (int64_t j = 0; j < count; ++j) {           // written without a branch, counted if it enters
    const float v = scores[j];
    out[size] = order_key(v, first + j);
    size += open || v > bar || (v != v && bar == bar);
  }
  return size;
}

#if DSATTN_X86
// The same 16 scores at a time: one compare gives the lanes that enter (none, in most chunks once the
// bar has risen), and their keys are built and compress-stored in order.  A scalar append costs a
// dependent store per score: 3.5 of 10.8 ms of a B 32 x 32K decode with its keys in cache.
__attribute__((target("avx512f"))) size_t enter_avx512(const float* scores, int64_t count, int64_t first, float bar,
                                                       bool open, uint64_t* out) {
  const __m512 bars = _mm512_set1_ps(bar);
  const bool bar_is_nan = bar != bar;
  const __m512i ones = _mm512_set1_epi32(-1), sign = _mm512_set1_epi32(INT32_MIN);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  size_t size = 0;
  int64_t j = 0;
  for (; j + 16 <= count; j += 16) {
    const __m512 v = _mm512_loadu_ps(scores + j);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 in = open ? __mmask16(0xFFFF)
                              : __mmask16(_mm512_cmp_ps_mask(v, bars, _CMP_GT_OQ) | (bar_is_nan ? 0 : nan));
    if (in == 0) continue;
    // order_key: the score's ascending bits (NaN: all ones), complemented, over the key index
    const __m512i u = _mm512_castps_si512(v);
    __m512i ascending = _mm512_mask_mov_epi32(_mm512_or_si512(u, sign), _mm512_test_epi32_mask(u, sign),
                                              _mm512_xor_si512(u, ones));
    ascending = _mm512_mask_mov_epi32(ascending, nan, ones);
    const __m512i high = _mm512_xor_si512(ascending, ones);
    const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first + j)), lanes);
    for (int half = 0; half < 2; ++half) {
      const __mmask8 m = static_cast<__mmask8>(in >> (8 * half));
      const __m256i h = half ? _mm512_extracti64x4_epi64(high, 1) : _mm512_castsi512_si256(high);
      const __m256i i = half ? _mm512_extracti64x4_epi64(index, 1) : _mm512_castsi512_si256(index);
      const __m512i keys = _mm512_or_si512(_mm512_slli_epi64(_mm512_cvtepu32_epi64(h), 32), _mm512_cvtepu32_epi64(i));
      _mm512_mask_compressstoreu_epi64(out + size, m, keys);
      size += __builtin_popcount(m);
    }
  }
  return size + enter_scalar(scores + j, count - j, first + j, bar, open, out + size);
}
#endif

using Enter = size_t (*)(const float*, int64_t, int64_t, float, bool, uint64_t*);
Enter enter() {
  static const Enter fn =
#if DSATTN_X86
      dsattn_native::isa_has(dsattn_native::ISA_AVX512) ? enter_avx512 :
#endif
      enter_scalar;
  return fn;
}

// The best k of a stream of keys arriving in ascending key order.  The candidates stay in that
// order (selection keeps order), so the final sort orders them by score alone: ties stay lowest
// key first, the golden's rule.
class RunningTopK {
 public:
  explicit RunningTopK(int64_t k) : k_(k), cand_(2 * k + CHUNK), tmp_(2 * k + CHUNK + 1) {}
  void reset() { size_ = 0, bar_ = ~uint64_t(0); }

  // scores of keys first, first + 1, ...: a key enters only if it goes before the k-th so far;
  // every key here is higher than those kept, so only a strictly greater score (or a NaN over a
  // number) does
  void add(const float* scores, int64_t count, int64_t first) {
    const bool open = bar_ == ~uint64_t(0);
    const float bv = order_value(bar_);
    uint64_t* out = cand_.data();
    size_ += enter()(scores, count, first, bv, open, out + size_);   // size_ < 2 k: room for count <= CHUNK more
    if (size_ >= size_t(2 * k_) || (open && size_ >= size_t(k_))) {   // back to the best k; the k-th is the new bar
      bar_ = kth_smallest(out, size_, k_, tmp_.data());
      size_ = keep_up_to(out, size_, bar_);
    }
  }

  // back to the best k, if more are kept
  void trim() {
    if (size_ > size_t(k_)) {
      bar_ = kth_smallest(cand_.data(), size_, k_, tmp_.data());
      size_ = keep_up_to(cand_.data(), size_, bar_);
    }
  }

  // ``other``'s kept keys (a selection over higher keys than this one's) appended: both cut to their best k
  // first, so the union (at most 2 k) fits and holds the best k of the two; ties still go to the lower key,
  // since the sort in write() is stable and this one's keys come first
  void absorb(RunningTopK& other) {
    trim(), other.trim();
    std::copy(other.cand_.begin(), other.cand_.begin() + other.size_, cand_.begin() + size_);
    size_ += other.size_;
  }

  // the kept keys in order: values (-inf past the count) and key indices plus ``offset`` (-1 past it)
  void write(float* values, int32_t* indices, int64_t offset) {
    uint64_t* a = cand_.data();
    const uint64_t* sorted = sort_by_score(a, size_, tmp_.data());
    const int64_t m = std::min(static_cast<int64_t>(size_), k_);
    for (int64_t j = 0; j < k_; ++j) {
      values[j] = j < m ? order_value(sorted[j]) : -std::numeric_limits<float>::infinity();
      indices[j] = j < m ? static_cast<int32_t>(static_cast<int64_t>(static_cast<uint32_t>(sorted[j])) + offset) : -1;
    }
  }

 private:
  int64_t k_;
  dsattn_native::Buffer<uint64_t> cand_, tmp_;
  size_t size_ = 0;
  uint64_t bar_ = ~uint64_t(0);
};

// ---- quantised keys (quant_lightning_indexer) ----
//
// Token r of a quantised pool: D codes (int8 or fp8 e4m3fn) and one fp32 scale, read where they lie
// (block r / bs, slot r % bs; strides in bytes for the codes, in floats for the scales).  The codes are
// decoded to their exact values as GEMM operands (int8 and e4m3 values are exact in bf16, fp16 and
// fp32), so the GEMM gives the code products summed in fp32; the scales then multiply each score
// before the relu: c[key, h] *= q_scale[h] * k_scale[key].
struct QuantKeys {
  const uint8_t* values;
  const float* scales;
  int64_t bs, value_block, value_row, scale_block, scale_row;
  bool fp8;
  const uint8_t* codes(int64_t r) const { return values + (r / bs) * value_block + (r % bs) * value_row; }
  const float* scale_at(int64_t r) const { return scales + (r / bs) * scale_block + (r % bs) * scale_row; }
  // from key r to key r + 1 of one chunk (the chunks of a row never leave a block; with one key per block,
  // as TND keys are, consecutive keys are consecutive blocks): one division per chunk, not two per key
  int64_t code_step() const { return bs == 1 ? value_block : value_row; }
  int64_t scale_step() const { return bs == 1 ? scale_block : scale_row; }
};

inline float code_value(uint8_t c, bool fp8) {
  return fp8 ? dsattn_native::fp8_e4m3fn_float(c) : static_cast<float>(static_cast<int8_t>(c));
}

// A code's bf16 bits: its fp32 value's top half, exact (an int8 or e4m3 value has at most 8 significant
// bits).  Not c10's float -> bf16 conversion: that rounds, and writes every NaN as 0x7FC0, where each
// vector decode keeps the sign of code 0xFF (0xFFC0).
inline uint16_t code_bf16_bits(uint8_t c, bool fp8) {
  return static_cast<uint16_t>(__builtin_bit_cast(uint32_t, code_value(c, fp8)) >> 16);
}

#if DSATTN_X86
// 32 fp8 e4m3fn codes at a time to bf16, in 16-bit lanes: a normal code's exponent is rebiased by 120
// and its 3 mantissa bits move up by 4; a subnormal one (m x 2^-9, m < 8) is looked up; 0x7F is NaN.
__attribute__((target("avx512f,avx512bw"))) void fp8_codes_bf16_avx512(const uint8_t* x, int64_t n, uint16_t* out) {
  const __m512i low7 = _mm512_set1_epi16(0x7F), bias = _mm512_set1_epi16(120 << 7), eight = _mm512_set1_epi16(8),
                nan = _mm512_set1_epi16(0x7FC0), sign = _mm512_set1_epi16(0x80);
  // bf16 of m x 2^-9 for m = 0 .. 7 (lanes 8 .. 31 unused)
  const __m512i sub = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                       0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0);
  int64_t d = 0;
  for (; d + 32 <= n; d += 32) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + d)));
    const __m512i em = _mm512_and_si512(b, low7);
    __m512i v = _mm512_add_epi16(_mm512_slli_epi16(em, 4), bias);
    v = _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(em, eight), v, _mm512_permutexvar_epi16(em, sub));
    v = _mm512_mask_blend_epi16(_mm512_cmpeq_epi16_mask(em, low7), v, nan);
    v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(b, sign), 8));
    _mm512_storeu_si512(out + d, v);
  }
  for (; d < n; ++d) out[d] = code_bf16_bits(x[d], true);
}

// Rows of fp8 codes to bf16 by table (fp8x64_bf16_vbmi): ``rows`` rows of n codes each (row r at
// x + r * x_step, written at out + r * out_step).
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) void fp8_rows_bf16_vbmi(const uint8_t* x, int64_t x_step,
                                                                             int64_t rows, int64_t n, uint16_t* out,
                                                                             int64_t out_step) {
  const dsattn_native::Fp8Bf16Tables& tables = dsattn_native::fp8_bf16_tables();
  for (int64_t r = 0; r < rows; ++r, x += x_step, out += out_step) {
    int64_t d = 0;
    for (; d + 64 <= n; d += 64) dsattn_native::fp8x64_bf16_vbmi(x + d, out + d, tables);
    if (d < n) fp8_codes_bf16_avx512(x + d, n - d, out + d);
  }
}

void fp8_codes_bf16_vbmi(const uint8_t* x, int64_t n, uint16_t* out) { fp8_rows_bf16_vbmi(x, n, 1, n, out, n); }
#endif

bool cpu_has_avx512vbmi() { return dsattn_native::isa_has_avx512vbmi(); }

// The next rows of FP8 codes decoded to bf16 while a GEMM tile multiplies the current ones: the side work
// of dsattn's micro-kernel (dpbf16_gemm), one group of 64 codes every DECODE_EVERY K steps.  The byte
// permutes run beside the vdpbf16ps stream instead of between GEMMs: Zen 4, one core, 8K keys x 128 x 64
// heads in cache, ns per key: the GEMM on bf16 keys 71.6, each slice decoded then multiplied 77.4, decoded
// during the previous slice's GEMM 72.2 (a group every 2 or 4 K steps; every step 75.8, every 8th 73.5).
//
// Between the decodes it prefetches the next chunk's code rows into L2 (``ahead``), so that no loop of
// prefetches runs on its own either (one per chunk took a fifth of the walk's time outside the GEMM).
struct RowPrefetch {
  const char* at = nullptr;
  int64_t step = 0, rows = 0, lines = 1;    // rows of ``lines`` cache lines, ``step`` bytes apart
  __attribute__((always_inline)) void one() {
    for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(at + 64 * l, 0, 2);     // (x86: prefetcht1)
    at += step, --rows;
  }
  void finish() {
    while (rows > 0) one();
  }
};

struct Fp8RowDecode {
  static constexpr int64_t DECODE_EVERY = 4;
  const uint8_t* src = nullptr;
  uint16_t* dst = nullptr;
  int64_t src_skip = 0, dst_skip = 0;       // from a row's end to the next row's start
  int64_t groups_per_row = 1, part = 0, left = 0;
  const dsattn_native::Fp8Bf16Tables* tables = nullptr;
  RowPrefetch ahead;

  // rows [0, rows) of n = 64 x groups codes each, row r at src + r * src_step, into dst + r * dst_step
  static Fp8RowDecode rows(const uint8_t* src, int64_t src_step, uint16_t* dst, int64_t dst_step, int64_t rows,
                           int64_t n) {
    Fp8RowDecode d;
    d.src = src, d.dst = dst, d.src_skip = src_step - n, d.dst_skip = dst_step - n;
    d.groups_per_row = n / 64, d.left = rows * (n / 64);
    d.tables = &dsattn_native::fp8_bf16_tables();
    return d;
  }

  DSATTN_TARGET("avx512f,avx512bw,avx512vbmi") __attribute__((always_inline)) void one() {
#if DSATTN_X86
    dsattn_native::fp8x64_bf16_vbmi(src, dst, *tables);
#else   // (never run: the side work of the x86 micro-kernel only; the same bits)
    for (int64_t i = 0; i < 64; ++i) dst[i] = code_bf16_bits(src[i], true);
#endif
    src += 64, dst += 64, --left;
    if (++part == groups_per_row) part = 0, src += src_skip, dst += dst_skip;
  }
  DSATTN_TARGET("avx512f,avx512bw,avx512vbmi") __attribute__((always_inline)) void step(int64_t kp) {
    if (kp % DECODE_EVERY == 0 && left > 0) one();
    if (kp % DECODE_EVERY == DECODE_EVERY / 2 && ahead.rows > 0) ahead.one();
  }
  // what the tiles' K steps left
  DSATTN_TARGET("avx512f,avx512bw,avx512vbmi") void finish() {
    while (left > 0) one();
  }
};

#if DSATTN_X86
// 32 int8 codes at a time to bf16 (exact: |code| <= 128 has at most 8 significant bits)
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void int8_codes_bf16_avx512(const uint8_t* x, int64_t n,
                                                                                   uint16_t* out) {
  int64_t d = 0;
  for (; d + 32 <= n; d += 32) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + d))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + d + 16))));
    _mm512_storeu_si512(out + d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  for (; d < n; ++d) out[d] = code_bf16_bits(x[d], false);
}
#endif

template <typename mm_t>
void decode_codes(const uint8_t* x, int64_t n, bool fp8, mm_t* out) {
  if constexpr (std::is_same_v<mm_t, c10::BFloat16>) {
#if DSATTN_X86
    const bool bw = dsattn_native::cpu_has_avx512bw();
    const bool bf16 = dsattn_native::isa_has(dsattn_native::ISA_AVX512_BF16);
    if (fp8 && cpu_has_avx512vbmi()) return fp8_codes_bf16_vbmi(x, n, reinterpret_cast<uint16_t*>(out));
    if (fp8 && bw) return fp8_codes_bf16_avx512(x, n, reinterpret_cast<uint16_t*>(out));
    if (!fp8 && bf16) return int8_codes_bf16_avx512(x, n, reinterpret_cast<uint16_t*>(out));
#endif
    auto* bits = reinterpret_cast<uint16_t*>(out);
    for (int64_t d = 0; d < n; ++d) bits[d] = code_bf16_bits(x[d], fp8);
    return;
  }
  if constexpr (std::is_same_v<mm_t, float>) {
    if (fp8) return dsattn_native::dequant_tile_fp8(x, n, 1.0f, out);
  }
  for (int64_t d = 0; d < n; ++d) out[d] = static_cast<mm_t>(code_value(x[d], fp8));
}

// The scales on the code products.  With scales >= 0 (what every quantiser writes: amax / qmax) the
// relu commutes with them: score[key] = k_scale[key] * sum_h (w[h] q_scale[h]) relu(c[key, h]), one
// multiply per key, the head weights folded once per row.  A chunk with a negative (or NaN) scale takes
// them per score, relu(q_scale[h] * k_scale[key] * c[key, h]).  Either way one fp32 product and one
// multiply per score or key in both score layouts, so a row's scores do not depend on the path it takes.
inline bool all_non_negative(const float* s, int64_t n) {
  int32_t other = 0;                     // (a count, not a bool: GCC vectorises the compares)
  for (int64_t i = 0; i < n; ++i) other += !(s[i] >= 0.0f);
  return other == 0;
}

void scale_key_major(float* c, int64_t M, int64_t Hp, const float* ks, const float* qs) {
  for (int64_t j = 0; j < M; ++j)
    for (int64_t h = 0; h < Hp; ++h) c[j * Hp + h] *= qs[h] * ks[j];
}

void scale_head_major(float* c, int64_t H, int64_t ldc, int64_t n, const float* ks, const float* qs) {
  for (int64_t h = 0; h < H; ++h)
    for (int64_t j = 0; j < n; ++j) c[h * ldc + j] *= qs[h] * ks[j];
}

struct KeyPages {                 // where key j of a request lives in the flat key rows
  const int64_t* pages;           // [B, P]: flat row of each page's first key
  int64_t per_batch, page;
  int64_t row(int64_t b, int64_t j) const { return pages[b * per_batch + j / page] + j % page; }
};

// Keys: float rows kr [Nk, D] of q's dtype, or (kr null) the quantised pool ``quant`` with the query's
// per-head scales ``qscale`` [R, H] (null: 1).
template <typename scalar_t, typename mm_t>
void topk_rows(const at::Tensor& q, const scalar_t* kr, int64_t Nk, const QuantKeys* quant, const float* qscale,
               const KeyPages& kp, const at::Tensor& batch, const at::Tensor& n, const at::Tensor& w,
               const int64_t* offset, at::Tensor& values, at::Tensor& indices) {
  constexpr bool packed = !std::is_same_v<mm_t, float>;
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), k = values.size(1);
  const int64_t Hp = round_up(H, 16), Dp = round_up(D, 16);
  // Key rows as GEMM operands: as they lie, or (fp32 GEMMs on half-precision keys, a head dim that is
  // not a multiple of 16: the packed ukernel faults on an odd K) widened / zero-padded a chunk at a
  // time as they are read (a whole widened copy would read and write the cache twice per call).
  const bool rows_direct = quant == nullptr && std::is_same_v<scalar_t, mm_t> && D == Dp;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const float* wp = w.data_ptr<float>();
  const int64_t* bp = batch.data_ptr<int64_t>();
  const int64_t* np = n.data_ptr<int64_t>();
  float* vp = values.data_ptr<float>();
  int32_t* ip = indices.data_ptr<int32_t>();
  const int64_t words = Dp * static_cast<int64_t>(sizeof(mm_t)) / 4;   // 32-bit words per key row of ka
  // FP8 keys on dsattn's AVX512-BF16 micro-kernel with VBMI: a decode row's key codes are decoded as side work of
  // the GEMM (Fp8RowDecode), a slice ahead, rather than before each slice's GEMM
  const bool fused_decode = std::is_same_v<mm_t, c10::BFloat16> && quant != nullptr && quant->fp8 && D % 64 == 0 &&
                            cpu_has_avx512vbmi() &&
                            dsattn_native::gemm_kind(at::kBFloat16) == dsattn_native::KIND_AVX512BF16;
  // One request's decode row with many keys (a call of one row) is split over the threads by its keys: each
  // part, from a chunk boundary of the whole row's walk, keeps its own running selection and the parts are
  // merged.  Every key's score is the same whichever part computes it (the same chunks, the same slices),
  // so the result is the one-thread result, bit for bit.
  const int64_t threads = at::get_num_threads();
  const bool split = R == 1 && threads > 1 && np[0] >= SPLIT_KEYS;
  std::vector<int64_t> part_at;                      // the parts' first keys, then the row's key count
  std::vector<RunningTopK> partial;
  if (split) {
    const int64_t boundary = std::min(CHUNK, kp.page);
    for (int64_t p = 0; p < threads; ++p) {
      const int64_t j = np[0] * p / threads;
      part_at.push_back(j - (j % kp.page) % boundary);     // back to a chunk boundary of the sequential walk
    }
    part_at.push_back(np[0]);
    partial.reserve(threads);
    for (int64_t p = 0; p < threads; ++p) partial.emplace_back(k);
  }
  // a row's cost: its keys, plus about 64 keys' worth for its query and its top-k
  auto work = [&](int64_t t0, int64_t t1, int64_t part) {
    dsattn_native::Buffer<mm_t> qb(Dp * Hp);
    dsattn_native::Buffer<float> c(CHUNK * Hp), score(CHUNK), wpad(Hp, 0.0f);
    // running selections: one for rows taken alone, one per row of a shared-key block (made when a block first
    // needs them: each holds 2 (2 topk + CHUNK) keys, 18 KB at top-512, and most calls are decode rows)
    std::vector<RunningTopK> best;
    best.reserve(ROW_BLOCK);
    best.emplace_back(k);
    auto selections = [&](int64_t rows) {
      while (static_cast<int64_t>(best.size()) < rows) best.emplace_back(k);
    };
    dsattn_native::Buffer<mm_t> panels, qa;                // (the shared path's, sized on first use)
    std::vector<int64_t> chunk_at, chunk_n;
    // (where the decode runs beside the GEMM: two slices' rows, the one multiplied and the next one decoded)
    dsattn_native::Buffer<mm_t> widened(rows_direct ? 0 : fused_decode ? 2 * SLICE * Dp : CHUNK * Dp, mm_t(0));
    // quantised keys: the chunk's key scales, the shared path's block of them, the row's query scales
    dsattn_native::Buffer<float> kscale(quant ? CHUNK : 0), block_scales, qs(quant ? Hp : 0, 1.0f), wq(quant ? Hp : 0, 0.0f);
    bool qs_folds = true;                                  // the row's query scales are all >= 0
    auto row_scales = [&](int64_t t) {                     // qs, and the head weights with them folded in
      if (qscale != nullptr) std::copy(qscale + t * H, qscale + (t + 1) * H, qs.begin());
      for (int64_t h = 0; h < H; ++h) wq[h] = wp[t * H + h] * qs[h];
      qs_folds = all_non_negative(qs.data(), H);
    };
    // the scores of n keys from their code products cs [n, Hp] (key-major) and scales ks, into out: the scales
    // folded where they may be (see above; ``fold`` is decided once per chunk, as the shared path decides it)
    auto quant_scores_keys = [&](float* cs, int64_t n, const float* ks, bool fold, float* out) {
      if (fold) {
        head_sum_keys(cs, n, Hp, wq.data(), out);
        for (int64_t j = 0; j < n; ++j) out[j] *= ks[j];
      } else {
        scale_key_major(cs, n, Hp, ks, qs.data());
        head_sum_keys(cs, n, Hp, wpad.data(), out);
      }
    };
    auto quant_scores_heads = [&](int64_t t, int64_t valid, const float* ks) {
      if (qs_folds && all_non_negative(ks, valid)) {
        head_sum_by_rows(c.data(), H, CHUNK, valid, wq.data(), score.data());
        for (int64_t j = 0; j < valid; ++j) score[j] *= ks[j];
      } else {
        scale_head_major(c.data(), H, CHUNK, valid, ks, qs.data());
        head_sum_by_rows(c.data(), H, CHUNK, valid, wp + t * H, score.data());
      }
    };
    // quantised keys [j0, j1) of the chunk that starts at key row ``first``: their codes decoded into widened
    // rows j0 .. j1 - 1 and their scales into kscale
    auto key_scales = [&](int64_t first, int64_t j0, int64_t j1) {
      const float* scales = quant->scale_at(first);
      const int64_t ss = quant->scale_step();
      for (int64_t j = j0; j < j1; ++j) kscale[j] = scales[j * ss];
    };
    auto decode_codes_rows = [&](int64_t first, int64_t j0, int64_t j1) {
      const uint8_t* codes = quant->codes(first);
      const int64_t cs = quant->code_step();
      if constexpr (std::is_same_v<mm_t, c10::BFloat16>) {
#if DSATTN_X86
        if (quant->fp8 && cpu_has_avx512vbmi())           // (the rows at once: the tables loaded once)
          return fp8_rows_bf16_vbmi(codes + j0 * cs, cs, j1 - j0, D, reinterpret_cast<uint16_t*>(widened.data() + j0 * Dp), Dp);
#endif
      }
      for (int64_t j = j0; j < j1; ++j) decode_codes<mm_t>(codes + j * cs, D, quant->fp8, widened.data() + j * Dp);
    };
    auto decode_keys = [&](int64_t first, int64_t j0, int64_t j1) {
      key_scales(first, j0, j1);
      decode_codes_rows(first, j0, j1);
    };
    // rows [first, first + m) of the keys as [m, Dp] operand rows (m <= CHUNK)
    auto key_rows = [&](int64_t first, int64_t m) -> const mm_t* {
      if (rows_direct) return reinterpret_cast<const mm_t*>(kr + first * D);
      if (quant != nullptr) {
        decode_keys(first, 0, m);
        return widened.data();
      }
      for (int64_t j = 0; j < m; ++j)
        for (int64_t d = 0; d < D; ++d) widened[j * Dp + d] = static_cast<mm_t>(kr[(first + j) * D + d]);
      return widened.data();
    };

    // One row against its keys, CHUNK at a time: C [keys, Hp] = k q^T, A = the keys as they lie.
    auto one_row = [&](int64_t t, RunningTopK& top, int64_t begin, int64_t count) {   // keys [begin, count)
      dsattn_native::pack_query<scalar_t, mm_t>(qp + t * H * D, H, D, Hp, Dp, qb.data());   // B = q_t^T
      std::copy(wp + t * H, wp + (t + 1) * H, wpad.begin());
      if (quant) row_scales(t);
      // the decode beside the GEMM: slice i's rows in widened slot i % 2, the first decoded before the walk
      // starts, every other one by the side work of the slice before it (the rows of a slice past its valid
      // keys, stale, are never read back)
      auto chunk_keys = [&](int64_t j) { return std::min({CHUNK, count - j, kp.page - j % kp.page}); };
      auto slot = [&](int64_t i) { return widened.data() + (i % 2) * SLICE * Dp; };
      auto slice_decode = [&](int64_t first, int64_t r0, int64_t rows, mm_t* to) {
        return Fp8RowDecode::rows(quant->codes(first) + r0 * quant->code_step(), quant->code_step(),
                                  reinterpret_cast<uint16_t*>(to), Dp, rows, D);
      };
      int64_t slices = 0;
      if (fused_decode && begin < count) {
        Fp8RowDecode first_slice = slice_decode(kp.row(bp[t], begin), 0, std::min(SLICE, chunk_keys(begin)), slot(0));
        first_slice.finish();
      }
      for (int64_t j0 = begin; j0 < count;) {
        const int64_t valid = chunk_keys(j0);   // within one page
        const int64_t first = kp.row(bp[t], j0);
        // M rounded up (fewer kernel shapes): the extra rows (key rows of the tensor, or earlier rows of
        // the widened buffer) are never read back
        const int64_t M = rows_direct ? std::min(round_up(valid, 16), Nk - first) : round_up(valid, 16);
        // quantised keys: the next chunk's codes and scales are fetched into L2 while this one is decoded and
        // multiplied (its misses would otherwise stall the decode one row after another), and this chunk is
        // decoded a slice at a time just before the slice's GEMM reads it (from L1)
        // (with the decode beside the GEMM, the code rows are prefetched by its side work too)
        RowPrefetch ahead;
        if (quant != nullptr && j0 + valid < count) {
          const int64_t j1 = j0 + valid, nv = chunk_keys(j1);
          const int64_t nf = kp.row(bp[t], j1);
          const char* scales = reinterpret_cast<const char*>(quant->scale_at(nf));
          const int64_t ss = 4 * quant->scale_step();
          for (int64_t j = 0; j < nv; j += 16) __builtin_prefetch(scales + j * ss, 0, 2);
          ahead = RowPrefetch{reinterpret_cast<const char*>(quant->codes(nf)), quant->code_step(), nv, (D + 63) / 64};
          if (!fused_decode) ahead.finish();
        }
        const mm_t* ka = quant != nullptr ? widened.data() : key_rows(first, valid);
        if (quant) key_scales(first, 0, valid);
        const bool fold = quant && qs_folds && all_non_negative(kscale.data(), valid);
        // SLICE keys at a time, their rows prefetched (or decoded) first (see SLICE)
        const int64_t slice = rows_direct || quant != nullptr ? SLICE : M;   // (widened rows are in L1 already)
        for (int64_t m0 = 0; m0 < M; m0 += slice) {
          const int64_t ms = std::min(slice, M - m0);
          if (rows_direct) {
            const char* from = reinterpret_cast<const char*>(ka + m0 * Dp);
            for (int64_t b = 0; b < ms * Dp * static_cast<int64_t>(sizeof(mm_t)); b += 64) __builtin_prefetch(from + b, 0, 2);
          }
          if (quant != nullptr && !fused_decode) decode_codes_rows(first, m0, std::min(m0 + ms, valid));
          Fp8RowDecode next;                   // the slice after this one: of this chunk, or the next chunk's first
          if (fused_decode && m0 + slice < valid)
            next = slice_decode(first, m0 + slice, std::min(slice, valid - m0 - slice), slot(slices + 1));
          else if (fused_decode && j0 + valid < count)
            next = slice_decode(kp.row(bp[t], j0 + valid), 0, std::min(slice, chunk_keys(j0 + valid)), slot(slices + 1));
          next.ahead = ahead;
          for (int64_t h0 = 0; h0 < Hp; h0 += PANEL) {
            const int64_t pw = std::min(PANEL, Hp - h0);
            float* cm = c.data() + h0;          // (a slice's products, summed over heads below while in L1)
            if (fused_decode)
              dsattn_native::dpbf16_gemm(ms, pw, Dp, Dp, pw, Hp, false, reinterpret_cast<const uint16_t*>(slot(slices)),
                                         reinterpret_cast<const uint16_t*>(qb.data() + h0 * Dp), cm, &next);
            else if constexpr (packed)
              gemm(ms, pw, Dp, Dp, pw, Hp, false, ka + m0 * Dp, qb.data() + h0 * Dp, cm, true);
            else
              gemm(ms, pw, Dp, Dp, Hp, Hp, false, ka + m0 * Dp, qb.data() + h0, cm, false);
          }
          if (fused_decode) next.finish(), ahead = next.ahead;
          ++slices;
          const int64_t keys_here = std::min(ms, valid - m0);
          if (quant && keys_here > 0)
            quant_scores_keys(c.data(), keys_here, kscale.data() + m0, fold, score.data() + m0);
          else if (keys_here > 0)
            head_sum_keys(c.data(), keys_here, Hp, wpad.data(), score.data() + m0);
        }
        ahead.finish();                        // (what the slices' side work left)
        top.add(score.data(), valid, j0);
        j0 += valid;
      }
    };

    // Rows [r0, r1) of one request sharing its keys: each block of KEY_BLOCK keys is packed once as the
    // GEMM's B operand (K^T: [Dp/2][w][2] panels of w <= CHUNK keys, or fp32 [Dp][w]) and every row's
    // query is the A operand as it lies: C [H, keys] = q_t K^T, summed over heads in vertical adds.
    auto shared_rows = [&](int64_t r0, int64_t r1) {
      int64_t most = 0;
      selections(r1 - r0);
      for (int64_t t = r0; t < r1; ++t) most = std::max(most, np[t]), best[t - r0].reset();
      const int64_t b = bp[r0];
      if (panels.empty()) panels.resize(KEY_BLOCK * Dp);
      if (quant && block_scales.empty()) block_scales.resize(KEY_BLOCK);
      if (!rows_direct && qa.empty()) qa.resize(H * Dp, mm_t(0));   // (else q rows are A as they lie)
      for (int64_t kb0 = 0; kb0 < most;) {
        // this block's chunks (each within one page, w <= CHUNK keys padded to 16), packed one after another
        chunk_at.clear(), chunk_n.clear();
        int64_t j0 = kb0, off = 0, keys_in = 0;
        while (j0 < most) {
          const int64_t valid = std::min({CHUNK, most - j0, kp.page - j0 % kp.page}), w = round_up(valid, 16);
          if (off + w * Dp > KEY_BLOCK * Dp) break;
          mm_t* panel = panels.data() + off;
          if (valid < w) std::fill(panel, panel + w * Dp, mm_t(0));
          dsattn_native::transpose_words(reinterpret_cast<const uint32_t*>(key_rows(kp.row(b, j0), valid)), words, valid,
                                         words, reinterpret_cast<uint32_t*>(panel), w);
          if (quant) std::copy(kscale.begin(), kscale.begin() + valid, block_scales.begin() + keys_in);
          chunk_at.push_back(j0), chunk_n.push_back(valid);
          off += w * Dp, j0 += valid, keys_in += w;
        }
        const int64_t kb1 = j0;
        for (int64_t t = r0; t < r1; ++t) {
          const int64_t count = np[t];
          if (count <= kb0) continue;
          const mm_t* a = reinterpret_cast<const mm_t*>(qp + t * H * D);
          if (!rows_direct) {
            for (int64_t h = 0; h < H; ++h)
              for (int64_t d = 0; d < D; ++d) qa[h * Dp + d] = static_cast<mm_t>(qp[(t * H + h) * D + d]);
            a = qa.data();
          }
          const mm_t* panel = panels.data();
          if (quant) row_scales(t);
          for (size_t i = 0, key0 = 0; i < chunk_at.size() && chunk_at[i] < count; ++i) {
            const int64_t w = round_up(chunk_n[i], 16), valid = std::min(chunk_n[i], count - chunk_at[i]);
            gemm(H, w, Dp, Dp, w, CHUNK, false, a, panel, c.data(), packed);
            if (quant)
              quant_scores_heads(t, valid, block_scales.data() + key0);
            else
              head_sum_by_rows(c.data(), H, CHUNK, valid, wp + t * H, score.data());
            best[t - r0].add(score.data(), valid, chunk_at[i]);
            panel += w * Dp, key0 += w;
          }
        }
        kb0 = kb1;
      }
    };

    if (part >= 0) {                              // keys [part_at[part], part_at[part + 1]) of the one row
      if (part_at[part] < part_at[part + 1]) one_row(0, partial[part], part_at[part], part_at[part + 1]);
      gemm_release<mm_t>();
      return;
    }
    for (int64_t t = t0; t < t1;) {
      int64_t run = t + 1;                       // the run of rows of t's request
      while (run < t1 && bp[run] == bp[t]) ++run;
      if (run - t >= SHARED_ROWS) {
        for (int64_t r0 = t; r0 < run; r0 += ROW_BLOCK) {
          const int64_t r1 = std::min(run, r0 + ROW_BLOCK);
          shared_rows(r0, r1);
          for (int64_t r = r0; r < r1; ++r) best[r - r0].write(vp + r * k, ip + r * k, offset == nullptr ? 0 : offset[r]);
        }
      } else {
        for (int64_t r = t; r < run; ++r) {
          best[0].reset();
          if (np[r] > 0) one_row(r, best[0], 0, np[r]);
          best[0].write(vp + r * k, ip + r * k, offset == nullptr ? 0 : offset[r]);
        }
      }
      t = run;
    }
    gemm_release<mm_t>();
  };
  if (!split) {
    dsattn_native::parallel_rows(R, [&](int64_t t) { return np[t] > 0 ? np[t] + 64 : 1; },
                                 [&](int64_t t0, int64_t t1) { work(t0, t1, -1); });
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) work(0, 1, p);
  });
  for (int64_t p = 1; p < threads; ++p) partial[0].absorb(partial[p]);
  partial[0].write(vp, ip, offset == nullptr ? 0 : offset[0]);
}

}  // namespace

namespace {

// The checks both entries share: q, w, batch, n, pages, offset; every key a row reads within the Nk rows.
void check_topk_args(const at::Tensor& q, int64_t Nk, const at::Tensor& pages, int64_t page, const at::Tensor& batch,
                     const at::Tensor& n, const at::Tensor& w, int64_t topk, const c10::optional<at::Tensor>& offset) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.device().is_cpu(), "q: expected a contiguous CPU [R, H, D] tensor");
  const int64_t R = q.size(0);
  TORCH_CHECK(w.dim() == 2 && w.size(0) == R && w.size(1) == q.size(1) && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "w: expected a contiguous fp32 [R, H] tensor");
  for (const auto* t : {&batch, &n})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == R && t->scalar_type() == at::kLong && t->is_contiguous(),
                "batch, n: expected int64 [R] tensors");
  TORCH_CHECK(pages.dim() == 2 && pages.scalar_type() == at::kLong && pages.is_contiguous(), "pages: expected int64 [B, P]");
  TORCH_CHECK(page >= 1 && topk >= 1, "page, topk: expected >= 1");
  if (offset.has_value())
    TORCH_CHECK(offset->dim() == 1 && offset->size(0) == R && offset->scalar_type() == at::kLong && offset->is_contiguous(),
                "offset: expected an int64 [R] tensor");
  const KeyPages kp{pages.data_ptr<int64_t>(), pages.size(1), page};
  const int64_t* bp = batch.data_ptr<int64_t>();
  const int64_t* np = n.data_ptr<int64_t>();
  for (int64_t t = 0; t < R; ++t) {                    // every key a row reads is in the tensor
    if (np[t] <= 0) continue;
    TORCH_CHECK_INDEX(bp[t] >= 0 && bp[t] < pages.size(0) && (np[t] - 1) / page < pages.size(1), "row ", t,
                      ": request ", bp[t], " with ", np[t], " keys is not covered by pages ", pages.sizes());
    for (int64_t j0 = 0; j0 < np[t]; j0 += page - j0 % page) {
      const int64_t first = kp.row(bp[t], j0), last = kp.row(bp[t], std::min(np[t], j0 - j0 % page + page) - 1);
      TORCH_CHECK_INDEX(first >= 0 && last < Nk, "row ", t, ": key ", j0, " maps to rows [", first, ", ", last,
                        "], not within the ", Nk, " key rows");
    }
  }
}

}  // namespace

// The top-k of each query row of q [R, H, D] over the first n[t] keys of its request batch[t],
// head weights w [R, H] (fp32): (values fp32 [R, topk], key positions plus offset[t] int32 [R, topk])
// in the golden's order; -inf / -1 past min(n[t], topk) (the op's outputs as they are).  Keys: flat
// rows keys [Nk, D] (q's dtype); key j of request b is row pages[b, j / page] + j % page (pages:
// int64 [B, P]).  offset: int64 [R] or None (0).
std::vector<at::Tensor> indexer_topk(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& pages,
                                     int64_t page, const at::Tensor& batch, const at::Tensor& n, const at::Tensor& w,
                                     int64_t topk, const c10::optional<at::Tensor>& offset) {
  TORCH_CHECK(keys.dim() == 2 && keys.size(1) == q.size(2) && keys.is_contiguous() && keys.scalar_type() == q.scalar_type(),
              "keys: expected a contiguous [N, D] tensor of q's dtype");
  check_topk_args(q, keys.size(0), pages, page, batch, n, w, topk, offset);
  const int64_t R = q.size(0);
  const KeyPages kp{pages.data_ptr<int64_t>(), pages.size(1), page};
  auto values = at::empty({R, topk}, q.options().dtype(at::kFloat));
  auto indices = at::empty({R, topk}, q.options().dtype(at::kInt));
  const int64_t* off = offset.has_value() ? offset->data_ptr<int64_t>() : nullptr;
  dsattn_native::dispatch_gemm(q.scalar_type(), [&](auto s, auto m) {
    using scalar_t = decltype(s);
    topk_rows<scalar_t, decltype(m)>(q, keys.data_ptr<scalar_t>(), keys.size(0), nullptr, nullptr, kp, batch, n, w, off,
                                     values, indices);
  });
  return {values, indices};
}

// The same over a quantised pool read in place: codes [blocks, bs, D] uint8 (int8 or fp8 e4m3fn codes,
// ``fp8``; any strides, each row's codes one after another), scales [blocks, bs] fp32 (any strides);
// flat key row r is block r / bs, slot r % bs.  qscale: the query's per-head scales fp32 [R, H] or None.
std::vector<at::Tensor> indexer_topk_quant(const at::Tensor& q, const at::Tensor& codes, const at::Tensor& scales,
                                           bool fp8, const at::Tensor& pages, int64_t page, const at::Tensor& batch,
                                           const at::Tensor& n, const at::Tensor& w, int64_t topk,
                                           const c10::optional<at::Tensor>& offset,
                                           const c10::optional<at::Tensor>& qscale) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(2) == q.size(2) && codes.stride(2) == 1,
              "codes: expected uint8 [blocks, bs, D] with each row's codes one after another");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.size(0) == codes.size(0) &&
              scales.size(1) == codes.size(1), "scales: expected fp32 [blocks, bs]");
  if (qscale.has_value())
    TORCH_CHECK(qscale->dim() == 2 && qscale->size(0) == q.size(0) && qscale->size(1) == q.size(1) &&
                qscale->scalar_type() == at::kFloat && qscale->is_contiguous(), "qscale: expected contiguous fp32 [R, H]");
  const int64_t Nk = codes.size(0) * codes.size(1);
  check_topk_args(q, Nk, pages, page, batch, n, w, topk, offset);
  const int64_t R = q.size(0);
  const KeyPages kp{pages.data_ptr<int64_t>(), pages.size(1), page};
  const QuantKeys quant{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), std::max<int64_t>(codes.size(1), 1),
                        codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1), fp8};
  auto values = at::empty({R, topk}, q.options().dtype(at::kFloat));
  auto indices = at::empty({R, topk}, q.options().dtype(at::kInt));
  const int64_t* off = offset.has_value() ? offset->data_ptr<int64_t>() : nullptr;
  const float* qs = qscale.has_value() ? qscale->data_ptr<float>() : nullptr;
  dsattn_native::dispatch_gemm(q.scalar_type(), [&](auto s, auto m) {
    topk_rows<decltype(s), decltype(m)>(q, nullptr, Nk, &quant, qs, kp, batch, n, w, off, values, indices);
  });
  return {values, indices};
}

// int8 / fp8 e4m3fn codes (uint8, any shape, contiguous) -> their exact values as bf16: a quantised query's
// operand (PyTorch's own fp8 -> bf16 conversion takes 2 ns an element, 0.5 ms of a B 32 decode step)
at::Tensor index_codes_bf16(const at::Tensor& codes, bool fp8) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.device().is_cpu(),
              "codes: expected a contiguous CPU uint8 tensor");
  auto out = at::empty(codes.sizes(), codes.options().dtype(at::kBFloat16));
  const uint8_t* src = codes.data_ptr<uint8_t>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  constexpr int64_t piece = 1 << 14;
  at::parallel_for(0, (codes.numel() + piece - 1) / piece, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = std::min(piece, codes.numel() - p * piece);
      decode_codes<c10::BFloat16>(src + p * piece, n, fp8, dst + p * piece);
    }
  });
  return out;
}

// test hook: every int8 and fp8 code decodes to its exact value as each GEMM operand type, on every
// implementation this CPU runs (NaN codes to NaN), at every offset of a 37-code run (vector and tail)
bool indexer_codes_match() {
  uint8_t codes[256 + 37];
  for (int c = 0; c < 256 + 37; ++c) codes[c] = static_cast<uint8_t>(c * 7 + 3);
  bool ok = true;
  for (const bool fp8 : {false, true}) {
    auto want = [&](uint8_t c) {
      return fp8 ? static_cast<float>(c10::Float8_e4m3fn(c, c10::Float8_e4m3fn::from_bits()))
                 : static_cast<float>(static_cast<int8_t>(c));
    };
    auto same = [](float a, float b) { return (a != a && b != b) || a == b; };
    float f[256 + 37];
    c10::BFloat16 bf[256 + 37];
    c10::Half hf[256 + 37];
    decode_codes<float>(codes, 256 + 37, fp8, f);
    decode_codes<c10::BFloat16>(codes, 256 + 37, fp8, bf);
    decode_codes<c10::Half>(codes, 256 + 37, fp8, hf);
    for (int c = 0; c < 256 + 37; ++c)
      ok = ok && same(f[c], want(codes[c])) && same(static_cast<float>(bf[c]), want(codes[c])) &&
           same(static_cast<float>(hf[c]), want(codes[c]));
#if DSATTN_X86
    if (fp8 && dsattn_native::cpu_has_avx512bw()) {        // each vector decode this CPU runs, directly
      uint16_t a[256 + 37], b[256 + 37];
      fp8_codes_bf16_avx512(codes, 256 + 37, a);
      ok = ok && std::memcmp(a, bf, sizeof(a)) == 0;
      if (cpu_has_avx512vbmi()) {
        fp8_codes_bf16_vbmi(codes, 256 + 37, b);
        ok = ok && std::memcmp(b, bf, sizeof(b)) == 0;
      }
    }
#endif
    uint16_t scalar[37];                                  // the scalar tails alone
    for (int c = 0; c < 37; ++c)
      scalar[c] = code_bf16_bits(codes[c], fp8);
    ok = ok && std::memcmp(scalar, bf, sizeof(scalar)) == 0;
  }
  return ok;
}

// test hook: the head sums of both score layouts give the same bits on every implementation here
bool indexer_head_sums_match(int64_t H, int64_t n) { return head_sums_match(H, n); }

#else  // !DSATTN_HAVE_BRGEMM

std::vector<at::Tensor> indexer_topk(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
                                     const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "this torch has no cpublas::brgemm: the compiled indexer is not available");
}

std::vector<at::Tensor> indexer_topk_quant(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool,
                                           const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, int64_t, const c10::optional<at::Tensor>&,
                                           const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "this torch has no cpublas::brgemm: the compiled indexer is not available");
}

bool indexer_head_sums_match(int64_t, int64_t) { return true; }

bool indexer_codes_match() { return true; }

at::Tensor index_codes_bf16(const at::Tensor&, bool) {
  TORCH_CHECK(false, "this torch has no cpublas::brgemm: the compiled indexer is not available");
}

#endif
