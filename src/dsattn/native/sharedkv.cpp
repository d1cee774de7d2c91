// A whole sparse_attn_sharedkv call over paged caches (layout_kv PA_ND) in one compiled step: the
// argument checks, the query rows, the key tables (keys.h) and the attention (attention.cpp).  The
// Python path spends several times a decode kernel's time on those steps for one or a few requests
// (some hundred small operator calls); this is one call (dsattn/sharedkv/compiled.py).
//
// It takes a call or declines it, writing nothing: a call of another shape (TND / BSND caches, a
// plan), an argument that is off in any way the Python checks would report, or a key the block
// tables do not map.  The Python path then runs the call and raises its error, so every error the
// operator gives is still worded once, in Python.
#include <torch/extension.h>

#include <cmath>
#include <vector>

#include "attention.h"
#include "keys.h"

namespace {

using dsattn_native::cpu_int32;
using dsattn_native::KeyMap;
using dsattn_native::KeySelection;

// A paged cache [num_blocks, block_size, 1, D] (or [num_blocks, block_size, D]) read in place: its rows
// (or bytes, when packed) and its key map; false when the cache is not one the step reads in place.
bool paged_source(const at::Tensor& kv_in, const c10::optional<at::Tensor>& table, int64_t B, const at::Tensor& q,
                  bool packed, at::Tensor& rows, at::Tensor& table_c, KeyMap& map) {
  if (!cpu_int32(table) || table->dim() != 2 || table->size(0) != B || !kv_in.device().is_cpu()) return false;
  const at::Tensor kv = kv_in.dim() == 3 ? kv_in.unsqueeze(2) : kv_in;
  if (kv.dim() != 4 || kv.size(2) != 1 || kv.size(1) < 1 || !kv.is_contiguous()) return false;
  if (packed) {
    rows = kv.reshape({-1}).view(at::kByte);
  } else {
    if (kv.scalar_type() != q.scalar_type() || kv.size(3) != q.size(-1)) return false;
    rows = kv.view({-1, kv.size(3)});
  }
  table_c = table->contiguous();
  map = KeyMap::paged(table_c, kv.size(1), kv.size(0));
  return true;
}

}  // namespace

