"""Every public signature pinned to the spec tables (seed 001, 10 §1.1/§2.1, 20 §2.1/§3.1/§5),
the façade's mapping onto the operators, and torch.compile over each operator."""
import inspect

import pytest
import torch

import dsattn
from dsattn import cases, hyper_parallel, ops, reference

P, K = "P", "K"   # positional-or-keyword, keyword-only
E = inspect.Parameter.empty

SCHEMAS = {
    "lightning_indexer": [
        ("q", P, E), ("k", P, E), ("w", P, E), ("topk", P, E), ("cu_seqlens_q", K, None), ("cu_seqlens_k", K, None),
        ("seqused_q", K, None), ("seqused_k", K, None), ("cmp_residual_k", K, None), ("block_table", K, None),
        ("output_idx_offset", K, None), ("metadata", K, None), ("max_seqlen_q", K, -1), ("layout_q", K, "BSND"),
        ("layout_k", K, "BSND"), ("mask_mode", K, 0), ("cmp_ratio", K, 1), ("return_value", K, 0)],
    "sparse_lightning_indexer_kl_loss_grad": [
        ("q", P, E), ("k", P, E), ("w", P, E), ("sparse_indices", P, E), ("attn_softmax_l1_norm", P, E),
        ("cu_seqlens_q", K, None), ("cu_seqlens_k", K, None), ("seqused_q", K, None), ("seqused_k", K, None),
        ("cmp_residual_k", K, None), ("metadata", K, None), ("layout_q", K, "TND"), ("layout_k", K, "TND"),
        ("mask_mode", K, 3), ("cmp_ratio", K, 1)],
}
_MLA_COMMON = [("ori_kv", K, None), ("cmp_kv", K, None), ("ori_sparse_indices", K, None),
               ("cmp_sparse_indices", K, None)]
_MLA_LENS = [("cu_seqlens_q", K, None), ("cu_seqlens_ori_kv", K, None), ("cu_seqlens_cmp_kv", K, None),
             ("seqused_q", K, None), ("seqused_ori_kv", K, None), ("seqused_cmp_kv", K, None),
             ("cmp_residual_kv", K, None), ("ori_topk_length", K, None), ("cmp_topk_length", K, None),
             ("sinks", K, None), ("metadata", K, None), ("softmax_scale", K, 1.0), ("cmp_ratio", K, 1),
             ("ori_mask_mode", K, 4), ("cmp_mask_mode", K, 3), ("ori_win_left", K, 127), ("ori_win_right", K, 0),
             ("layout_q", K, "BSND"), ("layout_kv", K, "BSND")]
SCHEMAS["sparse_flash_mla"] = ([("q", P, E)] + _MLA_COMMON + [("ori_block_table", K, None),
                               ("cmp_block_table", K, None)] + _MLA_LENS
                               + [("topk_value_mode", K, 1), ("return_softmax_lse", K, False)])
SCHEMAS["sparse_flash_mla_grad"] = ([("q", P, E), ("dout", P, E), ("attn_out", P, E), ("softmax_lse", P, E)]
                                    + _MLA_COMMON + _MLA_LENS)
_INT64_MAX = 2 ** 63 - 1
SCHEMAS["compressor"] = [
    ("x", P, E), ("wkv", P, E), ("wgate", P, E), ("state_cache", P, E), ("ape", P, E), ("cmp_ratio", P, 4),
    ("state_block_table", K, None), ("cu_seqlens", K, None), ("seqused", K, None), ("start_pos", K, None),
    ("coff", K, 1), ("cache_mode", K, 1)]
SCHEMAS["compressor_inference"] = [
    ("x", P, E), ("wkv", P, E), ("wgate", P, E), ("state_cache", P, E), ("ape", P, E), ("norm_weight", P, E),
    ("rope_sin", P, E), ("rope_cos", P, E), ("rope_head_dim", P, E), ("cmp_ratio", P, E),
    ("state_block_table", K, None), ("cu_seqlens", K, None), ("seqused", K, None), ("start_pos", K, None),
    ("coff", K, 1), ("norm_eps", K, 1e-6), ("rotary_mode", K, 1), ("cache_mode", K, 1)]
