// The GEMMs of the compiled kernels, and which one runs.
//
// Every GEMM is C [M, N] (+)= A [M, K] B [K, N] with fp32 C.  Four paths:
//   amx         16-bit operands on ATen's batch-reduce ukernel (cpublas::brgemm, oneDNN), where
//               cpublas::could_pack says the CPU multiplies them natively (AMX);
//   avx512bf16  bf16 operands on dsattn's register-tiled micro-kernel over vdpbf16ps, where the CPU has
//               AVX512-BF16 without AMX (Zen 4 / Zen 5 EPYC, Cooper Lake);
//   onednn      bf16 operands on the same ATen ukernel without AMX: oneDNN JIT-compiles its
//               avx512_core_bf16 kernel for any AVX512-BF16 CPU (only cpublas::pack needs AMX).  On
//               such a CPU the process times both kernels once on the attention's own shapes and
//               takes oneDNN's only where it is clearly faster (bf16_choice below);
//   fp32        operands widened to fp32 as rows are read, on dsattn's fp32 GEMM (fp32_gemm below: AVX-512,
//               AVX2 or the baseline build, by the class).
// The avx512bf16 and fp32 paths are dsattn's own code and sum each element over K in one order whatever
// the shapes and threads (gemm_is_own); amx and onednn are oneDNN's kernels and promise no such thing.
// The 16-bit paths read the same operands: A row-major, B in pair-interleaved panels [K/2][w][2]
// (ldb = w), so the kernels pack once whichever 16-bit path runs.  All multiply exact bf16 products
// and sum in fp32; only the summation order differs, and the golden's rounding points (which operand
// is rounded to bf16 where) are the kernels' and the same on every path.
#pragma once

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include "isa.h"
#if DSATTN_X86
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace dsattn_native {

enum GemmPath : int { GEMM_BEST = 0, GEMM_AVX512BF16 = 1, GEMM_FP32 = 2, GEMM_ONEDNN = 3, GEMM_OWN = 4 };

// The path the process asked for: the CPU's best (default), one forced (DSATTN_NATIVE_GEMM, the tests and
// the benchmarks: dsattn.native.gemm_path()), or dsattn's own kernels only ("own": the vdpbf16ps
// micro-kernel for bf16 where the CPU has it, fp32 for everything else), the paths whose sums over K
// keep one order per element whatever M, N and the threads (gemm_is_own).
inline std::atomic<int>& gemm_request() {
  static std::atomic<int> request{GEMM_BEST};
  return request;
}

inline bool cpu_has_avx512bf16() { return isa_has(ISA_AVX512_BF16); }

// AMX's 16-bit products through oneDNN's ukernel (cpublas::could_pack), where the class allows them
inline bool cpu_runs_amx(at::ScalarType dt) { return isa_has(ISA_AMX) && at::native::cpublas::could_pack(dt); }

enum GemmKind : int { KIND_AMX, KIND_ONEDNN, KIND_AVX512BF16, KIND_FP32 };

inline const char* gemm_kind_name(GemmKind kind) {
  return kind == KIND_AMX ? "amx" : kind == KIND_ONEDNN ? "onednn" : kind == KIND_AVX512BF16 ? "avx512bf16" : "fp32";
}

// How dsattn's micro-kernel and oneDNN's bf16 ukernel compare on this CPU (AVX512-BF16 without AMX).
struct Bf16Choice {
  bool measured = false;       // false: not such a CPU (or no ATen ukernel in this torch)
  bool onednn_runs = false;    // ATen's bf16 brgemm ran here and matched the micro-kernel
  double own_gflops = 0.0, onednn_gflops = 0.0;   // one thread, operands in cache, the attention's shapes
  bool onednn = false;         // the choice: oneDNN's (clearly faster) or ours
  std::string why;
};

inline Bf16Choice measure_bf16_choice();   // below, after the kernels

inline const Bf16Choice& bf16_choice() {
  static const Bf16Choice choice = measure_bf16_choice();
  return choice;
}

// Which GEMM a query dtype runs.
inline GemmKind gemm_kind(at::ScalarType dt) {
  const int request = gemm_request().load(std::memory_order_relaxed);
  if (request == GEMM_FP32 || (dt != at::kBFloat16 && dt != at::kHalf)) return KIND_FP32;
  if (request == GEMM_OWN) return dt == at::kBFloat16 && cpu_has_avx512bf16() ? KIND_AVX512BF16 : KIND_FP32;
  if (dt == at::kBFloat16 && request == GEMM_AVX512BF16) return cpu_has_avx512bf16() ? KIND_AVX512BF16 : KIND_FP32;
  if (dt == at::kBFloat16 && request == GEMM_ONEDNN) return bf16_choice().onednn_runs ? KIND_ONEDNN : KIND_FP32;
  if (cpu_runs_amx(dt)) return KIND_AMX;
  // vdpbf16ps multiplies bf16 only; fp16 without a native ukernel takes the fp32 path
  if (dt == at::kBFloat16 && cpu_has_avx512bf16()) return bf16_choice().onednn ? KIND_ONEDNN : KIND_AVX512BF16;
  return KIND_FP32;
}

// Whether a dtype's GEMMs run on dsattn's own code (the AVX512-BF16 micro-kernel, the fp32 GEMM), which
// sums each element over K in one order whatever M, N, the tile and the threads: the kernels' batch
// invariance rests on this.  The AMX and oneDNN paths hand the GEMM to oneDNN, whose kernel choice (by
// CPU, shape, ISA cap) may change that order: no invariance is promised there.
inline bool gemm_is_own(at::ScalarType dt) {
  const GemmKind kind = gemm_kind(dt);
  return kind == KIND_AVX512BF16 || kind == KIND_FP32;
}

// Whether a dtype's GEMMs take 16-bit operands (any 16-bit path).
inline bool packed_gemm(at::ScalarType dt) { return gemm_kind(dt) != KIND_FP32; }

// Cache lines for a GEMM to prefetch (into L2) while it multiplies: the next keys of a gather.  The
// gather of a decode row is bound by the misses a core keeps in flight (its prefetches stall once they
// are all in use); issued one per K step of the micro-kernel's tiles, the misses overlap the products
// instead.  The ukernel paths (AMX, oneDNN) leave the list alone.
//
// The list is one kind of a tile's side work: ``step(kp)`` runs once per K step of the micro-kernel's
// loop, between its products (dpbf16_gemm's ``Side``).  Another kind decodes the next rows of A while
// this tile multiplies (the quantised indexer's FP8 keys: indexer.cpp, Fp8RowDecode).
struct LinePrefetch {
  const char* const* next = nullptr;
  const char* const* end = nullptr;
  __attribute__((always_inline)) void step(int64_t) {
    if (next != end) __builtin_prefetch(*next++, 0, 2);     // (x86: prefetcht1)
  }
};

#if DSATTN_X86
// ---- the AVX512-BF16 micro-kernel ----
//
// A tile of MR <= 6 rows x 16 NV <= 64 columns of C lives in MR x NV zmm accumulators (24 for the
// full 6 x 64 tile, plus 4 B vectors and one broadcast: 29 of the 32 registers).  Per pair of K it
// loads NV 16-column slices of B's pair panel and broadcasts each row's A pair (one 32-bit word)
// into vdpbf16ps: 4 loads and 6 broadcasts per 24 products.  The last column slice is masked
// (loads zero, stores skipped).
//
// The accumulators are named scalars (c<row><slice>), each used only under ``if constexpr``, so no
// array of vectors exists for the compiler to keep in memory.  An __m512 acc[8][2] array, indexed
// in loops, was kept on the stack by GCC 12 and written back on every K step (16 zmm stores per 16
// vdpbf16ps): on Zen 4, which retires one 512-bit store every other cycle, that bound the GEMM to
// under half the vdpbf16ps rate (85 against 228 GFLOP/s on one core).  test_gemm_kernel reads
// the built layer's disassembly: no store inside any loop of these tiles (but the side work's own).
//
// ``side->step(kp)`` runs once per K step (LinePrefetch above).  The tiles are compiled for AVX-512
// VBMI too, so that a side step may use its byte permutes; the test also reads that no tile with a
// LinePrefetch side holds a VBMI instruction (those run on AVX512-BF16 CPUs without VBMI: Cooper Lake).
template <int MR, int NV, typename Side>
__attribute__((noinline, target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi"))) void dpbf16_tile(
    int64_t K2, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float* C, int64_t ldc, bool add_C,
    __mmask16 tail, Side* side) {
  static_assert(MR >= 1 && MR <= 6 && NV >= 1 && NV <= 4, "a tile is at most 6 rows x 4 column slices");
#define DSATTN_DP_MASK(v) ((v) == NV - 1 ? tail : __mmask16(0xFFFF))
#define DSATTN_DP_ROW_DECL(r) \
  __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = _mm512_setzero_ps(), c##r##2 = _mm512_setzero_ps(), \
         c##r##3 = _mm512_setzero_ps();
#define DSATTN_DP_FOR_SLICES(op, r) op(r, 0) op(r, 1) op(r, 2) op(r, 3)
#define DSATTN_DP_FOR_ROWS(op) op(0) op(1) op(2) op(3) op(4) op(5)
#define DSATTN_DP_LOAD(r, v) \
  if constexpr (MR > r && NV > v) c##r##v = _mm512_maskz_loadu_ps(DSATTN_DP_MASK(v), C + r * ldc + 16 * v);
#define DSATTN_DP_LOAD_ROW(r) DSATTN_DP_FOR_SLICES(DSATTN_DP_LOAD, r)
#define DSATTN_DP_FMA(r, v) \
  if constexpr (NV > v) c##r##v = _mm512_dpbf16_ps(c##r##v, a, (__m512bh)b##v);
#define DSATTN_DP_FMA_ROW(r)                                              \
  if constexpr (MR > r) {                                                 \
    uint32_t pair;                                                        \
    std::memcpy(&pair, ar + r * lda, 4);                                  \
    const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)); \
    DSATTN_DP_FOR_SLICES(DSATTN_DP_FMA, r)                                \
  }
#define DSATTN_DP_STORE(r, v) \
  if constexpr (MR > r && NV > v) _mm512_mask_storeu_ps(C + r * ldc + 16 * v, DSATTN_DP_MASK(v), c##r##v);
#define DSATTN_DP_STORE_ROW(r) DSATTN_DP_FOR_SLICES(DSATTN_DP_STORE, r)
  DSATTN_DP_FOR_ROWS(DSATTN_DP_ROW_DECL)
  if (add_C) { DSATTN_DP_FOR_ROWS(DSATTN_DP_LOAD_ROW) }
  const uint16_t* b = B;
  const uint16_t* ar = A;
  Side work = *side;                 // (a local copy: its fields stay in registers across the side's stores)
  for (int64_t kp = 0; kp < K2; ++kp, b += 2 * ldb, ar += 2) {
    work.step(kp);
    const __m512i b0 = _mm512_maskz_loadu_epi32(DSATTN_DP_MASK(0), b);
    __m512i b1 = b0, b2 = b0, b3 = b0;
    if constexpr (NV > 1) b1 = _mm512_maskz_loadu_epi32(DSATTN_DP_MASK(1), b + 32);
    if constexpr (NV > 2) b2 = _mm512_maskz_loadu_epi32(DSATTN_DP_MASK(2), b + 64);
    if constexpr (NV > 3) b3 = _mm512_maskz_loadu_epi32(DSATTN_DP_MASK(3), b + 96);
    DSATTN_DP_FOR_ROWS(DSATTN_DP_FMA_ROW)
  }
  *side = work;
  DSATTN_DP_FOR_ROWS(DSATTN_DP_STORE_ROW)
#undef DSATTN_DP_MASK
#undef DSATTN_DP_ROW_DECL
#undef DSATTN_DP_FOR_SLICES
#undef DSATTN_DP_FOR_ROWS
#undef DSATTN_DP_LOAD
#undef DSATTN_DP_LOAD_ROW
#undef DSATTN_DP_FMA
#undef DSATTN_DP_FMA_ROW
#undef DSATTN_DP_STORE
#undef DSATTN_DP_STORE_ROW
}

// Rows [0, M) of one strip of NV column slices: whole 6-row tiles, then one tile of the rest.
template <int NV, typename Side>
void dpbf16_strip(int64_t M, int64_t K2, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float* C,
                  int64_t ldc, bool add_C, __mmask16 tail, Side* side) {
  using Tile = void (*)(int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, bool, __mmask16,
                        Side*);
  static constexpr Tile tiles[7] = {nullptr,
                                    dpbf16_tile<1, NV, Side>, dpbf16_tile<2, NV, Side>, dpbf16_tile<3, NV, Side>,
                                    dpbf16_tile<4, NV, Side>, dpbf16_tile<5, NV, Side>, dpbf16_tile<6, NV, Side>};
  for (int64_t r0 = 0; r0 < M; r0 += 6)
    tiles[std::min<int64_t>(6, M - r0)](K2, A + r0 * lda, lda, B, ldb, C + r0 * ldc, ldc, add_C, tail, side);
}

// Strips of 64 columns outside, blocks of K inside them, 6-row tiles innermost: a block of a strip of
// B (128 pairs of K x 256 bytes = 32 KB) stays in L1 / near while every row tile passes over it.  A
// tile leaves its fp32 sums in C between blocks and takes them up again exactly, so the blocking
// changes no bit of the result.  Zen 4, one core, operands in cache: blocks of 256 keys ran the
// attention's shapes at 220-229 GFLOP/s, of 128 at 205-217 (each block reloads and stores the tile's
// C and sets up its pointers again), unblocked 174-225 (P V with 32 rows lost its strip from L1).
constexpr int64_t DPBF16_KBLOCK = 256;

template <typename Side = LinePrefetch>
inline void dpbf16_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                        const uint16_t* A, const uint16_t* B, float* C, Side* pf = nullptr) {
  using Strip = void (*)(int64_t, int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, bool,
                         __mmask16, Side*);
  Side none{};
  if (pf == nullptr) pf = &none;
  static constexpr Strip strips[5] = {nullptr, dpbf16_strip<1, Side>, dpbf16_strip<2, Side>, dpbf16_strip<3, Side>,
                                      dpbf16_strip<4, Side>};
  TORCH_CHECK(K % 2 == 0, "dpbf16_gemm: K must be even (B is in pairs of K), got ", K);
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    const int64_t cols = std::min<int64_t>(64, N - n0);
    const __mmask16 tail = cols % 16 == 0 ? __mmask16(0xFFFF) : __mmask16((1u << (cols % 16)) - 1);
    for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += DPBF16_KBLOCK) {
      const int64_t kc = std::min(DPBF16_KBLOCK, K - k0);
      strips[(cols + 15) / 16](M, kc / 2, A + k0, lda, B + k0 * ldb + n0 * 2, ldb, C + n0, ldc, add_C || k0 > 0, tail,
                               pf);
    }
  }
}
#else   // !DSATTN_X86: no vdpbf16ps (gemm_kind never picks the micro-kernel here)
template <typename Side = LinePrefetch>
inline void dpbf16_gemm(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, const uint16_t*, const uint16_t*,
                        float*, Side* = nullptr) {
  TORCH_CHECK(false, "dpbf16_gemm: the AVX512-BF16 micro-kernel is built on x86-64 only");
}
#endif  // DSATTN_X86

