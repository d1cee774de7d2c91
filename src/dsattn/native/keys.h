// The key selection of query rows (20 §1.2; dsattn/common/masks.py, MlaProblem.keys) as flat row
// numbers of each source (KVSource.rows_index): shared by paged.cpp (the tables for Python's problem)
// and sharedkv.cpp (a whole sparse_attn_sharedkv call in one step).
//
// A row at position p = S2o - S1e + i reads the window [lo, hi) of its ori keys (mask mode 0: all,
// 3: causal, 4: band) and the compressed entries below its threshold (all of them, or its index list
// walked up to the first -1, entries >= the threshold skipped, at most min(threshold,
// cmp_topk_length) slots).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

namespace dsattn_native {

inline int64_t floor_div(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

// Logical key x of batch b -> its row in the source viewed as [rows, D] (KVSource.flat_rows).
struct KeyMap {
  int64_t kind = 0;                // 0: BSND (b * page + x), 1: TND (cu[b] + x), 2: paged
  const int32_t* table = nullptr;  // paged: [B, columns] block numbers
  int64_t columns = 0;
  const int64_t* cu = nullptr;     // TND: segment starts
  int64_t page = 1;                // BSND: rows per batch; paged: block size
  int64_t num_blocks = 0;

  // A paged cache's map: its contiguous int32 block table [B, columns] (kept alive by the caller), its
  // block size and block count.
  static KeyMap paged(const at::Tensor& table, int64_t block_size, int64_t blocks) {
    KeyMap m;
    m.kind = 2;
    m.table = table.data_ptr<int32_t>();
    m.columns = table.size(1);
    m.page = block_size;
    m.num_blocks = blocks;
    return m;
  }

  // false (and row -1) when a paged entry is past the table or not a block of the cache
  bool row(int64_t b, int64_t x, int64_t& out) const {
    if (kind == 0) {
      out = b * page + x;
      return true;
    }
    if (kind == 1) {
      out = cu[b] + x;
      return true;
    }
    const int64_t col = x / page;
    const int64_t blk = col < columns ? table[b * columns + col] : -1;
    if (blk < 0 || blk >= num_blocks) {
      out = -1;
      return false;
    }
    out = blk * page + x % page;
    return true;
  }
};

// First entry per source whose paged address fails: {b, x}, or empty.  Kept per source, first in
// row-major order, so that callers report the entry the PyTorch version reports (ori before cmp).
struct BadKeys {
  std::vector<int64_t> ori, cmp;
};

struct KeySelection {
  int64_t B = 0;
  const int64_t *batch = nullptr, *local = nullptr;   // per query row
  const bool* used = nullptr;
  const int64_t *S1e = nullptr, *S2o = nullptr;       // per batch
  KeyMap ori;
  int64_t Wo = 0, om = 4, wl = 127, wr = 0;
  bool positional = true;
  bool has_cmp = false;
  const int64_t *S2c = nullptr, *Lc = nullptr;        // per batch
  const int64_t* cap = nullptr;                       // per query row, or null
  const int32_t* idx = nullptr;                       // [rows, K], or null (every entry below the threshold)
  int64_t K = 0;
  KeyMap cmp;
  int64_t Wc = 0, cm = 3, r = 1;

  // Rows [t0, t1) into ori_out [t1 - t0, Wo] and cmp_out [t1 - t0, Wc] (-1 = no key).
  BadKeys fill(int64_t t0, int64_t t1, int64_t* ori_out, int64_t* cmp_out) const {
    BadKeys bad;
    int64_t ori_at = -1, cmp_at = -1;
    std::mutex lock;
    at::parallel_for(0, t1 - t0, 64, [&](int64_t r0, int64_t r1) {
      BadKeys mine;
      int64_t oa = -1, ca = -1;
      for (int64_t row = r0; row < r1; ++row) fill_row(t0, row, ori_out, cmp_out, mine, oa, ca);
      if (oa < 0 && ca < 0) return;
      std::lock_guard<std::mutex> guard(lock);
      if (oa >= 0 && (ori_at < 0 || oa < ori_at)) ori_at = oa, bad.ori = mine.ori;
      if (ca >= 0 && (cmp_at < 0 || ca < cmp_at)) cmp_at = ca, bad.cmp = mine.cmp;
    });
    return bad;
  }

 private:
  static void keep(std::vector<int64_t>& bad, int64_t& at, int64_t row, int64_t w, int64_t b, int64_t x) {
    const int64_t pos = (row << 32) + w;
    if (at < 0 || pos < at) at = pos, bad = {b, x};
  }

  void fill_row(int64_t t0, int64_t row, int64_t* ori_out, int64_t* cmp_out, BadKeys& bad, int64_t& oa,
                int64_t& ca) const {
    const int64_t t = t0 + row, b = batch[t], i = local[t];
    TORCH_CHECK_INDEX(b >= 0 && b < B, "batch: ", b, " is not in [0, ", B, ")");
    const int64_t p = S2o[b] - S1e[b] + i;
    const bool valid = used[t] && (!positional || p >= 0);
    int64_t lo = 0, hi = S2o[b];
    if (om == 3) {
      hi = std::min(p + 1, S2o[b]);
    } else if (om == 4) {
      lo = wl == -1 ? 0 : std::max<int64_t>(p - wl, 0);
      hi = std::max(lo, wr == -1 ? S2o[b] : std::min(p + wr + 1, S2o[b]));
    }
    for (int64_t w = 0; w < Wo; ++w) {
      const int64_t x = lo + w;
      int64_t& dst = ori_out[row * Wo + w];
      dst = -1;
      if (valid && x < hi && !ori.row(b, x, dst)) keep(bad.ori, oa, row, w, b, x);
    }
    if (!has_cmp) return;
    const int64_t pc = Lc[b] - S1e[b] + i;
    const int64_t thr = std::min(cm == 3 ? (pc + 1 > 0 ? floor_div(pc + 1, r) : 0) : floor_div(S2o[b], r), S2c[b]);
    const int64_t limit = cap != nullptr ? std::min(thr, cap[t]) : thr;
    bool ended = false;
    for (int64_t w = 0; w < Wc; ++w) {
      int64_t& dst = cmp_out[row * Wc + w];
      dst = -1;
      int64_t x = w;
      bool take = w < thr;
      if (idx != nullptr) {
        x = idx[t * K + w];
        ended = ended || x < 0;
        take = w < limit && !ended && x < thr;
      }
      if (valid && take && !cmp.row(b, x, dst)) keep(bad.cmp, ca, row, w, b, x);
    }
  }
};

// The one-step paths (sharedkv.cpp, flashmla.cpp, kv_quant.cpp) decline a call whose integer arguments
// are not CPU int32 tensors; these read them, and build the query rows.
inline bool cpu_int32(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->device().is_cpu() && t->scalar_type() == at::kInt;
}

inline std::vector<int64_t> int_values(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const int32_t* p = c.data_ptr<int32_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

// An optional sinks argument the steps take: fp32 [H] on the CPU.
inline bool sinks_ok(const c10::optional<at::Tensor>& sinks, int64_t H) {
  return !sinks.has_value() ||
         (sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == H);
}

// Flattened query rows (dsattn/common/layout.py: query_rows): per row its batch, its index inside the
// batch's extent, and whether it is used (not padding).
struct QueryRowsHost {
  int64_t B = 0;
  std::vector<int64_t> batch, local, extent;
  std::unique_ptr<bool[]> used;

  // TND rows from the segment starts cu [B + 1]; false when cu does not start at 0, decreases or ends
  // past the R rows.  Rows past cu[B] belong to the last batch, unused.
  bool tnd(const std::vector<int64_t>& cu, int64_t R) {
    B = static_cast<int64_t>(cu.size()) - 1;
    if (B < 1 || cu[0] != 0 || cu[B] > R) return false;
    for (int64_t b = 0; b < B; ++b)
      if (cu[b + 1] < cu[b]) return false;
    extent.resize(B);
    for (int64_t b = 0; b < B; ++b) extent[b] = cu[b + 1] - cu[b];
    alloc(R);
    int64_t b = 0;
    for (int64_t t = 0; t < R; ++t) {
      while (b < B && cu[b + 1] <= t) ++b;                  // first batch whose segment ends past t
      const int64_t bb = std::min(b, B - 1);
      batch[t] = bb;
      local[t] = t - cu[bb];
      used[t] = b < B && local[t] < extent[bb];
    }
    return true;
  }

  // BSND rows: B batches of S1 rows, the first extent[b] of batch b used.
  void bsnd(int64_t batches, int64_t S1, std::vector<int64_t> extents) {
    B = batches;
    extent = std::move(extents);
    alloc(B * S1);
    for (int64_t t = 0; t < B * S1; ++t) batch[t] = t / S1, local[t] = t % S1, used[t] = local[t] < extent[batch[t]];
  }

 private:
  void alloc(int64_t R) {
    batch.assign(R, 0);
    local.assign(R, 0);
    used.reset(new bool[R]);
  }
};

}  // namespace dsattn_native

// The bound entries built on it or beside it: paged.cpp (key_tables), sharedkv.cpp (sharedkv_paged),
// flashmla.cpp (flashmla_sparse) and kv_quant.cpp (qsfa_paged).
std::tuple<std::vector<at::Tensor>, std::vector<std::vector<int64_t>>> key_tables(
    int64_t t0, int64_t t1, const at::Tensor& batch, const at::Tensor& local, const at::Tensor& used,
    const at::Tensor& extent, const at::Tensor& ori_lengths, int64_t ori_kind, const at::Tensor& ori_map,
    int64_t ori_page, int64_t ori_blocks, int64_t ori_width, int64_t ori_mask_mode, int64_t win_left, int64_t win_right,
    bool positional, const c10::optional<at::Tensor>& cmp_lengths, const c10::optional<at::Tensor>& cmp_bound,
    int64_t cmp_kind, const c10::optional<at::Tensor>& cmp_map, int64_t cmp_page, int64_t cmp_blocks,
    int64_t cmp_width, int64_t cmp_mask_mode, int64_t ratio, const c10::optional<at::Tensor>& cmp_indices,
    const c10::optional<at::Tensor>& walk_cap);

bool sharedkv_paged(at::Tensor out, const at::Tensor& q, const at::Tensor& ori_kv, const c10::optional<at::Tensor>& cmp_kv,
                    const c10::optional<at::Tensor>& ori_block_table, const c10::optional<at::Tensor>& cmp_block_table,
                    const c10::optional<at::Tensor>& seqused_kv, const c10::optional<at::Tensor>& cu_seqlens_q,
                    const c10::optional<at::Tensor>& cmp_sparse_indices,
                    const c10::optional<at::Tensor>& cmp_topk_length, const c10::optional<at::Tensor>& sinks,
                    double scale, int64_t ratio, int64_t ori_mask_mode, int64_t cmp_mask_mode, int64_t win_left,
                    int64_t win_right, bool tnd, const std::vector<std::vector<int64_t>>& formats);

bool flashmla_sparse(at::Tensor out, at::Tensor lse, const at::Tensor& q, const std::vector<at::Tensor>& sources,
                     const std::vector<std::vector<int64_t>>& formats, const std::vector<at::Tensor>& indices,
                     const std::vector<at::Tensor>& lengths, const std::vector<int64_t>& tokens, int64_t s_q,
                     const c10::optional<at::Tensor>& sinks, double scale);

bool qsfa_paged(at::Tensor out, at::Tensor stats, const at::Tensor& query, const at::Tensor& key,
                const at::Tensor& sparse_indices, const c10::optional<at::Tensor>& block_table,
                const c10::optional<at::Tensor>& seq_q, const c10::optional<at::Tensor>& seq_kv,
                const c10::optional<at::Tensor>& sinks, double scale, int64_t sparse_block, bool causal, bool tnd,
                const std::vector<int64_t>& format);
