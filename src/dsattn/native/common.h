// Pieces the compiled CPU kernels share (attention.cpp, indexer.cpp).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "isa.h"
#if DSATTN_X86
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <type_traits>
#include <vector>

// The attention and indexer kernels run on ATen's exported batch-reduce GEMM (cpublas::brgemm,
// oneDNN's ukernel), which CPUBlas.h announces with these macros (recent torch versions); with a
// torch that lacks it they compile to stubs, kernels_available() says so and the PyTorch paths run.
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F32F32F32)
#define DSATTN_HAVE_BRGEMM 1
#else
#define DSATTN_HAVE_BRGEMM 0
#endif

#include "isa.h"
#include "gemm.h"

namespace dsattn_native {

// The widest B panel of one GEMM call.  A packed 16-bit B panel of w columns is [K/2][w][2]: what
// cpublas::pack writes for w <= 64 (its packing object refuses wider ones), and what the ukernel
// reads for any w with ldb = w (ATen's flash attention packs V as one panel of the head size).
// Wider calls are fewer and faster: P V with M 64, K 640 ran at 1.36 TFLOP/s per core in 64-column
// panels and 1.72-1.84 in one 512-column panel (AMX, one core, operands in cache).
// test_native_kernels checks both: the layout against cpublas::pack, the GEMM against a matmul.
constexpr int64_t PANEL = 512;

// The panel width of a wide packed 16-bit B operand (V in P V, q and dO in the backward's dK): one
// PANEL-wide panel for the AMX ukernel (above), 64-column strips for the AVX-512 paths (dsattn's
// tiles and oneDNN's avx512_core_bf16 kernel), whose 6 x 64 register tiles then read a contiguous
// strip: in a 512-wide panel a strip's 256 bytes per pair of K lie 2 KB apart, in 8 of L1's 64
// sets, so every row tile streamed the strip from L2 again (Zen 4: P V at half the tile's rate).
template <typename mm_t>
int64_t wide_panel() {
  if constexpr (std::is_same_v<mm_t, float>) return PANEL;     // (plain fp32 B: the width only splits calls)
  else return gemm_kind(c10::CppTypeToScalarType<mm_t>::value) == KIND_AMX ? PANEL : 64;
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Calls f(scalar_t(), mm_t()) for a query dtype: scalar_t the dtype, mm_t the GEMM operand type
// (the dtype itself on the packed path, float otherwise).
template <typename F>
void dispatch_gemm(at::ScalarType dt, F&& f) {
  const bool packed = packed_gemm(dt);
  if (dt == at::kBFloat16 && packed)
    f(c10::BFloat16(), c10::BFloat16());
  else if (dt == at::kBFloat16)
    f(c10::BFloat16(), float());
  else if (dt == at::kHalf && packed)
    f(c10::Half(), c10::Half());
  else if (dt == at::kHalf)
    f(c10::Half(), float());
  else if (dt == at::kFloat)
    f(float(), float());
  else
    TORCH_CHECK(false, "q: dtype ", dt, " is not supported (bf16, fp16, fp32)");
}

// ---- rows over threads ----
//
// at::parallel_for hands each thread an equal count of rows.  Rows are not equal work: a causal
// prefill's last rows read the most keys (in the indexer's 8K prefill the second half of the rows
// reads three times the keys of the first), a ragged decode batch mixes short and long contexts.
// parallel_rows gives each thread one contiguous range of about equal cost instead (contiguous: rows of
// one request share their keys in cache).

// Bounds of ``parts`` contiguous ranges of rows [0, R) of about equal total cost(r) (>= 0).
template <typename Cost>
std::vector<int64_t> balanced_bounds(int64_t R, int64_t parts, Cost cost) {
  std::vector<double> prefix(R + 1, 0.0);
  for (int64_t r = 0; r < R; ++r) prefix[r + 1] = prefix[r] + static_cast<double>(cost(r));
  std::vector<int64_t> bounds(parts + 1, R);
  bounds[0] = 0;
  for (int64_t p = 1; p < parts; ++p)
    bounds[p] = std::lower_bound(prefix.begin(), prefix.end(), prefix[R] * p / parts) - prefix.begin();
  for (int64_t p = 1; p <= parts; ++p) bounds[p] = std::max(bounds[p], bounds[p - 1]);
  return bounds;
}

// body(r0, r1) over rows [0, R) on the intra-op threads: one call per thread, ranges of about equal cost.
template <typename Cost, typename Body>
void parallel_rows(int64_t R, Cost cost, Body body) {
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), R);
  if (parts <= 1) {
    if (R > 0) body(int64_t(0), R);
    return;
  }
  const std::vector<int64_t> bounds = balanced_bounds(R, parts, cost);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      if (bounds[p] < bounds[p + 1]) body(bounds[p], bounds[p + 1]);
  });
}