// out: q's shape, contiguous, q's dtype.  formats: one per cache for packed rows (the attention's
// format fields), empty for caches of q's dtype.  True when the call was taken (out written).
bool sharedkv_paged(at::Tensor out, const at::Tensor& q, const at::Tensor& ori_kv, const c10::optional<at::Tensor>& cmp_kv,
                    const c10::optional<at::Tensor>& ori_block_table, const c10::optional<at::Tensor>& cmp_block_table,
                    const c10::optional<at::Tensor>& seqused_kv, const c10::optional<at::Tensor>& cu_seqlens_q,
                    const c10::optional<at::Tensor>& cmp_sparse_indices,
                    const c10::optional<at::Tensor>& cmp_topk_length, const c10::optional<at::Tensor>& sinks,
                    double scale, int64_t ratio, int64_t ori_mask_mode, int64_t cmp_mask_mode, int64_t win_left,
                    int64_t win_right, bool tnd, const std::vector<std::vector<int64_t>>& formats) {
  // -- attributes and the query
  const auto dt = q.scalar_type();
  if (!q.device().is_cpu() || (dt != at::kBFloat16 && dt != at::kHalf && dt != at::kFloat)) return false;
  if (q.dim() != (tnd ? 3 : 4) || q.size(-2) < 1 || q.size(-1) < 1 || q.numel() == 0) return false;
  if (ori_mask_mode != 0 && ori_mask_mode != 3 && ori_mask_mode != 4) return false;
  if (cmp_mask_mode != 0 && cmp_mask_mode != 3) return false;
  if (win_left < -1 || win_right < -1) return false;
  const bool has_cmp = cmp_kv.has_value();
  if (!has_cmp && (cmp_sparse_indices.has_value() || cmp_topk_length.has_value())) return false;
  if (has_cmp && (ratio < 1 || ratio > 128)) return false;
  if (!std::isfinite(scale)) return false;
  const bool packed = !formats.empty();
  if (packed && formats.size() != (has_cmp ? 2u : 1u)) return false;
  const int64_t H = q.size(-2), D = q.size(-1);
  const int64_t R = tnd ? q.size(0) : q.size(0) * q.size(1);
  if (!out.device().is_cpu() || out.scalar_type() != dt || !out.is_contiguous() || out.numel() != R * H * D) return false;
  if (!dsattn_native::sinks_ok(sinks, H)) return false;

  // -- query rows (00 §5.2)
  dsattn_native::QueryRowsHost qrows;
  if (tnd) {
    if (!cpu_int32(cu_seqlens_q) || cu_seqlens_q->dim() != 1 || !qrows.tnd(dsattn_native::int_values(*cu_seqlens_q), R))
      return false;
  } else {
    if (cu_seqlens_q.has_value()) return false;
    qrows.bsnd(q.size(0), q.size(1), std::vector<int64_t>(q.size(0), q.size(1)));
  }
  const int64_t B = qrows.B;

  // -- key lengths (20 §4.2): S2o = seqused_kv, S2c = floor(S2o / r), the causal bound Lc = S2o
  if (!cpu_int32(seqused_kv) || seqused_kv->dim() != 1 || seqused_kv->size(0) != B) return false;
  const std::vector<int64_t> S2o = dsattn_native::int_values(*seqused_kv);
  int64_t ori_cap = 0, cmp_cap = 0;
  std::vector<int64_t> S2c(B);
  for (int64_t b = 0; b < B; ++b) {
    if (S2o[b] < 0) return false;
    S2c[b] = has_cmp ? S2o[b] / ratio : 0;
    ori_cap = std::max(ori_cap, S2o[b]);
    cmp_cap = std::max(cmp_cap, S2c[b]);
  }

  KeySelection k;
  k.B = B;
  k.batch = qrows.batch.data();
  k.local = qrows.local.data();
  k.used = qrows.used.get();
  k.S1e = qrows.extent.data();
  k.S2o = S2o.data();
  k.om = ori_mask_mode;
  k.wl = win_left;
  k.wr = win_right;
  k.Wo = (ori_mask_mode == 4 && win_left != -1 && win_right != -1) ? std::min(win_left + win_right + 1, ori_cap) : ori_cap;
  k.positional = ori_mask_mode == 3 || ori_mask_mode == 4 || (has_cmp && cmp_mask_mode == 3);
  std::vector<at::Tensor> sources(has_cmp ? 2 : 1), tables(sources.size());
  if (!paged_source(ori_kv, ori_block_table, B, q, packed, sources[0], tables[0], k.ori)) return false;
  std::vector<int64_t> cap;
  at::Tensor idx;
  if (has_cmp) {
    if (!paged_source(*cmp_kv, cmp_block_table, B, q, packed, sources[1], tables[1], k.cmp)) return false;
    if (packed && cmp_kv->scalar_type() != ori_kv.scalar_type()) return false;
    k.has_cmp = true;
    k.S2c = S2c.data();
    k.Lc = S2o.data();
    k.cm = cmp_mask_mode;
    k.r = ratio;
    k.Wc = cmp_cap;
    if (cmp_sparse_indices.has_value()) {
      const auto& ci = *cmp_sparse_indices;
      const bool shape_ok = tnd ? (ci.dim() == 3 && ci.size(0) == R && ci.size(1) == 1)
                                : (ci.dim() == 4 && ci.size(0) == B && ci.size(1) == q.size(1) && ci.size(2) == 1);
      if (!cpu_int32(cmp_sparse_indices) || !shape_ok) return false;
      idx = ci.contiguous();
      k.idx = idx.data_ptr<int32_t>();
      k.K = ci.size(-1);
      k.Wc = std::min(k.K, cmp_cap);
      if (cmp_topk_length.has_value()) {              // 20 §2.8: per request [B] or per query row
        const auto& len = *cmp_topk_length;
        if (!cpu_int32(cmp_topk_length)) return false;
        const std::vector<int64_t> v = dsattn_native::int_values(len);
        const bool per_row = tnd ? (len.dim() == 1 && len.size(0) == R)
                                 : (len.dim() == 2 && len.size(0) == B && len.size(1) == q.size(1));
        if (!per_row && !(len.dim() == 1 && len.size(0) == B)) return false;
        for (int64_t x : v)
          if (x < 0 || x > k.K) return false;
        cap.resize(R);
        for (int64_t t = 0; t < R; ++t) cap[t] = per_row ? v[t] : v[qrows.batch[t]];
        k.cap = cap.data();
      }
    } else if (cmp_topk_length.has_value()) {
      return false;
    }
  }

  // -- the key tables (a key the tables do not map declines the call), then the attention.  Calls whose
  // tables would pass 32 MiB (the Python path's block of rows) are not decode-sized: declined.
  if (R * std::max<int64_t>(1, k.Wo + k.Wc) * 24 > (int64_t(32) << 20)) return false;
  auto opts = q.options().dtype(at::kLong);
  std::vector<at::Tensor> rows{at::empty({R, k.Wo}, opts)};
  at::Tensor cmp_rows = at::empty({R, k.Wc}, opts);
  const auto bad = k.fill(0, R, rows[0].data_ptr<int64_t>(), cmp_rows.data_ptr<int64_t>());
  if (!bad.ori.empty() || !bad.cmp.empty()) return false;
  if (has_cmp) rows.push_back(cmp_rows);
  sparse_attention_forward(q.contiguous().view({R, H, D}), sources, rows, sinks, scale, out.view({R, H, D}),
                           at::empty({R, H}, q.options().dtype(at::kFloat)), true, c10::nullopt, formats, c10::nullopt);
  return true;
}
