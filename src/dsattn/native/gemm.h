// The GEMMs of the compiled kernels, and which one runs.
//
// Every GEMM is C [M, N] (+)= A [M, K] B [K, N] with fp32 C.  Three paths:
//   amx         16-bit operands on ATen's batch-reduce ukernel (cpublas::brgemm, oneDNN), where
//               cpublas::could_pack says the CPU multiplies them natively (AMX);
//   avx512bf16  bf16 operands on our own micro-kernel over vdpbf16ps, where the CPU has AVX512-BF16
//               but oneDNN's ukernel does not pack (Zen 4 / Zen 5 EPYC, Cooper Lake);
//   fp32        operands widened to fp32 as rows are read, on the ukernel's fp32 GEMM (AVX2, AVX-512F).
// The 16-bit paths read the same operands: A row-major, B in pair-interleaved panels [K/2][w][2]
// (ldb = w), so the kernels pack once whichever 16-bit path runs.  Both multiply exact bf16 products
// and sum in fp32; only the summation order differs, and the golden's rounding points (which operand
// is rounded to bf16 where) are the kernels' and the same on every path.
#pragma once

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

namespace dsattn_native {

enum GemmPath : int { GEMM_BEST = 0, GEMM_AVX512BF16 = 1, GEMM_FP32 = 2 };

// The path the process asked for: the CPU's best (default), or one forced (DSATTN_NATIVE_GEMM, the
// tests and the benchmarks: dsattn.native.gemm_path()).
inline std::atomic<int>& gemm_request() {
  static std::atomic<int> request{GEMM_BEST};
  return request;
}

inline bool cpu_has_avx512bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  return has;
}

enum GemmKind : int { KIND_AMX, KIND_AVX512BF16, KIND_FP32 };

// Which GEMM a query dtype runs.
inline GemmKind gemm_kind(at::ScalarType dt) {
  const int request = gemm_request().load(std::memory_order_relaxed);
  if (request == GEMM_FP32 || (dt != at::kBFloat16 && dt != at::kHalf)) return KIND_FP32;
  if (dt == at::kBFloat16 && request == GEMM_AVX512BF16) return cpu_has_avx512bf16() ? KIND_AVX512BF16 : KIND_FP32;
  if (at::native::cpublas::could_pack(dt)) return KIND_AMX;
  // vdpbf16ps multiplies bf16 only; fp16 without a native ukernel takes the fp32 path
  if (dt == at::kBFloat16 && cpu_has_avx512bf16()) return KIND_AVX512BF16;
  return KIND_FP32;
}

inline const char* gemm_kind_name(GemmKind kind) {
  return kind == KIND_AMX ? "amx" : kind == KIND_AVX512BF16 ? "avx512bf16" : "fp32";
}

// Whether a dtype's GEMMs take 16-bit operands (either 16-bit path).
inline bool packed_gemm(at::ScalarType dt) { return gemm_kind(dt) != KIND_FP32; }

// ---- the AVX512-BF16 micro-kernel ----
//
// A block of MR rows x 32 columns lives in 2 MR accumulators (16 for MR = 8); per pair of K it loads
// two 16-column slices of B's pair panel and broadcasts each row's A pair (one 32-bit word) into
// vdpbf16ps.  Columns past N are masked (loads zero, stores skipped).  Strips of 32 columns outside,
// blocks of rows inside: a strip of B (K/2 x 128 bytes: 32 KB at K = 512) stays in L1 while the
// rows stream past it.
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void dpbf16_block(
    int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float* C, int64_t ldc, bool add_C,
    __mmask16 m0, __mmask16 m1) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = add_C ? _mm512_maskz_loadu_ps(m0, C + i * ldc) : _mm512_setzero_ps();
    acc[i][1] = add_C ? _mm512_maskz_loadu_ps(m1, C + i * ldc + 16) : _mm512_setzero_ps();
  }
  const int64_t K2 = K / 2;
  for (int64_t kp = 0; kp < K2; ++kp) {
    const uint16_t* b = B + kp * ldb * 2;
    const __m512i b0 = _mm512_maskz_loadu_epi32(m0, b), b1 = _mm512_maskz_loadu_epi32(m1, b + 32);
    for (int i = 0; i < MR; ++i) {
      uint32_t pair;
      std::memcpy(&pair, A + i * lda + 2 * kp, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, (__m512bh)b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, (__m512bh)b1);
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm512_mask_storeu_ps(C + i * ldc, m0, acc[i][0]);
    _mm512_mask_storeu_ps(C + i * ldc + 16, m1, acc[i][1]);
  }
}

inline void dpbf16_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                        const uint16_t* A, const uint16_t* B, float* C) {
  using Block = void (*)(int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, bool,
                         __mmask16, __mmask16);
  static constexpr Block blocks[9] = {nullptr,          dpbf16_block<1>, dpbf16_block<2>, dpbf16_block<3>,
                                      dpbf16_block<4>, dpbf16_block<5>, dpbf16_block<6>, dpbf16_block<7>,
                                      dpbf16_block<8>};
  TORCH_CHECK(K % 2 == 0, "dpbf16_gemm: K must be even (B is in pairs of K), got ", K);
  for (int64_t n0 = 0; n0 < N; n0 += 32) {
    const int64_t cols = std::min<int64_t>(32, N - n0);
    const __mmask16 m0 = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? __mmask16(0xFFFF) : cols <= 16 ? __mmask16(0) : __mmask16((1u << (cols - 16)) - 1);
    for (int64_t r0 = 0; r0 < M; r0 += 8) {
      const int64_t rows = std::min<int64_t>(8, M - r0);
      blocks[rows](K, A + r0 * lda, lda, B + n0 * 2, ldb, C + r0 * ldc + n0, ldc, add_C, m0, m1);
    }
  }
}

#if DSATTN_HAVE_BRGEMM
// ---- the kernels' GEMM call ----
//
// gemm(...) has cpublas::brgemm's arguments; 16-bit operands take B as pair panels (vnni).
inline void gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C, const float* A,
                 const float* B, float* C, bool /*vnni: fp32 B is plain*/) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, A, B, C, false);
}

inline void gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                 const c10::BFloat16* A, const c10::BFloat16* B, float* C, bool vnni) {
  if (gemm_kind(at::kBFloat16) == KIND_AVX512BF16)
    dpbf16_gemm(M, N, K, lda, ldb, ldc, add_C, reinterpret_cast<const uint16_t*>(A),
                reinterpret_cast<const uint16_t*>(B), C);
  else
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, A, B, C, vnni);
}

inline void gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                 const c10::Half* A, const c10::Half* B, float* C, bool vnni) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, A, B, C, vnni);
}

// After a thread's last 16-bit GEMM: the AMX ukernel releases its tile configuration.
template <typename mm_t>
void gemm_release() {
  if constexpr (!std::is_same_v<mm_t, float>)
    if (gemm_kind(c10::CppTypeToScalarType<mm_t>::value) == KIND_AMX) at::native::cpublas::brgemm_release(true);
}

#endif  // DSATTN_HAVE_BRGEMM

}  // namespace dsattn_native