// ---- GEMM buffers ----
//
// Every buffer a GEMM reads or writes starts on a cache line.  An AMX tile row or a 64-byte vector
// load that straddles two lines costs two loads: with std::vector's 16-byte alignment the
// ukernel ran at half its rate on the attention row's shapes (S^T and P V, 640 keys x 512 dims:
// ~25 us per GEMM aligned, 40-90 us not, measured on one core).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::size_t LINE = 64;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) {
    const std::size_t bytes = (n * sizeof(T) + LINE - 1) / LINE * LINE;   // aligned_alloc wants a multiple
    void* p = std::aligned_alloc(LINE, bytes == 0 ? LINE : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) noexcept { std::free(p); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};

template <typename T>
using Buffer = std::vector<T, CacheLineAllocator<T>>;

// ---- 32-bit transposes (packing GEMM operands) ----
//
// A row-major operand read column by column writes (or reads) one cache line per element; a
// query row's q^T panel is 64 KB, larger than L1, so the naive loop waited on L2 for every word.
// 16 x 16 tiles are transposed in registers instead.

#if DSATTN_X86
// dst[c, r] = src[r, c] for one 16 x 16 tile: 32-bit pairs, then 64-bit pairs, then 128-bit lanes.
__attribute__((target("avx512f"))) inline void transpose_tile16_avx512(const uint32_t* src, int64_t ls, uint32_t* dst,
                                                                      int64_t ld) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * ls);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // now r[4i + k], 128-bit lane L, holds column 4L + k of rows 4i .. 4i + 3
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 4; ++k) {
      t[8 * i + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + 4 + k], 0x88);
      t[8 * i + 4 + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + 4 + k], 0xdd);
    }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * ld, r[i]);
}
#endif

inline void transpose_tile16_scalar(const uint32_t* src, int64_t ls, uint32_t* dst, int64_t ld) {
  for (int64_t r0 = 0; r0 < 16; r0 += 4)            // 4-row strips: each dst line is written 4 words at a time
    for (int64_t c = 0; c < 16; ++c)
      for (int64_t r = r0; r < r0 + 4; ++r) dst[c * ld + r] = src[r * ls + c];
}

using TransposeTile = void (*)(const uint32_t*, int64_t, uint32_t*, int64_t);

inline TransposeTile best_transpose_tile() {
#if DSATTN_X86
  static const TransposeTile tile =
      isa_has(ISA_AVX512) ? transpose_tile16_avx512 : transpose_tile16_scalar;
  return tile;
#else
  return transpose_tile16_scalar;
#endif
}

// dst[c * ld + r] = src[r * ls + c] for r < rows, c < cols (32-bit elements): 16 x 16 tiles where
// they fit (``tile``: in registers on AVX-512 by default), element by element at the edges.
inline void transpose_words(const uint32_t* src, int64_t ls, int64_t rows, int64_t cols, uint32_t* dst, int64_t ld,
                            TransposeTile tile = nullptr) {
  if (tile == nullptr) tile = best_transpose_tile();
  const int64_t r16 = rows / 16 * 16, c16 = cols / 16 * 16;
  for (int64_t r = 0; r < r16; r += 16)
    for (int64_t c = 0; c < c16; c += 16) tile(src + r * ls + c, ls, dst + c * ld + r, ld);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = r < r16 ? c16 : 0; c < cols; ++c) dst[c * ld + r] = src[r * ls + c];
}

