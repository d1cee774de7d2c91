// Lightning-indexer scores on the CPU (issue 15): score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j])
// for query rows t of one request against a contiguous run of its keys (the shared-key path of
// dsattn/indexer/fast.py, which keeps the running top-k).  The dot products are exact products of
// the half-precision inputs summed in fp32, as the golden's (dsattn/indexer/ref.py); the head sum
// runs in head order in fp32.
//
// Per block of 64 keys, the keys are transposed once into the GEMM's B operand (packed for the
// oneDNN ukernel where the CPU multiplies bf16 / fp16 natively, fp32 otherwise) and reused by every
// row: C [H, 64] = q[t] [H, D] x k^T, then the weighted ReLU sum over heads runs along the keys.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using at::native::cpublas::brgemm;
using at::native::cpublas::brgemm_release;
using at::native::cpublas::could_pack;

constexpr int64_t KEYS = 64;  // keys per block: the N of the GEMM (a packed panel is at most 64 wide)

// acc[j] += w * max(c[j], 0) over the block's keys, for each head in turn (head order, as the golden).
__attribute__((target_clones("avx512f", "avx2", "default")))
void weighted_relu_sum(const float* __restrict__ c, const float* __restrict__ w, int64_t H, float* __restrict__ acc) {
  for (int64_t j = 0; j < KEYS; ++j) acc[j] = 0.0f;
  for (int64_t h = 0; h < H; ++h) {
    const float wh = w[h];
    const float* __restrict__ row = c + h * KEYS;
    for (int64_t j = 0; j < KEYS; ++j) {
      const float x = row[j];
      acc[j] += wh * (x > 0.0f || x != x ? x : 0.0f);   // relu, NaN kept
    }
  }
}

// B operand k^T of keys [j0, j0 + n) (n <= 64; zero columns past n, zero rows past D up to Dp):
// plain [Dp][64] in fp32, or the ukernel's packed [Dp/2][64][2] for 16-bit operands.
template <typename scalar_t, typename mm_t>
void keys_operand(const scalar_t* keys, int64_t n, int64_t D, int64_t Dp, mm_t* b) {
  if constexpr (std::is_same_v<mm_t, float>) {
    for (int64_t d = 0; d < Dp; ++d)
      for (int64_t j = 0; j < KEYS; ++j) b[d * KEYS + j] = (j < n && d < D) ? static_cast<float>(keys[j * D + d]) : 0.0f;
  } else {
    for (int64_t d = 0; d < Dp; d += 2)
      for (int64_t j = 0; j < KEYS; ++j) {
        mm_t* dst = b + (d / 2) * KEYS * 2 + 2 * j;
        dst[0] = (j < n && d < D) ? keys[j * D + d] : mm_t(0);
        dst[1] = (j < n && d + 1 < D) ? keys[j * D + d + 1] : mm_t(0);
      }
  }
}

// Scores of 64-key blocks for query rows, the GEMM operands prepared once per call / per block.
template <typename scalar_t, typename mm_t>
struct Scorer {
  static constexpr bool packed = !std::is_same_v<mm_t, float>;
  int64_t R, H, D, Dp, N;
  const scalar_t* keys;
  const float* w;
  at::Tensor qa_t;  // the GEMM's A operand: q, or a copy widened to fp32 and / or zero padded to Dp

  std::vector<mm_t> key_blocks;  // every block's B operand, prepared once per call: [blocks][Dp * 64]