SCHEMAS["dynamic_block_quant"] = [("x", P, E), ("dst_type", P, "int8"), ("tile_size", P, 128)]
SCHEMAS["dequant_block"] = [("y", P, E), ("scale", P, E), ("tile_size", P, 128), ("out_dtype", P, None)]
SCHEMAS["kv_rmsnorm_rope_quant_cache"] = [
    ("kv", P, E), ("gamma", P, E), ("cos", P, E), ("sin", P, E), ("kv_cache", P, E), ("slot_mapping", P, E),
    ("eps", K, 1e-6), ("rope_head_dim", K, 64), ("tile_size", K, 128), ("rotary_mode", K, 2)]
SCHEMAS["kv_quant_sparse_flash_attention"] = [
    ("query", P, E), ("key", P, E), ("value", P, E), ("sparse_indices", P, E), ("scale_value", P, 1.0),
    ("key_quant_mode", K, 2), ("value_quant_mode", K, 2), ("key_dequant_scale", K, None),
    ("value_dequant_scale", K, None), ("block_table", K, None), ("actual_seq_lengths_query", K, None),
    ("actual_seq_lengths_kv", K, None), ("sinks", K, None), ("sparse_block_size", K, 1),
    ("layout_query", K, "BSND"), ("layout_kv", K, "BSND"), ("sparse_mode", K, 3), ("pre_tokens", K, _INT64_MAX),
    ("next_tokens", K, _INT64_MAX), ("attention_mode", K, 2), ("quant_scale_repo_mode", K, 1),
    ("tile_size", K, 128), ("rope_head_dim", K, 64), ("return_softmax_lse", K, False)]
SCHEMAS["sparse_attn_sharedkv"] = [
    ("q", P, E), ("ori_kv", K, None), ("cmp_kv", K, None), ("ori_sparse_indices", K, None),
    ("cmp_sparse_indices", K, None), ("ori_block_table", K, None), ("cmp_block_table", K, None),
    ("cu_seqlens_q", K, None), ("cu_seqlens_ori_kv", K, None), ("cu_seqlens_cmp_kv", K, None),
    ("seqused_q", K, None), ("seqused_kv", K, None), ("sinks", K, None), ("metadata", K, None),
    ("softmax_scale", K, 0.0), ("cmp_ratio", K, 0), ("ori_mask_mode", K, 4), ("cmp_mask_mode", K, 3),
    ("ori_win_left", K, 127), ("ori_win_right", K, 0), ("layout_q", K, "BSND"), ("layout_kv", K, "PA_ND"),
    ("return_softmax_lse", K, False),
    ("cmp_topk_length", K, None)]                 # library extension (20 §2.8), after the CANN arguments
SCHEMAS["sparse_attn_sharedkv_packed"] = SCHEMAS["sparse_attn_sharedkv"] + [("kv_rope_dim", K, 64),
                                                                             ("kv_tile_size", K, 64)]
SCHEMAS["sparse_attn_sharedkv_metadata"] = [
    ("num_heads_q", P, E), ("num_heads_kv", P, E), ("head_dim", P, E), ("cu_seqlens_q", K, None),
    ("cu_seqlens_ori_kv", K, None), ("cu_seqlens_cmp_kv", K, None), ("seqused_q", K, None),
    ("seqused_kv", K, None), ("batch_size", K, 0), ("max_seqlen_q", K, 0), ("max_seqlen_kv", K, 0),
    ("ori_topk", K, 0), ("cmp_topk", K, 0), ("cmp_ratio", K, -1), ("ori_mask_mode", K, 4), ("cmp_mask_mode", K, 3),
    ("ori_win_left", K, 127), ("ori_win_right", K, 0), ("layout_q", K, "BSND"), ("layout_kv", K, "PA_ND"),
    ("has_ori_kv", K, True), ("has_cmp_kv", K, True), ("device", K, None), ("aic_core_num", K, 24),
    ("aiv_core_num", K, 48), ("support_fd", K, False)]
# goldens: sparse_flash_mla on the mapped arguments (**kwargs), the reference planner
UNPINNED_REFERENCE = {"sparse_attn_sharedkv", "sparse_attn_sharedkv_packed", "sparse_attn_sharedkv_metadata"}