// ---- dsattn's fp32 GEMM ----
//
// Every fp32 GEMM of the compiled layer runs here, never on a vendor library's kernel: MKL and oneDNN
// choose their kernels by the CPU's vendor and model, by M and by the ISA they are capped at, and their
// sums over K change order with that choice (an AMD Zen 4 capped at SSE4.1 gave another row sum for
// M = 3 than for M = 32 through cpublas::brgemm's MKL fallback).  Here each element of C has one fp32
// accumulator, taken from C (add_C) or zero, and K is summed into it in index order, one product per
// step: a fused multiply-add on the AVX2 / AVX-512 classes, a rounded product and an add in the
// baseline build (no FMA there).  Tiles, strips and blocks of K only choose which elements are worked
// on together, and a block leaves its exact fp32 sums in C for the next, so an element's bits depend on
// its row of A, its column of B, K and the class: never on M, N, where it falls in a tile, or the
// threads (callers split rows and columns, never K).
//
// AVX-512: tiles of MR <= 6 rows x 16 NV <= 64 columns in 24 zmm accumulators, per k NV loads of B and a
// broadcast of each row's A (the dpbf16 tile's register plan with one product per element and k);
// AVX2: MR <= 6 x 8 NV <= 16 columns in 12 ymm (16 registers: 12 + 2 B + 1 broadcast).  Blocks of
// FP32_KBLOCK k keep a strip of B (128 x 64 floats, 32 KB) in L1 while the row tiles pass over it.
constexpr int64_t FP32_KBLOCK = 128;

