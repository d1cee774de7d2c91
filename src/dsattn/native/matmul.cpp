// C = A B^T for row-major A [R, K] and B [N, K] (fp32 C), with every row's result independent of the
// other rows and of the thread count: the threads split the rows and the columns, never K, and every
// element is summed over K in one order by the GEMM of gemm.h (AMX / AVX512-BF16 with 16-bit operands,
// fp32 otherwise), whatever the block shapes.  torch.matmul gives no such promise (MKL splits K across
// threads for some shapes, and picks kernels by M), so the compressor's projections, which mix the
// tokens of every request of a call into one GEMM, run here when a request's results must not depend
// on its batch.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
#include <cstdlib>
#include <type_traits>
#include <vector>

#if DSATTN_HAVE_BRGEMM

namespace {

using dsattn_native::Buffer;
using dsattn_native::PANEL;
using dsattn_native::round_up;

constexpr int64_t ROW_BLOCK = 32;    // rows of B (weights) per GEMM call

// Scratch of the calling thread, kept between calls up to KEEP bytes: a fresh 32 MB block costs ~8 ms
// of page faults on every call (glibc returns large blocks to the kernel), more than packing it.
constexpr size_t KEEP = size_t(256) << 20;
struct Scratch {
  void* p = nullptr;
  size_t bytes = 0;
  ~Scratch() { std::free(p); }
  void* get(size_t n) {
    n = (n + 63) / 64 * 64;
    if (n > bytes) {
      std::free(p);
      p = std::aligned_alloc(64, n);
      TORCH_CHECK(p != nullptr, "rows_matmul: out of memory for ", n, " bytes of scratch");
      bytes = n;
    }
    return p;
  }
  void trim() {
    if (bytes > KEEP) std::free(p), p = nullptr, bytes = 0;
  }
};
thread_local Scratch packed_scratch, product_scratch;

// C^T [N, R] = B [N, K] A^T, the GEMM's A operand being B's rows as they lie (weights: no packing per
// call) and its B operand A^T (the activations, packed once): a decode call with a few rows packs a few
// rows.  K goes in chunks of KC in order (add_C after the first), so each element's sum over K runs in one
// order whatever R, the panel a row falls in, or the thread count; then C^T is transposed into C.
template <typename scalar_t, typename mm_t>
void rows_matmul_impl(const at::Tensor& a, const std::vector<at::Tensor>& bs, std::vector<at::Tensor>& cs) {
  constexpr bool packed = !std::is_same_v<mm_t, float>;
  const int64_t R = a.size(0), K = a.size(1);
  const int64_t Kp = packed ? round_up(K, 2) : K, Rp = round_up(R, 16);
  const int64_t KC = packed ? 512 : 256;
  const scalar_t* ap = a.data_ptr<scalar_t>();
  // A^T, once for every B: 16-bit operands as pair panels [Kp/2][w][2] per panel of w <= PANEL columns (panel t0 at t0 * Kp),
  // fp32 as plain [K][Rp]; zero past R
  // (scratch without a fill: every element the GEMMs read is written below)
  mm_t* at_ = static_cast<mm_t*>(packed_scratch.get(Kp * Rp * sizeof(mm_t)));
  const int64_t panels = (Rp + PANEL - 1) / PANEL;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t t0 = p * PANEL, w = std::min(PANEL, Rp - t0), rows = std::max<int64_t>(0, std::min(w, R - t0));
      if constexpr (packed) {
        mm_t* panel = at_ + t0 * Kp;
        if (std::is_same_v<scalar_t, mm_t> && K % 2 == 0) {
          dsattn_native::transpose_words(reinterpret_cast<const uint32_t*>(ap + t0 * K), K / 2, rows, K / 2,
                                         reinterpret_cast<uint32_t*>(panel), w);
          for (int64_t kp = 0; kp < Kp / 2; ++kp)                 // padded columns: zero
            std::fill(panel + (kp * w + rows) * 2, panel + (kp * w + w) * 2, mm_t(0));
        } else {
          std::fill(panel, panel + Kp * w, mm_t(0));
          for (int64_t t = 0; t < rows; ++t)
            for (int64_t k = 0; k < K; ++k)
              panel[((k / 2) * w + t) * 2 + k % 2] = static_cast<mm_t>(static_cast<float>(ap[(t0 + t) * K + k]));
        }
      } else {
        if constexpr (std::is_same_v<scalar_t, float>) {
          dsattn_native::transpose32(ap + t0 * K, K, rows, K, at_ + t0, Rp);
        } else {
          for (int64_t t = 0; t < rows; ++t)
            for (int64_t k = 0; k < K; ++k) at_[k * Rp + t0 + t] = static_cast<float>(ap[(t0 + t) * K + k]);
        }
        for (int64_t k = 0; k < K; ++k) std::fill(at_ + k * Rp + t0 + rows, at_ + k * Rp + t0 + w, 0.0f);
      }
    }
  });
  const bool rows_direct = std::is_same_v<scalar_t, mm_t> && K == Kp;
  for (size_t which = 0; which < bs.size(); ++which) {
  const int64_t N = bs[which].size(0);
  const scalar_t* bp = bs[which].data_ptr<scalar_t>();
  float* ct = static_cast<float*>(product_scratch.get(N * Rp * sizeof(float)));
  const int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
  at::parallel_for(0, panels * blocks, 1, [&](int64_t u0, int64_t u1) {
    Buffer<mm_t> wrows(rows_direct ? 0 : ROW_BLOCK * KC, mm_t(0));
    for (int64_t g0 = u0; g0 < u1;) {                  // this thread's units of one panel (its C stays in cache)
      const int64_t g1 = std::min(u1, (g0 / blocks + 1) * blocks);
    for (int64_t k0 = 0; k0 < Kp; k0 += KC) {          // chunks of K in order, each over those units
      const int64_t kc = std::min(KC, Kp - k0);
      for (int64_t u = g0; u < g1; ++u) {
        const int64_t t0 = (u / blocks) * PANEL, w = std::min(PANEL, Rp - t0);
        const int64_t n0 = (u % blocks) * ROW_BLOCK, m = std::min(ROW_BLOCK, N - n0);
        const mm_t* A = reinterpret_cast<const mm_t*>(bp + n0 * K) + k0;
        int64_t lda = K;
        if (!rows_direct) {                             // (converted / K-padded rows of this chunk)
          for (int64_t i = 0; i < m; ++i)
            for (int64_t k = 0; k < kc; ++k)
              wrows[i * KC + k] = k0 + k < K ? static_cast<mm_t>(static_cast<float>(bp[(n0 + i) * K + k0 + k])) : mm_t(0);
          A = wrows.data(), lda = KC;
        }
        float* C = ct + n0 * Rp + t0;
        if constexpr (packed)
          dsattn_native::gemm(m, w, kc, lda, w, Rp, k0 > 0, A, at_ + t0 * Kp + k0 * w, C, true);
        else
          dsattn_native::gemm(m, w, kc, lda, Rp, Rp, k0 > 0, A, at_ + k0 * Rp + t0, C, false);
      }
    }
      g0 = g1;
    }
    dsattn_native::gemm_release<mm_t>();
  });
  float* cp = cs[which].data_ptr<float>();
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t s0, int64_t s1) {   // C [R, N] from strips of 16 rows of C^T
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t n0 = s * 16, rows = std::min<int64_t>(16, N - n0);
      dsattn_native::transpose32(ct + n0 * Rp, Rp, rows, R, cp + n0, N);
    }
  });
  }
  packed_scratch.trim();
  product_scratch.trim();
}

}  // namespace

