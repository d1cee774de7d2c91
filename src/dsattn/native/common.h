// Pieces the compiled CPU kernels share (attention.cpp, indexer.cpp).
#pragma once

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

// The attention and indexer kernels run on ATen's exported batch-reduce GEMM (cpublas::brgemm,
// oneDNN's ukernel), which CPUBlas.h announces with these macros (recent torch versions); with a
// torch that lacks it they compile to stubs, kernels_available() says so and the PyTorch paths run.
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F32F32F32)
#define DSATTN_HAVE_BRGEMM 1
#else
#define DSATTN_HAVE_BRGEMM 0
#endif

namespace dsattn_native {

constexpr int64_t PANEL = 64;  // a packed B panel of oneDNN's ukernel is 16, 32, 48 or 64 columns wide

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// q^T [Dp, Hp] of one query row q [H, D] (zero padded) as a GEMM's B operand: for 16-bit operands
// the ukernel's packed panels, [Dp/2][w][2] for each 64-head panel (panel h0 starts at h0 * Dp;
// a pair of q's dims is one 32-bit word per head, copied as such), else plain fp32 [Dp][Hp].
template <typename scalar_t, typename mm_t>
void pack_query(const scalar_t* q, int64_t H, int64_t D, int64_t Hp, int64_t Dp, mm_t* out) {
  if constexpr (std::is_same_v<mm_t, float>) {
    std::fill(out, out + Dp * Hp, 0.0f);
    for (int64_t h = 0; h < H; ++h)                 // (reads along q's rows)
      for (int64_t d = 0; d < D; ++d) out[d * Hp + h] = static_cast<float>(q[h * D + d]);
  } else {
    static_assert(std::is_same_v<scalar_t, mm_t>, "16-bit GEMM operands are the query dtype");
    std::fill(out, out + Dp * Hp, mm_t(0));
    for (int64_t h0 = 0; h0 < Hp; h0 += PANEL) {
      const int64_t w = std::min(PANEL, Hp - h0);
      mm_t* panel = out + h0 * Dp;
      for (int64_t c = 0; c < w && h0 + c < H; ++c) {
        const scalar_t* row = q + (h0 + c) * D;
        if (D % 2 == 0) {
          for (int64_t k = 0; k < D / 2; ++k) {
            uint32_t word;
            std::memcpy(&word, row + 2 * k, sizeof word);
            std::memcpy(panel + (k * w + c) * 2, &word, sizeof word);
          }
        } else {
          for (int64_t d = 0; d < D; ++d) panel[((d / 2) * w + c) * 2 + d % 2] = row[d];
        }
      }
    }
  }
}

}  // namespace dsattn_native
