// Lightning-indexer top-k on the CPU (issue 15): for every query row t, the scores
//   score[t, j] = sum_h w[t, h] * relu(q[t, h] . k_b[j]),   j < n[t]
// against the keys of its request b, and the best topk of them in
// the golden's order (score descending, ties to the lower key; dsattn/indexer/ref.py).  The dot
// products are exact products of the half-precision inputs summed in fp32, as the golden's.
//
// One row at a time: its q^T is packed once as the GEMM's B operand ([Dp/2][Hp][2] for the oneDNN
// ukernel where the CPU multiplies bf16 / fp16 natively, plain fp32 otherwise) and the keys are
// the A operand straight from the cache, 256 at a time: C [keys, Hp] = k q^T.  No [rows, keys]
// score buffer exists: each chunk's scores are filtered against the row's running k-th best and
// only candidates that beat it are kept (at most 2 topk + 256), so memory is O(threads x topk).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <immintrin.h>

#include "common.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if DSATTN_HAVE_BRGEMM

namespace {

using at::native::cpublas::brgemm;
using at::native::cpublas::brgemm_release;
using at::native::cpublas::could_pack;

constexpr int64_t CHUNK = 256;  // keys per GEMM (its M)
using dsattn_native::PANEL;
using dsattn_native::round_up;

// out[j] = sum_h w[h] * relu(c[j, h]) over Hp heads (w zero past the real heads); NaN propagates
// through relu as in torch (max(0, x) returns x when x is NaN).
__attribute__((target("avx512f"))) void head_sum_avx512(const float* c, int64_t M, int64_t Hp, const float* w,
                                                        float* out) {
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t j = 0; j < M; ++j) {
    __m512 acc = zero;
    for (int64_t h = 0; h < Hp; h += 16)
      acc = _mm512_fmadd_ps(_mm512_max_ps(zero, _mm512_loadu_ps(c + j * Hp + h)), _mm512_loadu_ps(w + h), acc);
    out[j] = _mm512_reduce_add_ps(acc);
  }
}

__attribute__((target("avx2,fma"))) void head_sum_avx2(const float* c, int64_t M, int64_t Hp, const float* w,
                                                       float* out) {
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t j = 0; j < M; ++j) {
    __m256 acc = zero;
    for (int64_t h = 0; h < Hp; h += 8)
      acc = _mm256_fmadd_ps(_mm256_max_ps(zero, _mm256_loadu_ps(c + j * Hp + h)), _mm256_loadu_ps(w + h), acc);
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    out[j] = _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
  }
}

void head_sum_scalar(const float* c, int64_t M, int64_t Hp, const float* w, float* out) {
  for (int64_t j = 0; j < M; ++j) {
    float acc = 0.0f;
    for (int64_t h = 0; h < Hp; ++h) {
      const float x = c[j * Hp + h];
      acc += w[h] * (x > 0.0f || x != x ? x : 0.0f);
    }
    out[j] = acc;
  }
}