  Scorer(const at::Tensor& q, const at::Tensor& k, const at::Tensor& weights)
      : R(q.size(0)), H(q.size(1)), D(q.size(2)), Dp((q.size(2) + 15) / 16 * 16), N(k.size(0)),
        keys(k.data_ptr<scalar_t>()), w(weights.data_ptr<float>()), qa_t(q) {
    // (the packed ukernel faults on an odd K: the padded dims are zero in both operands)
    if (!std::is_same_v<scalar_t, mm_t> || Dp != D) {
      qa_t = at::zeros({R, H, Dp}, q.options().dtype(c10::CppTypeToScalarType<mm_t>::value));
      qa_t.narrow(2, 0, D).copy_(q);
    }
    // Each row then runs over the blocks with its q (A) in L1 and the blocks (B) in L2; packing per
    // row group instead would re-read q from memory for every block.
    key_blocks.resize(blocks() * Dp * KEYS);
    at::parallel_for(0, blocks(), 16, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk)
        keys_operand<scalar_t, mm_t>(keys + blk * KEYS * D, std::min(KEYS, N - blk * KEYS), D, Dp,
                                     key_blocks.data() + blk * Dp * KEYS);
    });
  }

  int64_t blocks() const { return (N + KEYS - 1) / KEYS; }

  struct Block {                 // per-thread buffers
    std::vector<float> c, acc;
  };
  Block buffers() const { return {std::vector<float>(H * KEYS), std::vector<float>(KEYS)}; }

  // buf.acc[j] = score of row t against key j of block blk
  void score(int64_t t, int64_t blk, Block& buf) const {
    brgemm(H, KEYS, Dp, Dp, KEYS, KEYS, false, qa_t.data_ptr<mm_t>() + t * H * Dp, key_blocks.data() + blk * Dp * KEYS,
           buf.c.data(), packed);
    weighted_relu_sum(buf.c.data(), w + t * H, H, buf.acc.data());
  }
};

template <typename scalar_t, typename mm_t>
void scores(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& w, at::Tensor& out) {
  const Scorer<scalar_t, mm_t> sc(q, keys, w);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, sc.R, 1, [&](int64_t t0, int64_t t1) {
    auto buf = sc.buffers();
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t blk = 0; blk < sc.blocks(); ++blk) {
        sc.score(t, blk, buf);
        std::copy(buf.acc.begin(), buf.acc.begin() + std::min(KEYS, sc.N - blk * KEYS), op + t * sc.N + blk * KEYS);
      }
    if (sc.packed) brgemm_release(true);
  });
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

// Merge keys [offset, offset + N) into each row's running top-k (run_v / run_i [R, k], in the
// golden's order, -inf entries empty; keys at or past n[t] are not candidates).  Every running
// entry holds a lower key than this call's keys, so once a row has k candidates a new key enters
// only if its score beats the k-th strictly.
template <typename scalar_t, typename mm_t>
void topk_merge(const at::Tensor& q, const at::Tensor& keys, int64_t offset, const at::Tensor& w, const at::Tensor& n,
                at::Tensor& run_v, at::Tensor& run_i) {
  const Scorer<scalar_t, mm_t> sc(q, keys, w);
  const int64_t k = run_v.size(1);
  const int64_t* np = n.data_ptr<int64_t>();
  float* rv = run_v.data_ptr<float>();
  int64_t* ri = run_i.data_ptr<int64_t>();
  const float ninf = -std::numeric_limits<float>::infinity();
  // Rows in groups: a group's candidates stay in cache while every key block (packed once per
  // group) passes over them; groups are spread over the threads.
  const int64_t group = std::clamp<int64_t>((sc.R + at::get_num_threads() - 1) / at::get_num_threads(), 1, 128);
  const int64_t groups = (sc.R + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    auto buf = sc.buffers();
    std::vector<std::vector<uint64_t>> cand(group);
    std::vector<uint64_t> bar(group);
    for (auto& c : cand) c.reserve(2 * k + KEYS);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t t0 = g * group, t1 = std::min(sc.R, t0 + group);
      // the bar is the k-th candidate once a row has k; until then every key enters
      auto shrink = [&](int64_t t) {                   // back to the best k; the k-th is the new bar
        auto& c = cand[t - t0];
        if (static_cast<int64_t>(c.size()) < k) return;
        std::nth_element(c.begin(), c.begin() + (k - 1), c.end());
        c.resize(k);
        bar[t - t0] = c[k - 1];
      };
      for (int64_t t = t0; t < t1; ++t) {
        auto& c = cand[t - t0];
        c.clear();
        bar[t - t0] = ~uint64_t(0);
        for (int64_t j = 0; j < k; ++j)
          if (rv[t * k + j] != ninf) c.push_back(order_key(rv[t * k + j], ri[t * k + j]));
        shrink(t);
      }
      for (int64_t t = t0; t < t1; ++t) {
        auto& c = cand[t - t0];
        for (int64_t blk = 0; blk < sc.blocks(); ++blk) {
          const int64_t j0 = blk * KEYS;
          const int64_t valid = std::min({np[t] - offset - j0, KEYS, sc.N - j0});   // keys of this block row t takes
          if (valid <= 0) break;
          sc.score(t, blk, buf);
          // a key enters if it goes before the bar: every key here is higher than the bar's, so
          // only a strictly greater score (or a NaN over a number) does
          const bool open = bar[t - t0] == ~uint64_t(0);
          const float bv = order_value(bar[t - t0]);
          for (int64_t j = 0; j < valid; ++j) {
            const float v = buf.acc[j];
            if (open || v > bv || (v != v && bv == bv)) c.push_back(order_key(v, offset + j0 + j));
          }
          const int64_t size = static_cast<int64_t>(c.size());
          if (size >= 2 * k || (open && size >= k)) shrink(t);   // (the first k set the bar at once)
        }
      }
      for (int64_t t = t0; t < t1; ++t) {
        auto& c = cand[t - t0];
        shrink(t);
        std::sort(c.begin(), c.end());
        const int64_t m = static_cast<int64_t>(c.size());
        for (int64_t j = 0; j < k; ++j) {
          rv[t * k + j] = j < m ? order_value(c[j]) : ninf;
          ri[t * k + j] = j < m ? static_cast<int64_t>(static_cast<uint32_t>(c[j])) : 0;
        }
      }
    }
    if (sc.packed) brgemm_release(true);
  });
}