// Test hook: transpose_words with every tile implementation this CPU runs (the scalar one always,
// AVX-512 where present) equals the element loop on a rows x cols block with padded row strides.
inline bool transposes_match(int64_t rows, int64_t cols) {
  const int64_t ls = cols + 3, ld = rows + 5;
  std::vector<uint32_t> src(rows * ls), want(cols * ld, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = uint32_t(i * 2654435761u);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) want[c * ld + r] = src[r * ls + c];
  std::vector<TransposeTile> tiles{transpose_tile16_scalar};
#if DSATTN_X86
  if (isa_has(ISA_AVX512)) tiles.push_back(transpose_tile16_avx512);
#endif
  bool ok = true;
  for (TransposeTile tile : tiles) {
    std::vector<uint32_t> got(cols * ld, 0);
    transpose_words(src.data(), ls, rows, cols, got.data(), ld, tile);
    ok = ok && got == want;
  }
  return ok;
}

template <typename T>
inline void transpose32(const T* src, int64_t ls, int64_t rows, int64_t cols, T* dst, int64_t ld) {
  static_assert(sizeof(T) == 4, "32-bit elements");
  transpose_words(reinterpret_cast<const uint32_t*>(src), ls, rows, cols, reinterpret_cast<uint32_t*>(dst), ld);
}

// q^T [Dp, Hp] of one query row q [H, D] (zero padded) as a GEMM's B operand: for 16-bit operands
// the ukernel's packed panels, [Dp/2][w][2] for each 64-head panel (panel h0 starts at h0 * Dp;
// a pair of q's dims is one 32-bit word per head, so a panel is the transpose of q's words),
// else plain fp32 [Dp][Hp].
// (``panel``: the 16-bit panels' width, PANEL by default; wide_panel<mm_t>() for a wide operand)
template <typename scalar_t, typename mm_t>
void pack_query(const scalar_t* q, int64_t H, int64_t D, int64_t Hp, int64_t Dp, mm_t* out, int64_t panel = PANEL) {
  const bool padded = H != Hp || D != Dp;
  if constexpr (std::is_same_v<mm_t, float>) {
    if (padded) std::fill(out, out + Dp * Hp, 0.0f);
    if constexpr (std::is_same_v<scalar_t, float>) {
      transpose32(q, D, H, D, out, Hp);
    } else {
      // widened along q's rows (vectorised), then transposed in tiles: widened element by element into q^T,
      // the loop wrote one float at a time down q^T's columns, a tenth of an fp32-path prefill row's time on
      // AVX2 (HCA 8K: the rows' GEMMs are small)
      thread_local std::vector<float> wide;
      wide.resize(static_cast<size_t>(H * D));
      for (int64_t i = 0; i < H * D; ++i) wide[i] = static_cast<float>(q[i]);
      transpose32(wide.data(), D, H, D, out, Hp);
    }
  } else {
    static_assert(std::is_same_v<scalar_t, mm_t>, "16-bit GEMM operands are the query dtype");
    if (padded) std::fill(out, out + Dp * Hp, mm_t(0));
    for (int64_t h0 = 0; h0 < Hp && h0 < H; h0 += panel) {
      const int64_t w = std::min(panel, Hp - h0), heads = std::min(w, H - h0);
      mm_t* panel = out + h0 * Dp;
      if (D % 2 == 0) {
        transpose_words(reinterpret_cast<const uint32_t*>(q + h0 * D), D / 2, heads, D / 2,
                        reinterpret_cast<uint32_t*>(panel), w);
      } else {
        for (int64_t c = 0; c < heads; ++c)
          for (int64_t d = 0; d < D; ++d) panel[((d / 2) * w + c) * 2 + d % 2] = q[(h0 + c) * D + d];
      }
    }
  }
}

}  // namespace dsattn_native