#if DSATTN_X86
template <int MR, int NV>
__attribute__((noinline, target("avx512f,avx512vl,fma"))) void fma512_tile(int64_t K, const float* A, int64_t lda,
                                                                           const float* B, int64_t ldb, float* C,
                                                                           int64_t ldc, bool add_C, __mmask16 tail) {
  static_assert(MR >= 1 && MR <= 6 && NV >= 1 && NV <= 4, "a tile is at most 6 rows x 4 column slices");
#define DSATTN_F_MASK(v) ((v) == NV - 1 ? tail : __mmask16(0xFFFF))
#define DSATTN_F_ROW_DECL(r) \
  __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = _mm512_setzero_ps(), c##r##2 = _mm512_setzero_ps(), \
         c##r##3 = _mm512_setzero_ps();
#define DSATTN_F_FOR_SLICES(op, r) op(r, 0) op(r, 1) op(r, 2) op(r, 3)
#define DSATTN_F_FOR_ROWS(op) op(0) op(1) op(2) op(3) op(4) op(5)
#define DSATTN_F_LOAD(r, v) \
  if constexpr (MR > r && NV > v) c##r##v = _mm512_maskz_loadu_ps(DSATTN_F_MASK(v), C + r * ldc + 16 * v);
#define DSATTN_F_LOAD_ROW(r) DSATTN_F_FOR_SLICES(DSATTN_F_LOAD, r)
#define DSATTN_F_FMA(r, v) \
  if constexpr (NV > v) c##r##v = _mm512_fmadd_ps(a, b##v, c##r##v);
#define DSATTN_F_FMA_ROW(r)                           \
  if constexpr (MR > r) {                             \
    const __m512 a = _mm512_set1_ps(ak[r * lda]);     \
    DSATTN_F_FOR_SLICES(DSATTN_F_FMA, r)              \
  }
#define DSATTN_F_STORE(r, v) \
  if constexpr (MR > r && NV > v) _mm512_mask_storeu_ps(C + r * ldc + 16 * v, DSATTN_F_MASK(v), c##r##v);
#define DSATTN_F_STORE_ROW(r) DSATTN_F_FOR_SLICES(DSATTN_F_STORE, r)
  DSATTN_F_FOR_ROWS(DSATTN_F_ROW_DECL)
  if (add_C) { DSATTN_F_FOR_ROWS(DSATTN_F_LOAD_ROW) }
  const float* b = B;
  const float* ak = A;
  for (int64_t k = 0; k < K; ++k, b += ldb, ++ak) {
    const __m512 b0 = _mm512_maskz_loadu_ps(DSATTN_F_MASK(0), b);
    __m512 b1 = b0, b2 = b0, b3 = b0;
    if constexpr (NV > 1) b1 = _mm512_maskz_loadu_ps(DSATTN_F_MASK(1), b + 16);
    if constexpr (NV > 2) b2 = _mm512_maskz_loadu_ps(DSATTN_F_MASK(2), b + 32);
    if constexpr (NV > 3) b3 = _mm512_maskz_loadu_ps(DSATTN_F_MASK(3), b + 48);
    DSATTN_F_FOR_ROWS(DSATTN_F_FMA_ROW)
  }
  DSATTN_F_FOR_ROWS(DSATTN_F_STORE_ROW)
#undef DSATTN_F_MASK
#undef DSATTN_F_ROW_DECL
#undef DSATTN_F_FOR_SLICES
#undef DSATTN_F_FOR_ROWS
#undef DSATTN_F_LOAD
#undef DSATTN_F_LOAD_ROW
#undef DSATTN_F_FMA
#undef DSATTN_F_FMA_ROW
#undef DSATTN_F_STORE
#undef DSATTN_F_STORE_ROW
}

// AVX2: a strip whose last 8-column slice is partial (Masked) loads and stores that slice through a lane mask
// (maskload reads no lane past it); whole strips use plain loads, which vmaskmovps costs more than.
template <int MR, int NV, bool Masked>
__attribute__((noinline, target("avx2,fma"))) void fma256_tile(int64_t K, const float* A, int64_t lda, const float* B,
                                                               int64_t ldb, float* C, int64_t ldc, bool add_C,
                                                               int tail_lanes) {
  static_assert(MR >= 1 && MR <= 6 && NV >= 1 && NV <= 2, "a tile is at most 6 rows x 2 column slices");
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(tail_lanes), lanes);
#define DSATTN_F_MASKED(v) (Masked && (v) == NV - 1)
#define DSATTN_F_LD(p, v) (DSATTN_F_MASKED(v) ? _mm256_maskload_ps((p), tail) : _mm256_loadu_ps(p))
#define DSATTN_F_ROW_DECL(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
#define DSATTN_F_FOR_SLICES(op, r) op(r, 0) op(r, 1)
#define DSATTN_F_FOR_ROWS(op) op(0) op(1) op(2) op(3) op(4) op(5)
#define DSATTN_F_LOAD(r, v) \
  if constexpr (MR > r && NV > v) c##r##v = DSATTN_F_LD(C + r * ldc + 8 * v, v);
#define DSATTN_F_LOAD_ROW(r) DSATTN_F_FOR_SLICES(DSATTN_F_LOAD, r)
#define DSATTN_F_FMA(r, v) \
  if constexpr (NV > v) c##r##v = _mm256_fmadd_ps(a, b##v, c##r##v);
#define DSATTN_F_FMA_ROW(r)                           \
  if constexpr (MR > r) {                             \
    const __m256 a = _mm256_broadcast_ss(ak + r * lda); \
    DSATTN_F_FOR_SLICES(DSATTN_F_FMA, r)              \
  }
#define DSATTN_F_STORE(r, v)                                                                        \
  if constexpr (MR > r && NV > v) {                                                                   \
    if constexpr (DSATTN_F_MASKED(v)) _mm256_maskstore_ps(C + r * ldc + 8 * v, tail, c##r##v);        \
    else _mm256_storeu_ps(C + r * ldc + 8 * v, c##r##v);                                              \
  }
#define DSATTN_F_STORE_ROW(r) DSATTN_F_FOR_SLICES(DSATTN_F_STORE, r)
  DSATTN_F_FOR_ROWS(DSATTN_F_ROW_DECL)
  if (add_C) { DSATTN_F_FOR_ROWS(DSATTN_F_LOAD_ROW) }
  const float* b = B;
  const float* ak = A;
  for (int64_t k = 0; k < K; ++k, b += ldb, ++ak) {
    const __m256 b0 = DSATTN_F_LD(b, 0);
    __m256 b1 = b0;
    if constexpr (NV > 1) b1 = DSATTN_F_LD(b + 8, 1);
    DSATTN_F_FOR_ROWS(DSATTN_F_FMA_ROW)
  }
  DSATTN_F_FOR_ROWS(DSATTN_F_STORE_ROW)
#undef DSATTN_F_MASKED
#undef DSATTN_F_LD
#undef DSATTN_F_ROW_DECL
#undef DSATTN_F_FOR_SLICES
#undef DSATTN_F_FOR_ROWS
#undef DSATTN_F_LOAD
#undef DSATTN_F_LOAD_ROW
#undef DSATTN_F_FMA
#undef DSATTN_F_FMA_ROW
#undef DSATTN_F_STORE
#undef DSATTN_F_STORE_ROW
}

template <int LANES, int MR, int NV, bool Masked>
constexpr auto fma_tile() {
  if constexpr (LANES == 16) return &fma512_tile<MR, NV>;
  else return &fma256_tile<MR, NV, Masked>;
}

// One strip of a class's tiles: its rows in tiles of 6 (then the rest), over a block of K.  (AVX-512's masked
// loads cost what plain ones do: one build; AVX2's two, a whole last slice or a partial one.)
template <int NV, int LANES, typename Tail>
void fma_strip(int64_t M, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
               bool add_C, Tail tail) {
  using Tile = void (*)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t, bool, Tail);
  static constexpr Tile whole[7] = {nullptr, fma_tile<LANES, 1, NV, false>(), fma_tile<LANES, 2, NV, false>(),
                                    fma_tile<LANES, 3, NV, false>(), fma_tile<LANES, 4, NV, false>(),
                                    fma_tile<LANES, 5, NV, false>(), fma_tile<LANES, 6, NV, false>()};
  static constexpr Tile masked[7] = {nullptr, fma_tile<LANES, 1, NV, true>(), fma_tile<LANES, 2, NV, true>(),
                                     fma_tile<LANES, 3, NV, true>(), fma_tile<LANES, 4, NV, true>(),
                                     fma_tile<LANES, 5, NV, true>(), fma_tile<LANES, 6, NV, true>()};
  const Tile* tiles = LANES == 16 || tail == Tail(LANES) ? whole : masked;
  for (int64_t r0 = 0; r0 < M; r0 += 6)
    tiles[std::min<int64_t>(6, M - r0)](K, A + r0 * lda, lda, B, ldb, C + r0 * ldc, ldc, add_C, tail);
}

// Strips of NVMAX * LANES columns outside, blocks of K inside them, row tiles innermost.
template <int LANES, int NVMAX>
void fma_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C, const float* A,
              const float* B, float* C) {
  using Tail = std::conditional_t<LANES == 16, __mmask16, int>;
  using Strip = void (*)(int64_t, int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t, bool, Tail);
  static constexpr Strip strips[5] = {nullptr, fma_strip<1, LANES, Tail>, fma_strip<std::min(2, NVMAX), LANES, Tail>,
                                      fma_strip<std::min(3, NVMAX), LANES, Tail>,
                                      fma_strip<std::min(4, NVMAX), LANES, Tail>};
  constexpr int64_t width = LANES * NVMAX;
  for (int64_t n0 = 0; n0 < N; n0 += width) {
    const int64_t cols = std::min(width, N - n0), rem = cols % LANES;
    Tail tail;
    if constexpr (LANES == 16) tail = rem == 0 ? __mmask16(0xFFFF) : __mmask16((1u << rem) - 1);
    else tail = rem == 0 ? LANES : static_cast<int>(rem);
    for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += FP32_KBLOCK)
      strips[(cols + LANES - 1) / LANES](M, std::min(FP32_KBLOCK, K - k0), A + k0, lda, B + k0 * ldb + n0, ldb,
                                         C + n0, ldc, add_C || k0 > 0, tail);
  }
}
#endif  // DSATTN_X86

