// Python bindings of the compiled kernel layer (dsattn/native/__init__.py builds and loads it).
#include <torch/extension.h>

torch::Tensor plan_table(int64_t num_heads_q, c10::optional<torch::Tensor> seqused_q,
                         c10::optional<torch::Tensor> cu_seqlens_q, c10::optional<torch::Tensor> seqused_kv,
                         c10::optional<torch::Tensor> cu_seqlens_ori_kv, int64_t batch_size, int64_t max_seqlen_q,
                         int64_t max_seqlen_kv, bool q_tnd, bool kv_tnd, bool has_cmp, int64_t cmp_topk,
                         int64_t cmp_ratio, int64_t ori_mask_mode, int64_t ori_win_left, int64_t aic, int64_t aiv,
                         bool support_fd);
torch::Tensor plan_lengths(int64_t num_heads_q, std::vector<int64_t> S1, std::vector<int64_t> S2, bool has_cmp,
                           int64_t cmp_topk, int64_t cmp_ratio, int64_t ori_mask_mode, int64_t ori_win_left,
                           int64_t aic, int64_t aiv, bool support_fd);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dsattn's compiled kernel layer";
  m.def("plan_table", &plan_table, "the metadata plan table (spec 50) from CPU int32 length mirrors");
  m.def("plan_lengths", &plan_lengths, "the metadata plan table for explicit per-batch lengths");
}
