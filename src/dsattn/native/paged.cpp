// Key addresses in paged caches (dsattn/common/layout.py: KVSource.locate + flat_index, fused): the
// flat row of logical key x of batch b is table[b, x / bs] * bs + x % bs in the cache viewed as
// [num_blocks * bs, D], -1 where the entry is masked out.  The PyTorch version is a dozen small
// operator calls per key source and block of query rows; a decode step's attention makes several.
#include <torch/extension.h>

#include "keys.h"

#include <tuple>
#include <vector>

// (flat [R, W] int64, bad): ``bad`` is {r, w} of the first masked-in entry (row-major) whose block
// column is past the table or whose table entry is not in [0, num_blocks), else empty.  Such an
// entry gets the address the PyTorch version computes (its column clamped to the table's last).
std::tuple<at::Tensor, std::vector<int64_t>> paged_rows(const at::Tensor& table, const at::Tensor& batch,
                                                        const at::Tensor& x, const at::Tensor& mask,
                                                        int64_t block_size, int64_t num_blocks) {
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kInt && table.device().is_cpu(),
              "table: expected a CPU int32 [B, blocks] tensor");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kLong && mask.sizes() == x.sizes() &&
                  mask.scalar_type() == at::kBool, "x, mask: int64 and bool [R, W]");
  TORCH_CHECK(batch.scalar_type() == at::kLong && batch.numel() == x.size(0), "batch: int64 [R]");
  TORCH_CHECK(block_size > 0, "block_size: must be positive");
  const auto tc = table.contiguous(), bc = batch.contiguous(), xc = x.contiguous(), mc = mask.contiguous();
  const int32_t* tp = tc.data_ptr<int32_t>();
  const int64_t *bp = bc.data_ptr<int64_t>(), *xp = xc.data_ptr<int64_t>();
  const bool* mp = mc.data_ptr<bool>();
  const int64_t R = x.size(0), W = x.size(1), B = table.size(0), nbt = table.size(1);
  auto flat = at::empty({R, W}, x.options().dtype(at::kLong));
  int64_t* fp = flat.data_ptr<int64_t>();
  std::vector<int64_t> bad;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = bp[r];
    TORCH_CHECK_INDEX(b >= 0 && b < B, "batch: ", b, " is not in [0, ", B, ")");
    for (int64_t w = 0; w < W; ++w) {
      const int64_t i = r * W + w;
      if (!mp[i]) {
        fp[i] = -1;
        continue;
      }
      const int64_t v = xp[i];
      TORCH_CHECK_INDEX(v >= 0, "x: a selected key position is negative (", v, ")");
      const int64_t col = v / block_size, off = v % block_size;
      if (nbt == 0) {
        if (bad.empty()) bad = {r, w};
        fp[i] = -1;
        continue;
      }
      const int64_t blk = tp[b * nbt + std::min(col, nbt - 1)];
      if (bad.empty() && (col >= nbt || blk < 0 || blk >= num_blocks)) bad = {r, w};
      fp[i] = blk * block_size + off;
    }
  }
  return {flat, bad};
}

// The first way in which batch b's first needed[b] keys are not all in blocks of the cache (KVSource.
// check_table_covers, one call instead of a dozen small ones per operator call): {} if none, {0, b} when
// they need more block columns than the table has, {1, b, c} when entry [b, c] is not in [0, num_blocks).
std::vector<int64_t> table_covers(const at::Tensor& table, const at::Tensor& needed, int64_t block_size,
                                  int64_t num_blocks) {
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kInt && table.device().is_cpu(),
              "table: expected a CPU int32 [B, blocks] tensor");
  TORCH_CHECK(needed.dim() == 1 && needed.scalar_type() == at::kLong && needed.numel() == table.size(0) &&
                  needed.device().is_cpu(), "needed: expected a CPU int64 [B] tensor");
  TORCH_CHECK(block_size > 0, "block_size: must be positive");
  const auto tc = table.contiguous(), nc = needed.contiguous();
  const int32_t* tp = tc.data_ptr<int32_t>();
  const int64_t* np = nc.data_ptr<int64_t>();
  const int64_t B = table.size(0), nbt = table.size(1);
  for (int64_t b = 0; b < B; ++b)
    if ((std::max<int64_t>(np[b], 0) + block_size - 1) / block_size > nbt) return {0, b};
  for (int64_t b = 0; b < B; ++b) {
    const int64_t cols = (std::max<int64_t>(np[b], 0) + block_size - 1) / block_size;
    for (int64_t c = 0; c < cols; ++c)
      if (tp[b * nbt + c] < 0 || tp[b * nbt + c] >= num_blocks) return {1, b, c};
  }
  return {};
}

