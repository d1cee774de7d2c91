// Python bindings of the compiled kernel layer (dsattn/native/__init__.py builds and loads it).
#include <torch/extension.h>

#include "attention.h"
#include "common.h"
#include "keys.h"

torch::Tensor plan_table(int64_t num_heads_q, c10::optional<torch::Tensor> seqused_q,
                         c10::optional<torch::Tensor> cu_seqlens_q, c10::optional<torch::Tensor> seqused_kv,
                         c10::optional<torch::Tensor> cu_seqlens_ori_kv, int64_t batch_size, int64_t max_seqlen_q,
                         int64_t max_seqlen_kv, bool q_tnd, bool kv_tnd, bool has_cmp, int64_t cmp_topk,
                         int64_t cmp_ratio, int64_t ori_mask_mode, int64_t ori_win_left, int64_t aic, int64_t aiv,
                         bool support_fd);
torch::Tensor plan_lengths(int64_t num_heads_q, std::vector<int64_t> S1, std::vector<int64_t> S2, bool has_cmp,
                           int64_t cmp_topk, int64_t cmp_ratio, int64_t ori_mask_mode, int64_t ori_win_left,
                           int64_t aic, int64_t aiv, bool support_fd);
std::vector<torch::Tensor> sparse_attention_backward(const torch::Tensor& q, const torch::Tensor& dout,
                                                     const torch::Tensor& out, const torch::Tensor& lse,
                                                     const std::vector<torch::Tensor>& sources,
                                                     const std::vector<torch::Tensor>& rows,
                                                     const c10::optional<torch::Tensor>& sinks, double scale,
                                                     const c10::optional<torch::Tensor>& dq_into,
                                                     const c10::optional<torch::Tensor>& groups,
                                                     const std::vector<torch::Tensor>& dsources_into);
std::string attention_gemm(const std::string& dtype);
bool fp8_decode_matches();
c10::optional<bool> packed_layout_matches(int64_t K, int64_t N);
c10::optional<double> packed_gemm_error(int64_t M, int64_t K, int64_t N);
std::vector<torch::Tensor> indexer_topk(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& pages,
                                        int64_t page, const torch::Tensor& batch, const torch::Tensor& n,
                                        const torch::Tensor& w, int64_t topk,
                                        const c10::optional<torch::Tensor>& offset);
std::vector<torch::Tensor> indexer_topk_quant(const torch::Tensor& q, const torch::Tensor& codes,
                                              const torch::Tensor& scales, bool fp8, const torch::Tensor& pages,
                                              int64_t page, const torch::Tensor& batch, const torch::Tensor& n,
                                              const torch::Tensor& w, int64_t topk,
                                              const c10::optional<torch::Tensor>& offset,
                                              const c10::optional<torch::Tensor>& qscale);

bool indexer_head_sums_match(int64_t H, int64_t n);
bool indexer_codes_match();
torch::Tensor index_codes_bf16(const torch::Tensor& codes, bool fp8);
std::vector<at::Tensor> rows_matmul(const at::Tensor& a, const std::vector<at::Tensor>& bs);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, int64_t bn, int64_t bk,
                        const c10::optional<at::Tensor>& bias, const std::string& format, int64_t stream_rows_max);

at::Tensor compressor_pool(const at::Tensor& kv_new, const at::Tensor& sc_new, const at::Tensor& state,
                           const at::Tensor& kind, const at::Tensor& new_at, const at::Tensor& state_at,
                           const at::Tensor& valid, int64_t coff);

std::tuple<std::vector<torch::Tensor>, std::string> plan_coverage(
    const torch::Tensor& table, int64_t num_heads_q, std::vector<int64_t> S1, std::vector<int64_t> S2, bool has_cmp,
    int64_t cmp_topk, int64_t cmp_ratio, int64_t ori_mask_mode, int64_t ori_win_left, bool check);

std::vector<int64_t> table_covers(const at::Tensor& table, const at::Tensor& needed, int64_t block_size,
                                  int64_t num_blocks);
std::tuple<at::Tensor, std::vector<int64_t>> paged_rows(const at::Tensor& table, const at::Tensor& batch,
                                                        const at::Tensor& x, const at::Tensor& mask,
                                                        int64_t block_size, int64_t num_blocks);
// DeepSeek-V4's float32 model ops outside attention (v4_model.cpp)
std::vector<at::Tensor> v4_hc_pre(const at::Tensor& x, const at::Tensor& fn, const at::Tensor& hc_scale,
                                  const at::Tensor& hc_base, int64_t hc, int64_t sinkhorn_repeat, double rms_eps,
                                  double hc_eps);