using HeadSum = void (*)(const float*, int64_t, int64_t, const float*, float*);
HeadSum head_sum() {
  static const HeadSum fn = __builtin_cpu_supports("avx512f") ? head_sum_avx512
                            : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? head_sum_avx2
                                                                                               : head_sum_scalar;
  return fn;
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

// Sorts ``a`` ascending: least-significant-digit radix sort over the 8-bit digits in which the keys
// differ (a row's candidates differ in the low index bits and the score bits only, so a few passes),
// branch-free where a comparison sort of random scores mispredicts every other compare.
void radix_sort(std::vector<uint64_t>& a, std::vector<uint64_t>& tmp) {
  const size_t n = a.size();
  if (n < 64) {
    std::sort(a.begin(), a.end());
    return;
  }
  uint64_t diff = 0;
  for (const uint64_t x : a) diff |= x ^ a[0];
  tmp.resize(n);
  for (int shift = 0; shift < 64; shift += 8) {
    if (((diff >> shift) & 0xFF) == 0) continue;          // every key has this digit: the order stands
    size_t count[256] = {};
    for (const uint64_t x : a) ++count[(x >> shift) & 0xFF];
    size_t at = 0;
    for (size_t& c : count) {
      const size_t m = c;
      c = at;
      at += m;
    }
    for (const uint64_t x : a) tmp[count[(x >> shift) & 0xFF]++] = x;
    a.swap(tmp);
  }
}

// The best k of a stream of keys arriving in ascending key order.
class RunningTopK {
 public:
  explicit RunningTopK(int64_t k) : k_(k) { cand_.reserve(2 * k + CHUNK); }
  void reset() { cand_.clear(), bar_ = ~uint64_t(0); }

  // scores of keys first, first + 1, ...: a key enters only if it goes before the k-th so far;
  // every key here is higher than those kept, so only a strictly greater score (or a NaN over a
  // number) does
  void add(const float* scores, int64_t count, int64_t first) {
    const bool open = bar_ == ~uint64_t(0);
    const float bv = order_value(bar_);
    for (int64_t j = 0; j < count; ++j) {
      const float v = scores[j];
      if (open || v > bv || (v != v && bv == bv)) cand_.push_back(order_key(v, first + j));
    }
    const int64_t size = static_cast<int64_t>(cand_.size());
    if (size >= 2 * k_ || (open && size >= k_)) shrink();     // (the first k set the bar at once)
  }

  // the kept keys in order: values (-inf past the count) and indices (0 past it)
  void write(float* values, int64_t* indices) {
    radix_sort(cand_, tmp_);                      // every candidate: the first k are the best
    const int64_t m = static_cast<int64_t>(cand_.size());
    for (int64_t j = 0; j < k_; ++j) {
      values[j] = j < m ? order_value(cand_[j]) : -std::numeric_limits<float>::infinity();
      indices[j] = j < m ? static_cast<int64_t>(static_cast<uint32_t>(cand_[j])) : 0;
    }
  }

 private:
  void shrink() {                                 // back to the best k; the k-th is the new bar
    const int64_t size = static_cast<int64_t>(cand_.size());
    if (size < k_) return;
    if (size == k_) {                             // (the first k: all kept, the bar is the worst)
      bar_ = *std::max_element(cand_.begin(), cand_.end());
      return;
    }
    std::nth_element(cand_.begin(), cand_.begin() + (k_ - 1), cand_.end());
    cand_.resize(k_);
    bar_ = cand_[k_ - 1];
  }

  int64_t k_;
  std::vector<uint64_t> cand_, tmp_;
  uint64_t bar_ = ~uint64_t(0);
};

struct KeyPages {                 // where key j of a request lives in the flat key rows
  const int64_t* pages;           // [B, P]: flat row of each page's first key
  int64_t per_batch, page;
  int64_t row(int64_t b, int64_t j) const { return pages[b * per_batch + j / page] + j % page; }
};

template <typename scalar_t, typename mm_t>
void topk_rows(const at::Tensor& q, const at::Tensor& keys, const KeyPages& kp, const at::Tensor& batch,
               const at::Tensor& n, const at::Tensor& w, at::Tensor& values, at::Tensor& indices) {
  constexpr bool packed = !std::is_same_v<mm_t, float>;
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), Nk = keys.size(0), k = values.size(1);
  const int64_t Hp = round_up(H, 16), Dp = round_up(D, 16);
  // The A operand: the keys as they are, or (fp32 GEMMs on half-precision keys, a head dim that is
  // not a multiple of 16: the packed ukernel faults on an odd K) a widened / zero-padded copy.
  at::Tensor keys_a = keys;
  if (!std::is_same_v<scalar_t, mm_t> || Dp != D) {
    keys_a = at::zeros({Nk, Dp}, keys.options().dtype(c10::CppTypeToScalarType<mm_t>::value));
    keys_a.narrow(1, 0, D).copy_(keys);
  }
  const mm_t* ka = keys_a.data_ptr<mm_t>();
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const float* wp = w.data_ptr<float>();
  const int64_t* bp = batch.data_ptr<int64_t>();
  const int64_t* np = n.data_ptr<int64_t>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  const HeadSum sum_heads = head_sum();
  at::parallel_for(0, R, 1, [&](int64_t t0, int64_t t1) {
    dsattn_native::Buffer<mm_t> qb(Dp * Hp);
    dsattn_native::Buffer<float> c(CHUNK * Hp), score(CHUNK), wpad(Hp, 0.0f);
    RunningTopK best(k);
    for (int64_t t = t0; t < t1; ++t) {
      best.reset();
      const int64_t count = np[t];
      if (count > 0) {
        dsattn_native::pack_query<scalar_t, mm_t>(qp + t * H * D, H, D, Hp, Dp, qb.data());   // B = q_t^T
        std::copy(wp + t * H, wp + (t + 1) * H, wpad.begin());
        for (int64_t j0 = 0; j0 < count;) {
          const int64_t valid = std::min({CHUNK, count - j0, kp.page - j0 % kp.page});   // within one page
          const int64_t first = kp.row(bp[t], j0);
          // M rounded up (fewer kernel shapes): the extra rows are key rows of the tensor, unused
          const int64_t M = std::min(round_up(valid, 16), Nk - first);
          for (int64_t h0 = 0; h0 < Hp; h0 += PANEL) {
            const int64_t pw = std::min(PANEL, Hp - h0);
            if constexpr (packed)
              brgemm(M, pw, Dp, Dp, pw, Hp, false, ka + first * Dp, qb.data() + h0 * Dp, c.data() + h0, true);
            else
              brgemm(M, pw, Dp, Dp, Hp, Hp, false, ka + first * Dp, qb.data() + h0, c.data() + h0, false);
          }
          sum_heads(c.data(), valid, Hp, wpad.data(), score.data());
          best.add(score.data(), valid, j0);
          j0 += valid;
        }
      }
      best.write(vp + t * k, ip + t * k);
    }
    if (packed) brgemm_release(true);
  });
}

}  // namespace