#define DSATTN_DISPATCH(dt, FN, ...)                                                        \
  if (dt == at::kBFloat16 && could_pack(dt)) FN<at::BFloat16, at::BFloat16>(__VA_ARGS__);    \
  else if (dt == at::kBFloat16) FN<at::BFloat16, float>(__VA_ARGS__);                       \
  else if (dt == at::kHalf && could_pack(dt)) FN<at::Half, at::Half>(__VA_ARGS__);          \
  else if (dt == at::kHalf) FN<at::Half, float>(__VA_ARGS__);                               \
  else if (dt == at::kFloat) FN<float, float>(__VA_ARGS__);                                 \
  else TORCH_CHECK(false, "q: dtype ", dt, " is not supported (bf16, fp16, fp32)")

void check_operands(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& w) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.device().is_cpu(), "q: expected a contiguous CPU [R, H, D] tensor");
  TORCH_CHECK(keys.dim() == 2 && keys.size(1) == q.size(2) && keys.is_contiguous() && keys.scalar_type() == q.scalar_type(),
              "keys: expected a contiguous [N, D] tensor of q's dtype");
  TORCH_CHECK(w.dim() == 2 && w.size(0) == q.size(0) && w.size(1) == q.size(1) && w.scalar_type() == at::kFloat &&
                  w.is_contiguous(),
              "w: expected a contiguous fp32 [R, H] tensor");
}

}  // namespace

// score [R, N] fp32 of q [R, H, D] against keys [N, D] (q's dtype) with head weights w [R, H] (fp32).
at::Tensor indexer_scores(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& w) {
  check_operands(q, keys, w);
  auto out = at::empty({q.size(0), keys.size(0)}, q.options().dtype(at::kFloat));
  DSATTN_DISPATCH(q.scalar_type(), scores, q, keys, w, out);
  return out;
}

// Merge keys [offset, offset + N) of one request into the running top-k of its rows, in place:
// run_v fp32 / run_i int64 [R, k], in the golden's order; n [R] int64: keys below n[t] are row t's.
void indexer_topk_merge(const at::Tensor& q, const at::Tensor& keys, int64_t offset, const at::Tensor& w,
                        const at::Tensor& n, at::Tensor& run_v, at::Tensor& run_i) {
  check_operands(q, keys, w);
  const int64_t R = q.size(0);
  TORCH_CHECK(n.dim() == 1 && n.size(0) == R && n.scalar_type() == at::kLong && n.is_contiguous(), "n: expected int64 [R]");
  TORCH_CHECK(run_v.dim() == 2 && run_v.size(0) == R && run_v.size(1) >= 1 && run_v.scalar_type() == at::kFloat &&
                  run_v.is_contiguous(),
              "run_v: expected a contiguous fp32 [R, k] tensor");
  TORCH_CHECK(run_i.sizes() == run_v.sizes() && run_i.scalar_type() == at::kLong && run_i.is_contiguous(),
              "run_i: expected a contiguous int64 tensor shaped like run_v");
  DSATTN_DISPATCH(q.scalar_type(), topk_merge, q, keys, offset, w, n, run_v, run_i);
}
