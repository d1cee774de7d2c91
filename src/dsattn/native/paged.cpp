// Key addresses in paged caches (dsattn/common/layout.py: KVSource.locate + flat_index, fused): the
// flat row of logical key x of batch b is table[b, x / bs] * bs + x % bs in the cache viewed as
// [num_blocks * bs, D], -1 where the entry is masked out.  The PyTorch version is a dozen small
// operator calls per key source and block of query rows; a decode step's attention makes several.
#include <torch/extension.h>

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
