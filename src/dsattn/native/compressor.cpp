// The compressor's gated softmax pooling on the CPU (30-compressor §2.2, dsattn/compressor/fast.py):
// for every output row o and every one of its S = coff·r slots s, a D-wide (kv, score) pair from
//   kind 1: a new token's projection, rows new_at[o, s] of kv_new / sc_new viewed [-1, D];
//   kind 2: a state row written by an earlier call, row state_at[o, s] of state viewed [-1, D]
//           (kv there, the score coff rows further on: a state row is [kv | score]);
//   kind 0: a dead slot, kv 0 and score -inf,
// and then, per dimension d, C[o, d] = sum_s softmax_s(score[o, s, d]) kv[o, s, d] (torch.softmax's
// max-shifted exp, then the sum over slots in order).  Rows with valid[o] false are 0.  One call
// replaces the PyTorch path's gathers, softmax, product and sum over the [n, S, D] slot grids, which
// for a decode step are a few dozen tiny operator calls.  Only the rows a slot names are read, so a
// NaN-filled state row no live slot names never reaches the result.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
void pool_rows(const at::Tensor& kv_new, const at::Tensor& sc_new, const at::Tensor& state, const at::Tensor& kind,
               const at::Tensor& new_at, const at::Tensor& state_at, const at::Tensor& valid, int64_t coff,
               at::Tensor& out) {
  const int64_t n = kind.size(0), S = kind.size(1), D = out.size(1);
  const T *kv = kv_new.data_ptr<T>(), *sc = sc_new.data_ptr<T>();
  const T* st = state.numel() > 0 ? state.data_ptr<T>() : nullptr;
  const int64_t *kd = kind.data_ptr<int64_t>(), *na = new_at.data_ptr<int64_t>(), *sa = state_at.data_ptr<int64_t>();
  const bool* ok = valid.data_ptr<bool>();
  T* C = out.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, S * D));
  at::parallel_for(0, n, grain, [&](int64_t o0, int64_t o1) {
    std::vector<const T*> kvp(S), scp(S);
    std::vector<T> m(D), l(D), e(S * D);               // e: each live slot's exp(score - max)
    for (int64_t o = o0; o < o1; ++o) {
      T* c = C + o * D;
      std::fill(c, c + D, T(0));
      if (!ok[o]) continue;
      int64_t live = 0;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t k = kd[o * S + s];
        if (k == 1) {
          kvp[live] = kv + na[o * S + s] * D;
          scp[live] = sc + na[o * S + s] * D;
        } else if (k == 2) {
          kvp[live] = st + sa[o * S + s] * D;
          scp[live] = st + (sa[o * S + s] + coff) * D;
        } else {
          continue;                                    // dead: weight exp(-inf) = 0, kv 0
        }
        ++live;
      }
      if (live == 0) {                                  // every score -inf: torch.softmax gives NaN
        std::fill(c, c + D, std::numeric_limits<T>::quiet_NaN());
        continue;
      }
      std::fill(m.begin(), m.end(), -std::numeric_limits<T>::infinity());
      for (int64_t s = 0; s < live; ++s)
        for (int64_t d = 0; d < D; ++d) {
          const T v = scp[s][d];
          m[d] = (v > m[d] || v != v) ? v : m[d];        // NaN propagates, as in torch.max
        }
      std::fill(l.begin(), l.end(), T(0));
      for (int64_t s = 0; s < live; ++s)
        for (int64_t d = 0; d < D; ++d) {
          e[s * D + d] = std::exp(scp[s][d] - m[d]);
          l[d] += e[s * D + d];
        }
      for (int64_t s = 0; s < live; ++s)
        for (int64_t d = 0; d < D; ++d) c[d] += e[s * D + d] / l[d] * kvp[s][d];
    }
  });
}

}  // namespace

at::Tensor compressor_pool(const at::Tensor& kv_new, const at::Tensor& sc_new, const at::Tensor& state,
                           const at::Tensor& kind, const at::Tensor& new_at, const at::Tensor& state_at,
                           const at::Tensor& valid, int64_t coff) {
  const auto dt = kv_new.scalar_type();
  TORCH_CHECK(coff >= 1 && kv_new.dim() == 2 && kv_new.size(1) % coff == 0, "kv_new: expected [rows, coff·D]");
  const int64_t D = kv_new.size(1) / coff;
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble, "kv_new: expected float32 or float64, got ", dt);
  for (const auto* t : {&kv_new, &sc_new, &state})
    TORCH_CHECK(t->scalar_type() == dt && t->is_contiguous() && t->device().is_cpu(),
                "kv_new, sc_new, state: contiguous CPU tensors of one dtype");
  TORCH_CHECK(kind.dim() == 2 && new_at.sizes() == kind.sizes() && state_at.sizes() == kind.sizes(),
              "kind, new_at, state_at: [n, S]");
  for (const auto* t : {&kind, &new_at, &state_at})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "kind, new_at, state_at: contiguous int64");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.is_contiguous() && valid.numel() == kind.size(0),
              "valid: contiguous bool [n]");
  TORCH_CHECK(D >= 1 && sc_new.sizes() == kv_new.sizes() && state.numel() % D == 0,
              "sc_new: shaped like kv_new; state: rows of D = ", D);
  // every row a slot names must lie inside its source (the caller builds them; a bad one must not read out of bounds)
  const int64_t new_rows = kv_new.numel() / D, state_rows = state.numel() / D;
  const int64_t *kd = kind.data_ptr<int64_t>(), *na = new_at.data_ptr<int64_t>(), *sa = state_at.data_ptr<int64_t>();
  for (int64_t i = 0; i < kind.numel(); ++i) {
    TORCH_CHECK(kd[i] != 1 || (na[i] >= 0 && na[i] < new_rows), "new_at: row ", na[i], " outside kv_new");
    TORCH_CHECK(kd[i] != 2 || (sa[i] >= 0 && sa[i] + coff < state_rows), "state_at: row ", sa[i], " outside state");
  }
  auto out = at::empty({kind.size(0), D}, kv_new.options());
  if (dt == at::kFloat)
    pool_rows<float>(kv_new, sc_new, state, kind, new_at, state_at, valid, coff, out);
  else
    pool_rows<double>(kv_new, sc_new, state, kind, new_at, state_at, valid, coff, out);
  return out;
}