// The baseline build (other architectures, and x86 capped at generic): tiles of MR <= 6 rows x 8 columns in
// 4-lane vectors of GCC's generic vector extension (SSE2 on x86-64, NEON on aarch64, scalar code elsewhere),
// every element's sum element-wise, k in order.  Named vectors, not a float array: with an array (partly
// filled from C at the edges) GCC kept the sums on the stack, 2 GFLOP/s against 15 a core (Sapphire Rapids,
// SSE2; MKL's SSE4.2 sgemm 18).
typedef float fp32x4 __attribute__((vector_size(16)));

inline fp32x4 load_fp32x4(const float* p) {
  fp32x4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int MR>
void fp32_generic_tile(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                       bool add_C, int64_t cols) {
  constexpr int64_t NC = 8;
  float edge[MR][NC] = {};                    // C's tile in and out (its columns past cols stay zero)
  if (add_C)
    for (int r = 0; r < MR; ++r) std::copy(C + r * ldc, C + r * ldc + cols, edge[r]);
  fp32x4 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = load_fp32x4(edge[r]), acc[r][1] = load_fp32x4(edge[r] + 4);
  float pad[NC] = {};                         // a row of B past its last column: zeros
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    if (cols < NC) {
      std::copy(b, b + cols, pad);
      b = pad;
    }
    const fp32x4 b0 = load_fp32x4(b), b1 = load_fp32x4(b + 4);
    for (int r = 0; r < MR; ++r) {
      const float a = A[r * lda + k];
      acc[r][0] += a * b0;
      acc[r][1] += a * b1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    std::memcpy(edge[r], &acc[r][0], sizeof acc[r][0]);
    std::memcpy(edge[r] + 4, &acc[r][1], sizeof acc[r][1]);
    std::copy(edge[r], edge[r] + cols, C + r * ldc);
  }
}

inline void fp32_gemm_generic(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                              const float* A, const float* B, float* C) {
  using Tile = void (*)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t, bool, int64_t);
  static constexpr Tile tiles[7] = {nullptr, fp32_generic_tile<1>, fp32_generic_tile<2>, fp32_generic_tile<3>,
                                    fp32_generic_tile<4>, fp32_generic_tile<5>, fp32_generic_tile<6>};
  for (int64_t n0 = 0; n0 < N; n0 += 8)
    for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += FP32_KBLOCK)
      for (int64_t r0 = 0; r0 < M; r0 += 6)
        tiles[std::min<int64_t>(6, M - r0)](std::min(FP32_KBLOCK, K - k0), A + r0 * lda + k0, lda, B + k0 * ldb + n0,
                                           ldb, C + r0 * ldc + n0, ldc, add_C || k0 > 0,
                                           std::min<int64_t>(8, N - n0));
}