at::Tensor v4_hc_post(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& post,
                      const at::Tensor& comb);
at::Tensor v4_hc_head(const at::Tensor& x, const at::Tensor& hc_fn, const at::Tensor& hc_scale,
                      const at::Tensor& hc_base, double hc_eps, double norm_eps);
at::Tensor v4_gptj_rope(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin, bool inverse);
at::Tensor v4_qnorm_rope_kv_insert(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& positions,
                                   at::Tensor cache_2d, const at::Tensor& slots, const at::Tensor& cos_sin,
                                   int64_t q_head_padded, double eps, int64_t block_size, bool flush_subnormals);
// why the AVX512-BF16 path is not there: the CPU, or the cap
static std::string no_avx512bf16() {
  if (dsattn_native::cpu_isa_own() >= dsattn_native::ISA_AVX512_BF16)
    return std::string("DSATTN_CPU_ISA=") + dsattn_native::isa_name(dsattn_native::cpu_isa()) +
           " caps the kernels below AVX512-BF16";
  return "this CPU has no AVX512-BF16";
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dsattn's compiled kernel layer";
  m.def("v4_hc_pre", &v4_hc_pre, "DeepSeek-V4 mHC pre in float32: (layer input, post, comb) of the streams");
  m.def("v4_hc_post", &v4_hc_post, "DeepSeek-V4 mHC post in float32: the streams after a layer");
  m.def("v4_hc_head", &v4_hc_head, "DeepSeek-V4 mHC head in float32: the final collapse of the streams");
  m.def("v4_gptj_rope", &v4_gptj_rope, "GPT-J RoPE of each row's last dims (inverse: undone), float32");
  m.def("v4_qnorm_rope_kv_insert", &v4_qnorm_rope_kv_insert,
        "DeepSeek-V4 query norm + RoPE, window row RoPE + FP8 store into FlashMLA's V4 cache, float32");
  m.def("plan_table", &plan_table, "the metadata plan table (spec 50) from CPU int32 length mirrors");
  m.def("sparse_attention_forward", &sparse_attention_forward,
        "fused sparse attention forward over gathered key rows (the golden's rounding points)", pybind11::arg("q"),
        pybind11::arg("sources"), pybind11::arg("rows"), pybind11::arg("sinks"), pybind11::arg("scale"),
        pybind11::arg("out") = pybind11::none(), pybind11::arg("lse") = pybind11::none(),
        pybind11::arg("sink_in_lse") = true, pybind11::arg("max") = pybind11::none(),
        pybind11::arg("formats") = std::vector<std::vector<int64_t>>{}, pybind11::arg("stats") = pybind11::none());
  m.def("sparse_attention_backward", &sparse_attention_backward,
        "gradients of the fused sparse attention: dq, the key rows' fp32 gradients, dsinks, P's head mean",
        pybind11::arg("q"), pybind11::arg("dout"), pybind11::arg("out"), pybind11::arg("lse"), pybind11::arg("sources"),
        pybind11::arg("rows"), pybind11::arg("sinks"), pybind11::arg("scale"), pybind11::arg("dq") = pybind11::none(),
        pybind11::arg("groups") = pybind11::none(), pybind11::arg("dsources") = std::vector<torch::Tensor>{});
  m.def("kernels_available", [] { return bool(DSATTN_HAVE_BRGEMM); },
        "whether this torch exports the batch-reduce GEMM the attention and indexer kernels run on");
  m.def("set_gemm_path", [](const std::string& path) {
          TORCH_CHECK_VALUE(path == "best" || path == "avx512bf16" || path == "onednn" || path == "fp32" ||
                                path == "own",
                            "gemm path: expected 'best', 'own', 'avx512bf16', 'onednn' or 'fp32', got '", path, "'");
          TORCH_CHECK_VALUE(path != "avx512bf16" || dsattn_native::cpu_has_avx512bf16(),
                            "gemm path 'avx512bf16': ", no_avx512bf16());
          TORCH_CHECK_VALUE(path != "onednn" || dsattn_native::bf16_choice().onednn_runs,
                            "gemm path 'onednn' (oneDNN's avx512_core_bf16 ukernel without AMX): ",
                            dsattn_native::cpu_runs_amx(at::kBFloat16)
                                ? "this CPU has AMX, whose oneDNN kernel is its 'best' path"
                                : !dsattn_native::cpu_has_avx512bf16() ? no_avx512bf16()
                                                                       : dsattn_native::bf16_choice().why);
          dsattn_native::gemm_request().store(path == "best"     ? dsattn_native::GEMM_BEST
                                              : path == "fp32"   ? dsattn_native::GEMM_FP32
                                              : path == "own"    ? dsattn_native::GEMM_OWN
                                              : path == "onednn" ? dsattn_native::GEMM_ONEDNN
                                                                 : dsattn_native::GEMM_AVX512BF16);
        },
        "the GEMM path: the CPU's best (AMX -> AVX512-BF16, ours or oneDNN's -> fp32), dsattn's own kernels only "
        "('own'), or one forced on any CPU that has it");
  m.def("gemm_is_own", [](const std::string& dtype) {
          const auto dt = dtype == "bfloat16" ? at::kBFloat16 : dtype == "float16" ? at::kHalf : at::kFloat;
          TORCH_CHECK_VALUE(dtype == "bfloat16" || dtype == "float16" || dtype == "float32",
                            "gemm_is_own: dtype 'bfloat16', 'float16' or 'float32', got '", dtype, "'");
          return dsattn_native::gemm_is_own(dt);
        },
        "whether a dtype's GEMMs run on dsattn's own kernels (one summation order per element: batch invariant) "
        "rather than oneDNN's (AMX, the onednn path: no invariance promised)");
  m.def("bf16_gemm_choice", [] {
          const auto& c = dsattn_native::bf16_choice();
          pybind11::dict d;
          d["measured"] = c.measured;
          d["onednn_runs"] = c.onednn_runs;
          d["own_gflops"] = c.own_gflops;
          d["onednn_gflops"] = c.onednn_gflops;
          d["chosen"] = c.measured ? (c.onednn ? "onednn" : "avx512bf16") : "";
          d["why"] = c.why;
          return d;
        },
        "AVX512-BF16 CPUs without AMX: the micro-kernel and oneDNN's bf16 ukernel timed once on the attention's "
        "shapes (one thread, GFLOP/s) and which the process runs");
  m.def("gemm_gflops", [](const std::string& path, int64_t M, int64_t N, int64_t K, int64_t panel) -> double {
          // (the arguments first: what is wrong with the call, whatever the CPU)
          TORCH_CHECK_VALUE(path == "avx512bf16" || path == "onednn" || path == "fp32" || path == "brgemm_fp32",
                            "gemm_gflops: path 'avx512bf16', 'onednn', 'fp32' or 'brgemm_fp32'");
          TORCH_CHECK_VALUE(M > 0 && N > 0 && K > 0 && K % 2 == 0 && panel > 0, "M, N, K, panel > 0 and K even");
          TORCH_CHECK_VALUE(path != "avx512bf16" || dsattn_native::cpu_has_avx512bf16(), no_avx512bf16());
#if DSATTN_HAVE_BRGEMM
          if (path == "fp32" || path == "brgemm_fp32")      // (plain fp32 B: no panels)
            return 2.0 * M * N * K / dsattn_native::fp32_gemm_seconds(path == "fp32", M, N, K) / 1e9;
          const auto kind = path == "onednn" ? dsattn_native::KIND_ONEDNN : dsattn_native::KIND_AVX512BF16;
          return 2.0 * M * N * K / dsattn_native::gemm_seconds(kind, M, N, K, panel) / 1e9;
#else
          TORCH_CHECK(false, "this torch has no cpublas::brgemm");
#endif
        },
        "GFLOP/s of one GEMM shape on this thread, operands in cache: bf16 with B in pair panels of `panel` columns "
        "(avx512bf16, onednn), or fp32 on dsattn's GEMM (fp32) or ATen's cpublas::brgemm (brgemm_fp32)");
  m.def("cpu_has_avx512bf16", &dsattn_native::cpu_has_avx512bf16,
        "whether the kernels may run AVX512-BF16 (vdpbf16ps): the CPU has it and DSATTN_CPU_ISA does not cap it");
  m.def("cpu_isa", [] { return std::string(dsattn_native::isa_name(dsattn_native::cpu_isa())); },
        "the class the kernels run as: the CPU's own, capped by DSATTN_CPU_ISA (generic, avx2, avx512, avx512_bf16, amx)");
  m.def("cpu_isa_own", [] { return std::string(dsattn_native::isa_name(dsattn_native::cpu_isa_own())); },
        "the CPU's own class, as the compiled layer sees it");
  m.def("attention_gemm", &attention_gemm, "which GEMM the kernels run for a query dtype: amx, avx512bf16, onednn or fp32");
  m.def("packed_layout_matches", &packed_layout_matches, "test hook: our packed V layout equals cpublas::pack's");
  m.def("packed_gemm_error", &packed_gemm_error, "test hook: a GEMM through our packed panels against an fp64 matmul");
  m.def("fp8_decode_matches", &fp8_decode_matches, "test hook: the packed rows' fp8 decode equals c10's for all 256 codes");
  m.def("transposes_match", &dsattn_native::transposes_match,
        "test hook: the 32-bit transposes (scalar and AVX-512 tiles, edges) equal the element loop");
  m.def("indexer_topk", &indexer_topk, "lightning-indexer top-k of query rows over their requests' keys",
        pybind11::arg("q"), pybind11::arg("keys"), pybind11::arg("pages"), pybind11::arg("page"), pybind11::arg("batch"),
        pybind11::arg("n"), pybind11::arg("w"), pybind11::arg("topk"), pybind11::arg("offset") = pybind11::none());
  m.def("indexer_topk_quant", &indexer_topk_quant,
        "lightning-indexer top-k over a quantised key pool (int8 / fp8 codes, fp32 scale per key) read in place",
        pybind11::arg("q"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("fp8"), pybind11::arg("pages"),
        pybind11::arg("page"), pybind11::arg("batch"), pybind11::arg("n"), pybind11::arg("w"), pybind11::arg("topk"),
        pybind11::arg("offset") = pybind11::none(), pybind11::arg("qscale") = pybind11::none());
  m.def("index_codes_bf16", &index_codes_bf16, "int8 / fp8 e4m3fn codes (uint8) -> their exact values as bf16",
        pybind11::arg("codes"), pybind11::arg("fp8"));
  m.def("indexer_codes_match", &indexer_codes_match,
        "test hook: the quantised indexer's int8 / fp8 code decodes equal c10's for all 256 codes, every operand type");
  m.def("indexer_head_sums_match", &indexer_head_sums_match,
        "test hook: the indexer's head sums in key-major and head-major layouts give the same bits");
  m.def("quant_linear", &quant_linear,
        "x W^T (+ bias) with W as codes (fp8: e4m3fn [N, K]; fp4: e2m1 pairs [N, K / 2]) and fp32 scales per "
        "(bn x bk) block, read in place; rows of x up to stream_rows_max streamed (-1: 8; 0: tiled; >= M: every row, "
        "one summation order for any M)",
        py::arg("x"), py::arg("codes"), py::arg("scale"), py::arg("bn"), py::arg("bk"), py::arg("bias") = py::none(),
        py::arg("format") = "fp8", py::arg("stream_rows_max") = -1);
  m.def("rows_matmul", &rows_matmul,
        "a [R, K] times each b [N, K] transposed, fp32; each row's result independent of the other rows and of the "
        "thread count; a is packed once for every b");
  m.def("compressor_pool", &compressor_pool, "the compressor's gated softmax pooling of output rows over their slots");
  m.def("plan_coverage", &plan_coverage,
        "a plan table read for a call: row geometry, whole rows, partial pieces, FD entries, first violated invariant");
  m.def("table_covers", &table_covers,
        "the first way a paged table fails to cover each batch's needed keys ({} none, {0, b}, {1, b, column})");
  m.def("paged_rows", &paged_rows, "flat rows of logical keys in a paged cache (-1 where masked out)");
  m.def("sharedkv_paged", &sharedkv_paged,
        "a decode-sized sparse_attn_sharedkv call over paged caches in one step; False: declined, nothing written");
  m.def("flashmla_sparse", &flashmla_sparse,
        "FlashMLA's sparse decode over index lists in one step; False: declined, nothing written");
  m.def("qsfa_paged", &qsfa_paged,
        "a decode-sized kv_quant_sparse_flash_attention call over a paged packed cache in one step; False: declined");
  m.def("key_tables", &key_tables, "flat key rows of query rows (ori window, compressed entries): keys() + rows_index",
        py::arg("t0"), py::arg("t1"), py::arg("batch"), py::arg("local"), py::arg("used"), py::arg("extent"),
        py::arg("ori_lengths"), py::arg("ori_kind"), py::arg("ori_map"), py::arg("ori_page"), py::arg("ori_blocks"),
        py::arg("ori_width"), py::arg("ori_mask_mode"), py::arg("win_left"), py::arg("win_right"), py::arg("positional"),
        py::arg("cmp_lengths") = py::none(), py::arg("cmp_bound") = py::none(), py::arg("cmp_kind") = 0,
        py::arg("cmp_map") = py::none(), py::arg("cmp_page") = 1, py::arg("cmp_blocks") = 0, py::arg("cmp_width") = 0,
        py::arg("cmp_mask_mode") = 0, py::arg("ratio") = 1, py::arg("cmp_indices") = py::none(),
        py::arg("walk_cap") = py::none());
  m.def("plan_lengths", &plan_lengths, "the metadata plan table for explicit per-batch lengths");
}