// A [R, K] times each B_i [N_i, K] transposed, fp32 [R, N_i] each; A is packed once for all of them.
std::vector<at::Tensor> rows_matmul(const at::Tensor& a, const std::vector<at::Tensor>& bs) {
  TORCH_CHECK(a.dim() == 2 && a.device().is_cpu() && a.is_contiguous(), "a: a contiguous CPU [R, K] tensor, got ",
              a.sizes());
  std::vector<at::Tensor> cs;
  for (size_t i = 0; i < bs.size(); ++i) {
    const auto& b = bs[i];
    TORCH_CHECK(b.dim() == 2 && b.size(1) == a.size(1), "b[", i, "]: expected [N, K=", a.size(1), "], got ",
                b.sizes());
    TORCH_CHECK(b.scalar_type() == a.scalar_type(), "b[", i, "]: dtype ", b.scalar_type(), ", expected a's ",
                a.scalar_type());
    TORCH_CHECK(b.device().is_cpu() && b.is_contiguous(), "b[", i, "]: a contiguous CPU tensor");
    cs.push_back(at::empty({a.size(0), b.size(0)}, a.options().dtype(at::kFloat)));
  }
  if (a.size(0) == 0 || bs.empty()) return cs;
  if (a.size(1) == 0) {
    for (auto& c : cs) c.zero_();
    return cs;
  }
  dsattn_native::dispatch_gemm(a.scalar_type(), [&](auto s, auto m) { rows_matmul_impl<decltype(s), decltype(m)>(a, bs, cs); });
  return cs;
}

#else  // !DSATTN_HAVE_BRGEMM

std::vector<at::Tensor> rows_matmul(const at::Tensor&, const std::vector<at::Tensor>&) {
  TORCH_CHECK(false, "this torch has no cpublas::brgemm: the compiled matmul is not available");
}

#endif