FACADE = {
    "npu_lightning_indexer": [
        ("query", P, E), ("key", P, E), ("weights", P, E), ("sparse_count", P, E), ("cu_seq_lens_q", K, None),
        ("cu_seq_lens_k", K, None), ("cmp_residual_k", K, None), ("block_table", K, None), ("layout", K, "BSND"),
        ("sparse_mode", K, 0), ("cmp_ratio", K, 1), ("return_value", K, False)],
    "npu_sparse_flash_mla": [
        ("query", P, E), ("ori_kv", K, None), ("cmp_kv", K, None), ("cmp_sparse_indices", K, None),
        ("cu_seq_lens_q", K, None), ("cu_seq_lens_ori_kv", K, None), ("cu_seq_lens_cmp_kv", K, None),
        ("seqused_q", K, None), ("seqused_ori_kv", K, None), ("seqused_cmp_kv", K, None),
        ("cmp_residual_kv", K, None), ("sinks", K, None), ("softmax_scale", K, 1.0), ("cmp_ratio", K, 1),
        ("ori_mask_mode", K, 4), ("cmp_mask_mode", K, 3), ("ori_win_left", K, 127), ("ori_win_right", K, 0),
        ("layout", K, "BSND"), ("return_softmax_lse", K, False)],
    "npu_sparse_flash_mla_grad": [
        ("query", P, E), ("dout", P, E), ("attn_out", P, E), ("softmax_lse", P, E), ("ori_kv", K, None),
        ("cmp_kv", K, None), ("ori_sparse_indices", K, None), ("cmp_sparse_indices", K, None),
        ("cu_seq_lens_q", K, None), ("cu_seq_lens_ori_kv", K, None), ("cu_seq_lens_cmp_kv", K, None),
        ("seqused_q", K, None), ("seqused_ori_kv", K, None), ("seqused_cmp_kv", K, None),
        ("cmp_residual_kv", K, None), ("ori_topk_length", K, None), ("cmp_topk_length", K, None),
        ("sinks", K, None), ("softmax_scale", K, 1.0), ("cmp_ratio", K, 1), ("ori_mask_mode", K, 4),
        ("cmp_mask_mode", K, 3), ("ori_win_left", K, 127), ("ori_win_right", K, 0), ("layout", K, "BSND")],
    "npu_sparse_lightning_indexer_kl_loss_grad": [
        ("query", P, E), ("key", P, E), ("weights", P, E), ("sparse_indices", P, E),
        ("attn_softmax_l1_norm", P, E), ("cu_seq_lens_q", K, None), ("cu_seq_lens_k", K, None),
        ("seqused_q", K, None), ("seqused_k", K, None), ("cmp_residual_k", K, None), ("layout", K, "BSND"),
        ("mask_mode", K, 3), ("cmp_ratio", K, 1)],
}


