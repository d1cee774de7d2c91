// A kv_quant_sparse_flash_attention call over a paged packed cache (layout_kv PA_BSND) in one compiled step
// (dsattn/kv_quant_attn/compiled.py): the checks that read tensor values, the query rows, each row's
// candidate tokens (40 §4.4; dsattn/kv_quant_attn/problem.py: candidate_tokens), their paged addresses,
// and the attention over the packed tokens decoded as they are read (attention.cpp), with the softmax's
// shift and denominator.  Argument parsing and candidate tables in Python cost a one-request V3.2 decode
// about half its kernel's time, and more next to it (the kernel's reads evict the interpreter's).
//
// As sharedkv.cpp: it takes a call or declines it before writing anything, and the Python path runs a
// declined call and words its errors.
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "attention.h"
#include "keys.h"

using dsattn_native::cpu_int32;
using dsattn_native::int_values;

// out [R, H, 512] (query dtype, contiguous), stats [2, R, H] fp32 (softmax_max, softmax_sum); key
// [num_blocks, block_size, 1, row bytes] packed rows read through ``format`` (PackedTokens.fields()).
bool qsfa_paged(at::Tensor out, at::Tensor stats, const at::Tensor& query, const at::Tensor& key,
                const at::Tensor& sparse_indices, const c10::optional<at::Tensor>& block_table,
                const c10::optional<at::Tensor>& seq_q, const c10::optional<at::Tensor>& seq_kv,
                const c10::optional<at::Tensor>& sinks, double scale, int64_t sparse_block, bool causal, bool tnd,
                const std::vector<int64_t>& format) {
  const auto dt = query.scalar_type();
  if (!query.device().is_cpu() || (dt != at::kBFloat16 && dt != at::kHalf) || query.dim() != (tnd ? 3 : 4)) return false;
  const int64_t H = query.size(-2), D = query.size(-1), R = tnd ? query.size(0) : query.size(0) * query.size(1);
  if (R == 0 || H < 1 || D < 512) return false;
  if (key.dim() != 4 || key.size(2) != 1 || key.size(1) < 1 || !key.is_contiguous() || !key.device().is_cpu()) return false;
  const int64_t bs = key.size(1), num_blocks = key.size(0);
  if (sparse_block < 1 || bs % sparse_block != 0) return false;
  if (!out.is_contiguous() || out.scalar_type() != dt || out.numel() != R * H * 512) return false;
  if (!stats.is_contiguous() || stats.scalar_type() != at::kFloat || stats.numel() != 2 * R * H) return false;
  if (!dsattn_native::sinks_ok(sinks, H)) return false;

  // -- query rows: TND ends are cumulative (40 §4.2); a BSND batch's rows at or past its length are padding
  dsattn_native::QueryRowsHost rows;
  if (tnd) {
    if (!cpu_int32(seq_q) || seq_q->dim() != 1 || seq_q->size(0) < 1) return false;
    std::vector<int64_t> cu{0};
    for (int64_t v : int_values(*seq_q)) cu.push_back(v);
    if (!rows.tnd(cu, R)) return false;
  } else {
    const int64_t S1 = query.size(1);
    std::vector<int64_t> extent(query.size(0), S1);
    if (seq_q.has_value()) {
      if (!cpu_int32(seq_q) || seq_q->dim() != 1 || seq_q->size(0) != query.size(0)) return false;
      extent = int_values(*seq_q);
      for (int64_t v : extent)
        if (v < 0 || v > S1) return false;
    }
    rows.bsnd(query.size(0), S1, std::move(extent));
  }
  const int64_t B = rows.B;
  const auto &batch = rows.batch, &local = rows.local, &extent = rows.extent;
  const bool* used = rows.used.get();

  // -- the paged cache: every length within the table's capacity, every listed block of a row looked up
  if (!cpu_int32(block_table) || block_table->dim() != 2 || block_table->size(0) != B) return false;
  if (!cpu_int32(seq_kv) || seq_kv->dim() != 1 || seq_kv->size(0) != B) return false;
  const std::vector<int64_t> S2 = int_values(*seq_kv);
  const at::Tensor table = block_table->contiguous();
  const int64_t columns = table.size(1);
  const dsattn_native::KeyMap pages = dsattn_native::KeyMap::paged(table, bs, num_blocks);
  for (int64_t v : S2)
    if (v < 0 || v > columns * bs) return false;
  const auto& si = sparse_indices;
  const bool shape_ok = tnd ? (si.dim() == 3 && si.size(0) == query.size(0))
                            : (si.dim() == 4 && si.size(0) == query.size(0) && si.size(1) == query.size(1));
  if (!shape_ok || si.size(-2) != 1 || si.size(-1) < 1 || !cpu_int32(sparse_indices)) return false;
  const at::Tensor idx = si.contiguous();
  const int32_t* ip = idx.data_ptr<int32_t>();
  const int64_t K = si.size(-1), W = K * sparse_block;
  if (R * W * 8 > (int64_t(32) << 20)) return false;          // not decode-sized: the Python path's blocks

  at::Tensor tokens = at::empty({R, W}, query.options().dtype(at::kLong));
  int64_t* rp = tokens.data_ptr<int64_t>();
  for (int64_t t = 0; t < R; ++t) {
    const int64_t b = batch[t], S1 = extent[b];
    const int64_t thr = causal ? S2[b] - S1 + local[t] + 1 : S2[b];
    const int64_t n_blocks = std::clamp<int64_t>(dsattn_native::floor_div(thr + sparse_block - 1, sparse_block), 0, K);
    const int64_t end = std::min(S2[b], thr);
    bool listed = true;
    for (int64_t s = 0; s < K; ++s) {
      const int64_t v = ip[t * K + s];
      listed = listed && v >= 0;                                 // -1 ends the list
      const bool block_ok = used[t] && listed && s < n_blocks && v * sparse_block < thr;
      for (int64_t j = 0; j < sparse_block; ++j) {
        const int64_t tok = v * sparse_block + j;
        int64_t& dst = rp[t * W + s * sparse_block + j];
        dst = -1;
        if (block_ok && tok < end && !pages.row(b, tok, dst)) return false;   // the Python path reports the entry
      }
    }
  }
  const at::Tensor full = at::empty({R, H, D}, query.options());
  sparse_attention_forward(query.contiguous().view({R, H, D}), {key.reshape({-1}).view(at::kByte)}, {tokens}, sinks, scale,
                           full, at::empty({R, H}, query.options().dtype(at::kFloat)), true, c10::nullopt, {format},
                           stats.view({2, R, H}));
  out.view({R, H, 512}).copy_(full.narrow(2, 0, 512));
  return true;
}