// C [M, N] (+)= A [M, K] B [K, N], fp32, row-major with leading dimensions lda / ldb / ldc.
inline void fp32_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                      const float* A, const float* B, float* C) {
  if (M <= 0 || N <= 0) return;
#if DSATTN_X86
  if (isa_has(ISA_AVX512)) return fma_gemm<16, 4>(M, N, K, lda, ldb, ldc, add_C, A, B, C);
  if (isa_has(ISA_AVX2)) return fma_gemm<8, 2>(M, N, K, lda, ldb, ldc, add_C, A, B, C);
#endif
  fp32_gemm_generic(M, N, K, lda, ldb, ldc, add_C, A, B, C);
}

#if DSATTN_HAVE_BRGEMM
// ---- the kernels' GEMM call ----
//
// gemm(...) has cpublas::brgemm's arguments; 16-bit operands take B as pair panels (vnni).
inline void gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C, const float* A,
                 const float* B, float* C, bool /*vnni: fp32 B is plain*/, LinePrefetch* = nullptr) {
  fp32_gemm(M, N, K, lda, ldb, ldc, add_C, A, B, C);
}

inline void gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                 const c10::BFloat16* A, const c10::BFloat16* B, float* C, bool vnni, LinePrefetch* pf = nullptr) {
  if (gemm_kind(at::kBFloat16) == KIND_AVX512BF16)
    dpbf16_gemm(M, N, K, lda, ldb, ldc, add_C, reinterpret_cast<const uint16_t*>(A),
                reinterpret_cast<const uint16_t*>(B), C, pf);
  else
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, A, B, C, vnni);
}