def _shape(fn):
    kinds = {inspect.Parameter.POSITIONAL_OR_KEYWORD: P, inspect.Parameter.KEYWORD_ONLY: K}
    return [(p.name, kinds[p.kind], p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_operator_signatures(name):
    assert _shape(getattr(ops, name)) == SCHEMAS[name]
    assert getattr(dsattn, name) is getattr(ops, name)
    if name in UNPINNED_REFERENCE:
        return
    ref = _shape(getattr(reference, name))
    assert ref[: len(SCHEMAS[name])] == SCHEMAS[name]                  # + compute_dtype / emulate_rounding
    assert getattr(dsattn, name) is getattr(ops, name)


@pytest.mark.parametrize("name", sorted(FACADE))
def test_facade_signatures(name):
    assert _shape(getattr(hyper_parallel, name)) == FACADE[name]
    assert getattr(dsattn, name) is getattr(hyper_parallel, name)


@pytest.mark.parametrize("ratio", [1, 4, 128])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_facade_equals_operator(layout, ratio):
    """20 §5.5: façade results bit-identical to the operators called with the mapped arguments."""
    c = cases.mla_case(layout, ratio, torch.float16, seed=ratio)
    kw = dict(c.kwargs)
    fk = {k.replace("cu_seqlens_", "cu_seq_lens_"): v for k, v in kw.items() if k not in ("layout_q", "layout_kv")}
    a = dsattn.npu_sparse_flash_mla(c.q, layout=layout, return_softmax_lse=True, **fk)
    b = ops.sparse_flash_mla(c.q, return_softmax_lse=True, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ga = dsattn.npu_sparse_flash_mla_grad(c.q, c.extra["dout"], *b, layout=layout, **fk)
    gb = ops.sparse_flash_mla_grad(c.q, c.extra["dout"], *b, **kw)
    for x, y in zip(ga, gb):
        assert torch.equal(x, y)
    ic = cases.indexer_case(layout, ratio, torch.float16, seed=ratio)
    ikw = ic.kwargs
    ic.extra["k"] = torch.nan_to_num(ic.extra["k"])            # no seqused_k in the façade: all rows are keys
    fa = dsattn.npu_lightning_indexer(ic.q, ic.extra["k"], ic.extra["w"], 8, cu_seq_lens_q=ikw.get("cu_seqlens_q"),
                                      cu_seq_lens_k=ikw.get("cu_seqlens_k"), cmp_residual_k=ikw["cmp_residual_k"],
                                      layout=layout, sparse_mode=3, cmp_ratio=ratio, return_value=True)
    # the façade has no seqused_k: compare with the operator on the same (unpadded-length) inputs
    ob = ops.lightning_indexer(ic.q, ic.extra["k"], ic.extra["w"], 8, cu_seqlens_q=ikw.get("cu_seqlens_q"),
                               cu_seqlens_k=ikw.get("cu_seqlens_k"), cmp_residual_k=ikw["cmp_residual_k"],
                               layout_q=layout, layout_k=layout, mask_mode=3, cmp_ratio=ratio, return_value=1)
    assert torch.equal(fa[0], ob[0]) and torch.equal(fa[1], ob[1])
    kc = cases.kl_case(layout, ratio, torch.float16, seed=ratio)
    args = (kc.q, kc.extra["k"], kc.extra["w"], kc.extra["sparse_indices"], kc.extra["p"])
    kk = kc.kwargs
    fk = dsattn.npu_sparse_lightning_indexer_kl_loss_grad(
        *args, cu_seq_lens_q=kk.get("cu_seqlens_q"), cu_seq_lens_k=kk.get("cu_seqlens_k"),
        seqused_k=kk.get("seqused_k"), cmp_residual_k=kk["cmp_residual_k"], layout=layout, mask_mode=3,
        cmp_ratio=ratio)
    ok = ops.sparse_lightning_indexer_kl_loss_grad(*args, **kk)
    for x, y in zip(fk, ok):
        assert torch.equal(x, y)


def test_facade_paged_indexer_extension():
    ic = cases.indexer_case("TND", 4, torch.float16, paged=True, seed=3)
    kw = ic.kwargs
    Kc = kw["seqused_k"]
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(Kc, 0).to(torch.int32)])
    a = dsattn.npu_lightning_indexer(ic.q, ic.extra["k"], ic.extra["w"], 8, cu_seq_lens_q=kw["cu_seqlens_q"],
                                     cu_seq_lens_k=cu_k, cmp_residual_k=kw["cmp_residual_k"],
                                     block_table=kw["block_table"], layout="TND", sparse_mode=3, cmp_ratio=4)
    b = ops.lightning_indexer(ic.q, ic.extra["k"], ic.extra["w"], 8, **{**kw, "return_value": 0})
    assert torch.equal(a[0], b[0])
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        dsattn.npu_lightning_indexer(ic.q, ic.extra["k"], ic.extra["w"], 8, block_table=kw["block_table"],
                                     cu_seq_lens_q=kw["cu_seqlens_q"], layout="TND")


def _compiled_matches(fn, *args):
    torch._dynamo.reset()
    eager = fn(*args)
    compiled = torch.compile(fn, fullgraph=True, backend="inductor")(*args)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_torch_compile_fullgraph_each_op():
    c = cases.mla_case("TND", 4, torch.float16, seed=5)
    kw = c.kwargs

    def fwd_bwd(q, dout):
        o, lse = torch.ops.dsattn.sparse_flash_mla(q, return_softmax_lse=True, **kw)
        g = torch.ops.dsattn.sparse_flash_mla_grad(q, dout, o, lse, **kw)
        return (o, lse) + tuple(g)
    _compiled_matches(fwd_bwd, c.q, c.extra["dout"])
    ic = cases.indexer_case("BSND", 4, torch.float16, seed=5)

    def idx(q, k, w, p):
        i, v = torch.ops.dsattn.lightning_indexer(q, k, w, 8, **ic.kwargs)
        kl = torch.ops.dsattn.sparse_lightning_indexer_kl_loss_grad(
            q, k, w, i, p, **{x: y for x, y in ic.kwargs.items() if x != "return_value"})
        return (i, v) + tuple(kl)
    p = torch.rand(ic.q.shape[:2] + (1, 8))
    _compiled_matches(idx, ic.q, ic.extra["k"], ic.extra["w"], p)


def test_export_traces_forward():
    c = cases.mla_case("BSND", 128, torch.float32, seed=2)
    kw = c.kwargs

    class M(torch.nn.Module):
        def forward(self, q):
            return torch.ops.dsattn.sparse_flash_mla(q, return_softmax_lse=True, **kw)
    ep = torch.export.export(M(), (c.q,))
    assert any("dsattn.sparse_flash_mla" in str(n.target) for n in ep.graph.nodes)


def test_torch_compile_fullgraph_quantised_path():
    """The store (a mutating op) then the quantised attention, compiled as one graph."""
    c = cases.qsfa_case("TND", "PA_BSND", torch.bfloat16, seed=5)
    kw = c.kwargs
    key, idx = c.extra["key"], c.extra["sparse_indices"]
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(3, 576, generator=g).bfloat16()
    gamma = torch.rand(512, generator=g) + 0.5
    cos, sin = torch.rand(3, 64, generator=g), torch.rand(3, 64, generator=g)
    slots = torch.tensor([2, -1, 5])

    def step(q, cache):
        packed = torch.ops.dsattn.kv_rmsnorm_rope_quant_cache(kv, gamma, cos, sin, cache, slots)
        y, s = torch.ops.dsattn.dynamic_block_quant(q[..., :512].float().nan_to_num(0.0), "float8_e4m3fn")
        return (packed, y.view(torch.uint8), s) + tuple(
            torch.ops.dsattn.kv_quant_sparse_flash_attention(q, cache, cache, idx, **kw))
    torch._dynamo.reset()
    c1, c2 = key.clone(), key.clone()
    eager = step(c.q, c1)
    compiled = torch.compile(step, fullgraph=True, backend="inductor")(c.q, c2)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8))       # the mutation happened in both


