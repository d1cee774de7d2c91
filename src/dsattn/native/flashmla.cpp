// FlashMLA's sparse decode (dsattn/flashmla.py: flash_mla_with_kvcache with index lists) in one compiled
// step: the index lists' content checks, the key tables (FlashMLA's conventions: -1 masks one slot, and
// so does every slot at or past topk_length) and the attention (attention.cpp), whose sink-free LSE
// becomes +inf for a query without a key.  The Python path spends several times a one-request decode
// kernel's time on those steps.
//
// A list value that is neither -1 nor a token of its cache, or a length outside [0, topk], declines the
// call before anything is written: the Python path then raises its error (worded once, in Python).
#include <torch/extension.h>

#include <limits>
#include <vector>

#include "attention.h"
#include "keys.h"

// q [R, H, D] (R = b * s_q rows, request r / s_q); per cache: its rows (or packed bytes with their
// format fields), its index lists int32 [R, K], its token count, and topk_length int32 [b] or an
// empty tensor.  out [R, H, D] and lse [R, H] fp32 are written when the call is taken (true).
bool flashmla_sparse(at::Tensor out, at::Tensor lse, const at::Tensor& q, const std::vector<at::Tensor>& sources,
                     const std::vector<std::vector<int64_t>>& formats, const std::vector<at::Tensor>& indices,
                     const std::vector<at::Tensor>& lengths, const std::vector<int64_t>& tokens, int64_t s_q,
                     const c10::optional<at::Tensor>& sinks, double scale) {
  const size_t n = sources.size();
  if (n == 0 || indices.size() != n || lengths.size() != n || tokens.size() != n) return false;
  if (q.dim() != 3 || q.size(0) == 0 || s_q < 1 || q.size(0) % s_q != 0) return false;
  const int64_t R = q.size(0), H = q.size(1), b = R / s_q;
  std::vector<at::Tensor> tables(n);
  for (size_t i = 0; i < n; ++i) {
    if (!dsattn_native::cpu_int32(indices[i]) || indices[i].dim() != 2 || indices[i].size(0) != R) return false;
    const at::Tensor idx = indices[i].contiguous();
    const int64_t K = idx.size(1);
    const int32_t* ip = idx.data_ptr<int32_t>();
    std::vector<int64_t> cap(b, K);
    if (lengths[i].numel() > 0) {
      if (!dsattn_native::cpu_int32(lengths[i]) || lengths[i].numel() != b) return false;
      cap = dsattn_native::int_values(lengths[i]);
      for (int64_t& c : cap) {
        if (c < 0) return false;
        c = std::min(c, K);
      }
    }
    tables[i] = at::empty({R, K}, q.options().dtype(at::kLong));
    int64_t* tp = tables[i].data_ptr<int64_t>();
    for (int64_t t = 0; t < R; ++t) {
      const int64_t limit = cap[t / s_q];
      for (int64_t k = 0; k < K; ++k) {
        const int64_t v = ip[t * K + k];
        if (v < -1 || v >= tokens[i]) return false;
        tp[t * K + k] = k < limit ? v : -1;
      }
    }
  }
  const at::Tensor mx = at::empty({R, H}, q.options().dtype(at::kFloat));
  sparse_attention_forward(q.contiguous(), sources, tables, sinks, scale, out, lse, false, mx, formats, c10::nullopt);
  float* lp = lse.data_ptr<float>();
  const float* mp = mx.data_ptr<float>();
  for (int64_t i = 0; i < R * H; ++i)
    if (mp[i] == -std::numeric_limits<float>::infinity()) lp[i] = std::numeric_limits<float>::infinity();
  return true;
}