inline void gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                 const c10::Half* A, const c10::Half* B, float* C, bool vnni, LinePrefetch* = nullptr) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, A, B, C, vnni);
}

// ---- timing the 16-bit kernels on the attention's shapes ----

// Seconds of one C [M, N] = A [M, K] B [K, N] on random bf16 operands in cache, B in pair panels of
// ``panel`` columns (ldb = panel), through ``kind`` (KIND_AVX512BF16 or a ukernel kind): the best of
// ``trials`` runs of ``calls`` calls, on the calling thread.  C: where the last call's result goes
// (M x N), or null.
inline double gemm_seconds(GemmKind kind, int64_t M, int64_t N, int64_t K, int64_t panel, int calls = 8,
                           int trials = 5, float* C_out = nullptr) {
  std::vector<uint16_t> A(M * K), B(K * N);
  uint32_t x = 12345u;
  auto next = [&x]() {              // bf16 bits of a value in [-1, 1)
    x = x * 1664525u + 1013904223u;
    const float f = static_cast<float>(x >> 8) * 0x1p-23f - 1.0f;
    return static_cast<uint16_t>(__builtin_bit_cast(uint32_t, f) >> 16);
  };
  for (auto& a : A) a = next();
  for (auto& b : B) b = next();
  std::vector<float> C(M * N);
  auto call = [&]() {
    for (int64_t d0 = 0; d0 < N; d0 += panel) {
      const int64_t w = std::min(panel, N - d0);
      const uint16_t* bp = B.data() + d0 * K;
      if (kind == KIND_AVX512BF16)
        dpbf16_gemm(M, w, K, K, w, N, false, A.data(), bp, C.data() + d0);
      else
        at::native::cpublas::brgemm(M, w, K, K, w, N, false, reinterpret_cast<const c10::BFloat16*>(A.data()),
                                    reinterpret_cast<const c10::BFloat16*>(bp), C.data() + d0, true);
    }
  };
  call();
  double best = 1e30;
  for (int t = 0; t < trials; ++t) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int c = 0; c < calls; ++c) call();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / calls);
  }
  if (kind != KIND_AVX512BF16) at::native::cpublas::brgemm_release(true);
  if (C_out != nullptr) std::copy(C.begin(), C.end(), C_out);
  return best;
}