def test_export_traces_compressor_and_qsfa():
    c = cases.qsfa_case("BSND", "BSND", torch.float16, seed=2)
    kw = c.kwargs
    key, idx = c.extra["key"], c.extra["sparse_indices"]

    class M(torch.nn.Module):
        def forward(self, q):
            return torch.ops.dsattn.kv_quant_sparse_flash_attention(q, key, key, idx, **kw)
    ep = torch.export.export(M(), (c.q,))
    assert any("kv_quant_sparse_flash_attention" in str(n.target) for n in ep.graph.nodes)
    cc = cases.compressor_case(D=16, dtype=torch.float32, packed=True, seed=2)
    x, wkv, wgate, state, ape, r = cc.clone_args()

    class C(torch.nn.Module):
        def forward(self, x):
            return torch.ops.dsattn.compressor(x, wkv, wgate, state, ape, r, **cc.kwargs)
    ep = torch.export.export(C(), (x,))
    assert any("compressor" in str(n.target) for n in ep.graph.nodes)


def test_torch_compile_sharedkv_with_plan():
    c = cases.sharedkv_case("TND", 4, torch.float32, seed=3)
    kw = {k: v for k, v in c.kwargs.items()}
    plan = ops.sparse_attn_sharedkv_metadata(4, 1, 32, cu_seqlens_q=kw["cu_seqlens_q"], seqused_kv=kw["seqused_kv"],
                                             layout_q="TND", cmp_ratio=4, cmp_topk=512, aic_core_num=3,
                                             aiv_core_num=8, support_fd=True)

    def step(q, metadata):
        return torch.ops.dsattn.sparse_attn_sharedkv(q, metadata=metadata, **kw)
    _compiled_matches(step, c.q, plan)