// Key tables of query rows (keys.h) from the Python problem's tensors: MlaProblem.key_tables.
namespace {

using dsattn_native::KeyMap;
using dsattn_native::KeySelection;

KeyMap key_map(int64_t kind, const at::Tensor& map, int64_t page, int64_t num_blocks, int64_t B, const char* name) {
  TORCH_CHECK(kind >= 0 && kind <= 2 && page >= 1, name, ": kind must be 0 (BSND), 1 (TND) or 2 (paged), page >= 1");
  if (kind == 2) {
    TORCH_CHECK(map.scalar_type() == at::kInt && map.dim() == 2 && map.size(0) == B && map.is_contiguous(), name,
                ": paged needs its contiguous int32 block table [B, columns]");
    return KeyMap::paged(map, page, num_blocks);
  }
  KeyMap m;
  m.kind = kind;
  m.page = page;
  if (kind == 1) {
    TORCH_CHECK(map.scalar_type() == at::kLong && map.is_contiguous() && map.numel() >= B + 1, name,
                ": TND needs its int64 cu_seqlens [B + 1]");
    m.cu = map.data_ptr<int64_t>();
  }
  return m;
}

const int64_t* batch_vector(const at::Tensor& t, int64_t B, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 1 && t.size(0) == B && t.device().is_cpu(),
              name, ": expected a contiguous CPU int64 [", B, "] tensor");
  return t.data_ptr<int64_t>();
}

}  // namespace

// (tables [ori [R, Wo], cmp [R, Wc]] int64 rows, -1 = no key; bad [ori {b, x} or {}, cmp {b, x} or {}])
// for the flattened query rows [t0, t1).  Per row: batch, local index i, used; per batch: S1e, S2o,
// and with the compressed branch S2c and the causal bound Lc.
std::tuple<std::vector<at::Tensor>, std::vector<std::vector<int64_t>>> key_tables(
    int64_t t0, int64_t t1, const at::Tensor& batch, const at::Tensor& local, const at::Tensor& used,
    const at::Tensor& extent, const at::Tensor& ori_lengths, int64_t ori_kind, const at::Tensor& ori_map,
    int64_t ori_page, int64_t ori_blocks, int64_t ori_width, int64_t ori_mask_mode, int64_t win_left, int64_t win_right,
    bool positional, const c10::optional<at::Tensor>& cmp_lengths, const c10::optional<at::Tensor>& cmp_bound,
    int64_t cmp_kind, const c10::optional<at::Tensor>& cmp_map, int64_t cmp_page, int64_t cmp_blocks,
    int64_t cmp_width, int64_t cmp_mask_mode, int64_t ratio, const c10::optional<at::Tensor>& cmp_indices,
    const c10::optional<at::Tensor>& walk_cap) {
  KeySelection k;
  k.B = extent.numel();
  const int64_t R = batch.numel();
  TORCH_CHECK(0 <= t0 && t0 <= t1 && t1 <= R, "t0, t1: rows [", t0, ", ", t1, ") are not within [0, ", R, ")");
  TORCH_CHECK(used.numel() == R && used.scalar_type() == at::kBool && used.is_contiguous(), "used: a bool per query row");
  TORCH_CHECK(ori_width >= 0 && cmp_width >= 0 && ratio >= 1, "widths must be >= 0 and the ratio >= 1");
  k.batch = batch_vector(batch, R, "batch");
  k.local = batch_vector(local, R, "local");
  k.used = used.data_ptr<bool>();
  k.S1e = batch_vector(extent, k.B, "extent");
  k.S2o = batch_vector(ori_lengths, k.B, "ori_lengths");
  k.ori = key_map(ori_kind, ori_map, ori_page, ori_blocks, k.B, "ori_map");
  k.Wo = ori_width;
  k.om = ori_mask_mode;
  k.wl = win_left;
  k.wr = win_right;
  k.positional = positional;
  at::Tensor idx;
  if (cmp_lengths.has_value()) {
    TORCH_CHECK(cmp_bound.has_value() && cmp_map.has_value(), "cmp_bound, cmp_map: required with cmp_lengths");
    k.has_cmp = true;
    k.S2c = batch_vector(*cmp_lengths, k.B, "cmp_lengths");
    k.Lc = batch_vector(*cmp_bound, k.B, "cmp_bound");
    k.cmp = key_map(cmp_kind, *cmp_map, cmp_page, cmp_blocks, k.B, "cmp_map");
    k.Wc = cmp_width;
    k.cm = cmp_mask_mode;
    k.r = ratio;
    if (cmp_indices.has_value()) {
      idx = cmp_indices->contiguous();
      TORCH_CHECK(idx.scalar_type() == at::kInt && idx.dim() == 2 && idx.size(0) == R && idx.size(1) >= cmp_width,
                  "cmp_indices: expected int32 [R, K >= cmp_width]");
      k.idx = idx.data_ptr<int32_t>();
      k.K = idx.size(1);
    }
    if (walk_cap.has_value()) k.cap = batch_vector(*walk_cap, R, "walk_cap");
  }
  auto opts = batch.options().dtype(at::kLong);
  at::Tensor ori_rows = at::empty({t1 - t0, k.Wo}, opts), cmp_rows = at::empty({t1 - t0, k.Wc}, opts);
  const auto bad = k.fill(t0, t1, ori_rows.data_ptr<int64_t>(), cmp_rows.data_ptr<int64_t>());
  return {{ori_rows, cmp_rows}, {bad.ori, bad.cmp}};
}