// Seconds of one fp32 C [M, N] = A [M, K] B [K, N] (plain row-major operands in cache) on dsattn's fp32 GEMM
// (own) or on ATen's cpublas::brgemm (oneDNN's fp32 ukernel, or MKL's sgemm where oneDNN is capped below it:
// what the fp32 path ran before it was dsattn's): the best of ``trials`` runs of ``calls`` calls, this thread.
inline double fp32_gemm_seconds(bool own, int64_t M, int64_t N, int64_t K, int calls = 8, int trials = 5) {
  std::vector<float> A(M * K), B(K * N), C(M * N);
  uint32_t x = 12345u;
  auto next = [&x]() {
    x = x * 1664525u + 1013904223u;
    return static_cast<float>(x >> 8) * 0x1p-23f - 1.0f;
  };
  for (auto& a : A) a = next();
  for (auto& b : B) b = next();
  auto call = [&]() {
    if (own)
      fp32_gemm(M, N, K, K, N, N, false, A.data(), B.data(), C.data());
    else
      at::native::cpublas::brgemm(M, N, K, K, N, N, false, A.data(), B.data(), C.data(), false);
  };
  call();
  double best = 1e30;
  for (int t = 0; t < trials; ++t) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int c = 0; c < calls; ++c) call();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / calls);
  }
  return best;
}