// The top-k of each query row of q [R, H, D] over the first n[t] keys of its request batch[t],
// head weights w [R, H] (fp32): (values fp32 [R, topk], key positions int64 [R, topk]) in the
// golden's order; -inf / 0 past min(n[t], topk).  Keys: flat rows keys [Nk, D] (q's dtype); key j
// of request b is row pages[b, j / page] + j % page (pages: int64 [B, P]).
std::vector<at::Tensor> indexer_topk(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& pages,
                                     int64_t page, const at::Tensor& batch, const at::Tensor& n, const at::Tensor& w,
                                     int64_t topk) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.device().is_cpu(), "q: expected a contiguous CPU [R, H, D] tensor");
  TORCH_CHECK(keys.dim() == 2 && keys.size(1) == q.size(2) && keys.is_contiguous() && keys.scalar_type() == q.scalar_type(),
              "keys: expected a contiguous [N, D] tensor of q's dtype");
  const int64_t R = q.size(0), Nk = keys.size(0);
  TORCH_CHECK(w.dim() == 2 && w.size(0) == R && w.size(1) == q.size(1) && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "w: expected a contiguous fp32 [R, H] tensor");
  for (const auto* t : {&batch, &n})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == R && t->scalar_type() == at::kLong && t->is_contiguous(),
                "batch, n: expected int64 [R] tensors");
  TORCH_CHECK(pages.dim() == 2 && pages.scalar_type() == at::kLong && pages.is_contiguous(), "pages: expected int64 [B, P]");
  TORCH_CHECK(page >= 1 && topk >= 1, "page, topk: expected >= 1");
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
  auto values = at::empty({R, topk}, q.options().dtype(at::kFloat));
  auto indices = at::empty({R, topk}, q.options().dtype(at::kLong));
  const auto dt = q.scalar_type();
  if (dt == at::kBFloat16 && could_pack(dt))
    topk_rows<at::BFloat16, at::BFloat16>(q, keys, kp, batch, n, w, values, indices);
  else if (dt == at::kBFloat16)
    topk_rows<at::BFloat16, float>(q, keys, kp, batch, n, w, values, indices);
  else if (dt == at::kHalf && could_pack(dt))
    topk_rows<at::Half, at::Half>(q, keys, kp, batch, n, w, values, indices);
  else if (dt == at::kHalf)
    topk_rows<at::Half, float>(q, keys, kp, batch, n, w, values, indices);
  else if (dt == at::kFloat)
    topk_rows<float, float>(q, keys, kp, batch, n, w, values, indices);
  else
    TORCH_CHECK(false, "q: dtype ", dt, " is not supported (bf16, fp16, fp32)");
  return {values, indices};
}

#else  // !DSATTN_HAVE_BRGEMM

std::vector<at::Tensor> indexer_topk(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
                                     const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "this torch has no cpublas::brgemm: the compiled indexer is not available");
}

#endif