// The attention's GEMMs of one V4 query row: S^T of a ring chunk (128 keys x 64 heads, K 512) and
// P V (64 heads x 512 dims in 64-column strips, K 640 keys).
inline double attention_shapes_seconds(GemmKind kind) {
  return gemm_seconds(kind, 128, 64, 512, 64) * 5 + gemm_seconds(kind, 64, 512, 640, 64);
}

inline Bf16Choice measure_bf16_choice() {
  Bf16Choice c;
  if (cpu_runs_amx(at::kBFloat16) || !cpu_has_avx512bf16()) return c;
  c.measured = true;
  // oneDNN's ukernel on bf16 without AMX: it must run, and agree with the micro-kernel (same
  // products, fp32 sums in another order) before its speed counts
  const int64_t M = 64, N = 64, K = 512;
  std::vector<float> own(M * N), theirs(M * N);
  gemm_seconds(KIND_AVX512BF16, M, N, K, 64, 1, 1, own.data());
  try {
    gemm_seconds(KIND_ONEDNN, M, N, K, 64, 1, 1, theirs.data());
    double err = 0.0;
    for (int64_t i = 0; i < M * N; ++i) err = std::max(err, double(std::fabs(own[i] - theirs[i])));
    c.onednn_runs = err <= 1e-3;      // |C| ~ 10 for these operands: reassociation is ~1e-5
    if (!c.onednn_runs) c.why = "oneDNN's bf16 ukernel disagreed with the micro-kernel";
  } catch (const std::exception& e) {
    c.why = std::string("oneDNN's bf16 ukernel does not run here: ") + e.what();
  }
  const double flops = 2.0 * (5 * 128 * 64 * 512 + 64 * 512 * 640);
  c.own_gflops = flops / attention_shapes_seconds(KIND_AVX512BF16) / 1e9;
  if (c.onednn_runs) {
    c.onednn_gflops = flops / attention_shapes_seconds(KIND_ONEDNN) / 1e9;
    // A clear margin: on Zen 4 the two run these shapes within 2-5 % of each other in cache, where a
    // noisy timing must not flip the choice (and the sums' order) from one process to the next, and
    // in the whole kernel the micro-kernel was as fast at B 32 and faster at B 1 (oneDNN's per-call
    // cost: one-request HCA decode 0.34 ms against 0.58).
    c.onednn = c.onednn_gflops > 1.10 * c.own_gflops;
  }
  if (c.why.empty())
    c.why = c.onednn ? "oneDNN's avx512_core_bf16 ukernel is over 10 % faster on the attention's shapes"
                     : "the micro-kernel is within 10 % of oneDNN's avx512_core_bf16 ukernel or faster";
  return c;
}

// After a thread's last 16-bit GEMM: the AMX ukernel releases its tile configuration.
template <typename mm_t>
void gemm_release() {
  if constexpr (!std::is_same_v<mm_t, float>)
    if (gemm_kind(c10::CppTypeToScalarType<mm_t>::value) == KIND_AMX) at::native::cpublas::brgemm_release(true);
}

#else   // !DSATTN_HAVE_BRGEMM: no ukernel to compare with, and no kernel that multiplies

inline Bf16Choice measure_bf16_choice() { return Bf16Choice{}; }

#endif  // DSATTN_HAVE_BRGEMM

}  // namespace dsattn_native
