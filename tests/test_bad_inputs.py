"""A zoo of bad calls over every public entry point: operators, the hyper-parallel façade, the
serving helpers, the planner, the model layer and the CLI.  Each call breaks exactly one rule
and must raise the documented exception whose message starts with the argument's name (00 §10):
never a crash, a hang, a torch-internal error or silent acceptance.

Each call runs under ``faulthandler.dump_traceback_later``: a call that hangs is killed with a
traceback, and under pytest-xdist (``make test``) a crash or a kill fails that test, not the run.
"""
import faulthandler
import re

import pytest
import torch

import dsattn
from dsattn import cases, hyper_parallel, ops, serving
from dsattn.model import PRESETS, DeepseekV4Attention, PagedBatch

H, D = 4, 16
f16, bf16, i32t = torch.float16, torch.bfloat16, torch.int32


def i32(*v):
    return torch.tensor(v, dtype=i32t)


def rn(*shape, dtype=f16):
    return torch.randn(*shape).to(dtype)


BAD = []          # (id, thunk, exception type, argument name)


def add(group: str, base, over: dict, exc, arg: str, fn=None, name: str | None = None):
    BAD.append((f"{group}:{name or arg}:{len(BAD)}", (fn, base, over), exc, arg))


# ----------------------------------------------------------------------------- sparse_flash_mla
def mla_bsnd():
    return dict(q=rn(2, 6, H, D), ori_kv=rn(2, 9, 1, D), cmp_kv=rn(2, 2, 1, D), cmp_ratio=4,
                cmp_sparse_indices=torch.zeros(2, 6, 1, 3, dtype=i32t), sinks=torch.randn(H))


def mla_tnd():
    return dict(q=rn(9, H, D), ori_kv=rn(12, 1, D), cu_seqlens_q=i32(0, 4, 9), cu_seqlens_ori_kv=i32(0, 5, 12),
                layout_q="TND", layout_kv="TND")


def mla_paged():
    return dict(q=rn(2, 3, H, D), ori_kv=rn(4, 4, 1, D), ori_block_table=i32(0, 1, 2, 3).view(2, 2),
                seqused_ori_kv=i32(6, 7), layout_kv="PA_BBND")


MLA = ops.sparse_flash_mla
for over, exc, arg in [
    (dict(q=torch.ones(2, 6, H, D, dtype=torch.int32)), TypeError, "q"),
    (dict(q=rn(2, 6, H, D, dtype=torch.float64).to(torch.int64)), TypeError, "q"),
    (dict(ori_kv=rn(2, 9, 1, D, dtype=bf16)), TypeError, "ori_kv"),
    (dict(cmp_kv=rn(2, 2, 1, D, dtype=torch.float32)), TypeError, "cmp_kv"),
    (dict(ori_kv=None), ValueError, "ori_kv"),
    (dict(sinks=torch.randn(H).double()), TypeError, "sinks"),
    (dict(sinks=torch.randn(H + 1)), ValueError, "sinks"),
    (dict(sinks=torch.randn(1, H)), ValueError, "sinks"),
    (dict(q=rn(2, 6, D)), ValueError, "q"),
    (dict(q=rn(2, 6, H, 0)), ValueError, "q"),
    (dict(ori_kv=rn(2, 9, 2, D)), ValueError, "ori_kv"),
    (dict(ori_kv=rn(2, 9, 1, D + 2)), ValueError, "ori_kv"),
    (dict(ori_kv=rn(3, 9, 1, D)), ValueError, "ori_kv"),
    (dict(ori_kv=rn(2, 9, D)), ValueError, "ori_kv"),
    (dict(cmp_kv=rn(2, 2, 1, D + 1)), ValueError, "cmp_kv"),
    (dict(cmp_sparse_indices=torch.zeros(2, 5, 1, 3, dtype=i32t)), ValueError, "cmp_sparse_indices"),
    (dict(cmp_sparse_indices=torch.zeros(2, 6, 2, 3, dtype=i32t)), ValueError, "cmp_sparse_indices"),
    (dict(cmp_sparse_indices=torch.zeros(2, 6, 1, 3, dtype=torch.int64)), TypeError, "cmp_sparse_indices"),
    (dict(ori_sparse_indices=torch.zeros(2, 6, 1, 3, dtype=torch.int64)), TypeError, "ori_sparse_indices"),
    (dict(ori_sparse_indices=torch.zeros(2, 6, 3, dtype=i32t)), ValueError, "ori_sparse_indices"),
    (dict(cmp_residual_kv=i32(1, 4)), ValueError, "cmp_residual_kv"),
    (dict(cmp_residual_kv=i32(-1, 0)), ValueError, "cmp_residual_kv"),
    (dict(cmp_residual_kv=i32(1)), ValueError, "cmp_residual_kv"),
    (dict(cmp_residual_kv=torch.tensor([1, 1])), TypeError, "cmp_residual_kv"),
    (dict(cmp_ratio=0), ValueError, "cmp_ratio"),
    (dict(cmp_ratio=129), ValueError, "cmp_ratio"),
    (dict(ori_mask_mode=1), ValueError, "ori_mask_mode"),
    (dict(cmp_mask_mode=4), ValueError, "cmp_mask_mode"),
    (dict(ori_win_left=-2), ValueError, "ori_win_left"),
    (dict(ori_win_right=-5), ValueError, "ori_win_right"),
    (dict(layout_q="BNSD"), ValueError, "layout_q"),
    (dict(layout_kv="TND"), ValueError, "layout_kv"),
    (dict(layout_kv="NHD"), ValueError, "layout_kv"),
    (dict(topk_value_mode=2), NotImplementedError, "topk_value_mode"),
    (dict(topk_value_mode=7), ValueError, "topk_value_mode"),
    (dict(ori_topk_length=i32(1, 1)), NotImplementedError, "ori_topk_length"),
    (dict(seqused_q=i32(7, 1)), ValueError, "seqused_q"),
    (dict(seqused_q=i32(-1, 1)), ValueError, "seqused_q"),
    (dict(seqused_q=i32(1, 1, 1)), ValueError, "seqused_q"),
    (dict(seqused_ori_kv=i32(10, 1)), ValueError, "seqused_ori_kv"),
    (dict(seqused_ori_kv=torch.tensor([1.0, 2.0])), TypeError, "seqused_ori_kv"),
    (dict(seqused_cmp_kv=i32(3, 1)), ValueError, "seqused_cmp_kv"),
    (dict(cu_seqlens_q=i32(0, 6, 12)), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_ori_kv=i32(0, 9, 18)), ValueError, "cu_seqlens_ori_kv"),
    (dict(ori_block_table=i32(0, 1).view(2, 1)), ValueError, "ori_block_table"),
    (dict(cmp_kv=None, cmp_ratio=1), ValueError, "cmp_sparse_indices"),
    (dict(metadata=torch.zeros(1024)), TypeError, "metadata"),
]:
    add("sparse_flash_mla", mla_bsnd, over, exc, arg, MLA)
for over, exc, arg in [
    (dict(cu_seqlens_q=None), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_q=i32(1, 4, 9)), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_q=i32(0, 5, 4)), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_q=i32(0, 4, 10)), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_q=i32(0)), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_q=i32(0, 4, 9).view(1, 3)), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_q=i32(0, 2, 4, 9), seqused_ori_kv=i32(5, 7)), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_ori_kv=None), ValueError, "cu_seqlens_ori_kv"),
    (dict(cu_seqlens_ori_kv=i32(0, 5, 13)), ValueError, "cu_seqlens_ori_kv"),
    (dict(cu_seqlens_ori_kv=i32(0, 6, 5)), ValueError, "cu_seqlens_ori_kv"),
    (dict(cu_seqlens_ori_kv=i32(0, 5, 12), seqused_ori_kv=i32(6, 7)), ValueError, "seqused_ori_kv"),
    (dict(layout_kv="BSND"), ValueError, "layout_kv"),
    (dict(ori_kv=rn(2, 6, 1, D)), ValueError, "ori_kv"),
    (dict(q=rn(9, H, D, dtype=bf16)), TypeError, "ori_kv"),
]:
    add("sparse_flash_mla/TND", mla_tnd, over, exc, arg, MLA)
for over, exc, arg in [
    (dict(ori_block_table=None), ValueError, "ori_block_table"),
    (dict(seqused_ori_kv=None), ValueError, "seqused_ori_kv"),
    (dict(seqused_ori_kv=i32(-1, 7)), ValueError, "seqused_ori_kv"),
    (dict(ori_block_table=i32(0, 1).view(2, 1)), ValueError, "ori_block_table"),
    (dict(ori_block_table=i32(0, 9, 2, 3).view(2, 2)), ValueError, "ori_block_table"),
    (dict(ori_block_table=i32(0, -1, 2, 3).view(2, 2)), ValueError, "ori_block_table"),
    (dict(ori_block_table=torch.zeros(2, 2, dtype=torch.int64)), TypeError, "ori_block_table"),
    (dict(ori_block_table=i32(0, 1, 2, 3)), ValueError, "ori_block_table"),
    (dict(ori_kv=rn(4, 0, 1, D)), ValueError, "ori_kv"),
    (dict(cu_seqlens_ori_kv=i32(0, 6, 7)), ValueError, "cu_seqlens_ori_kv"),
]:
    add("sparse_flash_mla/paged", mla_paged, over, exc, arg, MLA)


def mla_grad():
    kw = mla_bsnd()
    q = kw.pop("q")
    out, lse = ops.sparse_flash_mla(q, return_softmax_lse=True, **kw)
    return dict(q=q, dout=torch.randn_like(q), attn_out=out, softmax_lse=lse, **kw)


for over, exc, arg in [
    (dict(dout=rn(2, 6, H, D, dtype=bf16)), TypeError, "dout"),
    (dict(dout=rn(2, 5, H, D)), ValueError, "dout"),
    (dict(attn_out=rn(2, 6, H, D + 1)), ValueError, "attn_out"),
    (dict(softmax_lse=torch.zeros(())), ValueError, "softmax_lse"),
    (dict(softmax_lse=torch.zeros(2, 1, 6, H, dtype=f16)), TypeError, "softmax_lse"),
    (dict(layout_kv="PA_BBND"), ValueError, "layout_kv"),
]:
    add("sparse_flash_mla_grad", mla_grad, over, exc, arg, ops.sparse_flash_mla_grad)


# ----------------------------------------------------------------------------- facade
def facade_mla():
    return dict(query=rn(2, 6, H, D), ori_kv=rn(2, 9, 1, D))


for over, exc, arg in [
    (dict(layout="PA_BBND"), ValueError, "layout"),
    (dict(ori_kv=rn(2, 9, 1, D, dtype=bf16)), TypeError, "ori_kv"),
    (dict(sinks=torch.randn(H + 2)), ValueError, "sinks"),
    (dict(ori_mask_mode=2), ValueError, "ori_mask_mode"),
]:
    add("npu_sparse_flash_mla", facade_mla, over, exc, arg, hyper_parallel.npu_sparse_flash_mla)


def facade_idx():
    return dict(query=rn(2, 5, H, D), key=rn(2, 7, 1, D), weights=torch.rand(2, 5, H), sparse_count=4)


for over, exc, arg in [
    (dict(layout="BNSD"), ValueError, "layout"),
    (dict(block_table=i32(0, 1).view(2, 1)), ValueError, "cu_seq_lens_k"),
    (dict(weights=torch.rand(2, 5, H).half()), TypeError, "w"),
    (dict(sparse_count=0), ValueError, "topk"),
]:
    add("npu_lightning_indexer", facade_idx, over, exc, arg, hyper_parallel.npu_lightning_indexer)


# ----------------------------------------------------------------------------- lightning_indexer / KL
def idx_bsnd():
    return dict(q=rn(2, 5, H, D), k=rn(2, 7, 1, D), w=torch.rand(2, 5, H), topk=4)


for over, exc, arg in [
    (dict(q=torch.ones(2, 5, H, D, dtype=torch.int8)), TypeError, "q"),
    (dict(k=rn(2, 7, 1, D, dtype=bf16)), TypeError, "k"),
    (dict(w=torch.rand(2, 5, H).half()), TypeError, "w"),
    (dict(w=torch.rand(2, 5, H + 1)), ValueError, "w"),
    (dict(k=rn(2, 7, 1, D + 1)), ValueError, "k"),
    (dict(k=rn(3, 7, 1, D)), ValueError, "k"),
    (dict(k=rn(2, 7, 2, D)), ValueError, "k"),
    (dict(topk=0), ValueError, "topk"),
    (dict(topk=-3), ValueError, "topk"),
    (dict(mask_mode=2), ValueError, "mask_mode"),
    (dict(cmp_ratio=0), ValueError, "cmp_ratio"),
    (dict(cmp_ratio=200), ValueError, "cmp_ratio"),
    (dict(layout_q="SBND"), ValueError, "layout_q"),
    (dict(layout_k="TND"), ValueError, "layout_k"),
    (dict(return_value=2), ValueError, "return_value"),
    (dict(seqused_k=i32(8, 1)), ValueError, "seqused_k"),
    (dict(seqused_k=i32(1)), ValueError, "seqused_k"),
    (dict(seqused_q=i32(6, 1)), ValueError, "seqused_q"),
    (dict(cmp_residual_k=i32(0, 2), cmp_ratio=2), ValueError, "cmp_residual_k"),
    (dict(cu_seqlens_q=i32(0, 5)), ValueError, "cu_seqlens_q"),
    (dict(layout_k="PA_BBND", seqused_k=i32(3, 3)), ValueError, "block_table"),
    (dict(output_idx_offset=torch.zeros(2)), TypeError, "output_idx_offset"),
]:
    add("lightning_indexer", idx_bsnd, over, exc, arg, ops.lightning_indexer)


def kl_args():
    c = cases.kl_case("TND", 4, f16)
    return dict(q=c.q, k=c.extra["k"], w=c.extra["w"], sparse_indices=c.extra["sparse_indices"],
                attn_softmax_l1_norm=c.extra["p"], **c.kwargs)


for over, exc, arg in [
    (dict(sparse_indices=torch.zeros(3, 1, 8, dtype=torch.int64)), TypeError, "sparse_indices"),
    (dict(attn_softmax_l1_norm=torch.zeros(1, 1, 8)), ValueError, "attn_softmax_l1_norm"),
    (dict(attn_softmax_l1_norm=None), TypeError, "attn_softmax_l1_norm"),
    (dict(mask_mode=1), ValueError, "mask_mode"),
    (dict(layout_k="PA_BBND"), ValueError, "layout_k"),
]:
    add("sparse_lightning_indexer_kl_loss_grad", kl_args, over, exc, arg, ops.sparse_lightning_indexer_kl_loss_grad)


# ----------------------------------------------------------------------------- compressor
def comp_args():
    c = cases.compressor_case(D=16, coff=2, r=4, H=8, dtype=f16, packed=True)
    x, wkv, wgate, state, ape, r = c.clone_args()
    return dict(x=x, wkv=wkv, wgate=wgate, state_cache=state, ape=ape, cmp_ratio=r, **c.kwargs)


for over, exc, arg in [
    (dict(x=torch.ones(3, 8, dtype=torch.int32)), TypeError, "x"),
    (dict(wkv=rn(32, 8, dtype=bf16)), TypeError, "wkv"),
    (dict(wkv=rn(31, 8)), ValueError, "wkv"),
    (dict(wgate=rn(32, 9)), ValueError, "wgate"),
    (dict(ape=torch.randn(3, 32)), ValueError, "ape"),
    (dict(ape=torch.randn(4, 32).half()), TypeError, "ape"),
    (dict(state_cache=torch.randn(5, 8, 64).half()), TypeError, "state_cache"),
    (dict(cmp_ratio=0), ValueError, "cmp_ratio"),
    (dict(coff=3), ValueError, "coff"),
    (dict(cache_mode=0), ValueError, "cache_mode"),
    (dict(start_pos=i32(-1, 0, 0)), ValueError, "start_pos"),
    (dict(start_pos=i32(0, 0)), ValueError, "start_pos"),
    (dict(cu_seqlens=None), ValueError, "cu_seqlens"),
    (dict(state_block_table=None), ValueError, "state_block_table"),
    (dict(state_block_table=torch.zeros(3, 2, dtype=torch.int64)), TypeError, "state_block_table"),
]:
    add("compressor", comp_args, over, exc, arg, ops.compressor)


def comp_inf_args():
    c = cases.compressor_case(D=16, coff=2, r=4, H=8, dtype=f16, packed=True)
    args, kw = c.inference_args()
    names = ("x", "wkv", "wgate", "state_cache", "ape", "norm_weight", "rope_sin", "rope_cos", "rope_head_dim",
             "cmp_ratio")
    return dict(zip(names, args), **kw)


for over, exc, arg in [
    (dict(norm_weight=torch.randn(15)), ValueError, "norm_weight"),
    (dict(rope_head_dim=17), ValueError, "rope_head_dim"),
    (dict(rotary_mode=3), ValueError, "rotary_mode"),
    (dict(rope_sin=torch.randn(2, 3)), ValueError, "rope_sin"),
    (dict(norm_eps=-1.0), ValueError, "norm_eps"),
]:
    add("compressor_inference", comp_inf_args, over, exc, arg, ops.compressor_inference)


# ----------------------------------------------------------------------------- quantisation
for over, exc, arg in [
    (dict(x=torch.randn(4, 128).to(torch.int32)), TypeError, "x"),
    (dict(dst_type="int4"), ValueError, "dst_type"),
    (dict(tile_size=0), ValueError, "tile_size"),
    (dict(x=torch.randn(4, 100)), ValueError, "x"),
]:
    add("dynamic_block_quant", lambda: dict(x=torch.randn(4, 128)), over, exc, arg, ops.dynamic_block_quant)


def dq_args():
    y, s = ops.dynamic_block_quant(torch.randn(4, 128))
    return dict(y=y, scale=s)


for over, exc, arg in [
    (dict(scale=torch.ones(4, 2)), ValueError, "scale"),
    (dict(scale=torch.ones(4, 1).half()), TypeError, "scale"),
    (dict(y=torch.zeros(4, 128)), TypeError, "y"),
    (dict(out_dtype=torch.int8), TypeError, "out_dtype"),
]:
    add("dequant_block", dq_args, over, exc, arg, ops.dequant_block)


def qsfa_args():
    c = cases.qsfa_case("BSND", "PA_BSND")
    return dict(query=c.q, key=c.extra["key"], value=c.extra["key"], sparse_indices=c.extra["sparse_indices"],
                **c.kwargs)


for over, exc, arg in [
    (dict(query=torch.randn(3, 5, 4, 576)), TypeError, "query"),
    (dict(key_quant_mode=1), ValueError, "key_quant_mode"),
    (dict(attention_mode=0), ValueError, "attention_mode"),
    (dict(rope_head_dim=32), ValueError, "rope_head_dim"),
    (dict(sparse_block_size=3), ValueError, "sparse_block_size"),
    (dict(sparse_mode=1), ValueError, "sparse_mode"),
    (dict(layout_query="NTD"), ValueError, "layout_query"),
    (dict(block_table=None), ValueError, "block_table"),
    (dict(actual_seq_lengths_kv=i32(10**6, 2, 21)), ValueError, "actual_seq_lengths_kv"),
    (dict(actual_seq_lengths_kv=None), ValueError, "actual_seq_lengths_kv"),
    (dict(sinks=torch.randn(7)), ValueError, "sinks"),
    (dict(key_dequant_scale=torch.ones(1)), ValueError, "key_dequant_scale"),
]:
    add("kv_quant_sparse_flash_attention", qsfa_args, over, exc, arg, ops.kv_quant_sparse_flash_attention)


def kvq_store_args():
    return dict(kv=torch.randn(3, 576).half(), gamma=torch.ones(512).half(), cos=torch.randn(3, 64),
                sin=torch.randn(3, 64), kv_cache=torch.zeros(2, 4, 1, 656, dtype=torch.int8),
                slot_mapping=torch.tensor([0, 5, -1]))


for over, exc, arg in [
    (dict(slot_mapping=torch.tensor([0, 99, -1])), ValueError, "slot_mapping"),
    (dict(slot_mapping=torch.tensor([0, 1])), ValueError, "slot_mapping"),
    (dict(gamma=torch.ones(500).half()), ValueError, "gamma"),
    (dict(kv_cache=torch.zeros(2, 4, 1, 600, dtype=torch.int8)), ValueError, "kv_cache"),
    (dict(rotary_mode=5), ValueError, "rotary_mode"),
]:
    add("kv_rmsnorm_rope_quant_cache", kvq_store_args, over, exc, arg, ops.kv_rmsnorm_rope_quant_cache)


# ----------------------------------------------------------------------------- sharedkv (+ packed) and the planner
def skv_args():
    c = cases.sharedkv_case("TND", 4, f16, topk=8)
    return dict(q=c.q, **c.kwargs)


for over, exc, arg in [
    (dict(return_softmax_lse=True), NotImplementedError, "return_softmax_lse"),
    (dict(layout_kv="BNSD"), ValueError, "layout_kv"),
    (dict(seqused_kv=None), ValueError, "seqused_kv"),
    (dict(ori_block_table=None), ValueError, "ori_block_table"),
    (dict(cmp_ratio=200), ValueError, "cmp_ratio"),
    (dict(metadata=torch.zeros(10, dtype=i32t)), ValueError, "metadata"),
    (dict(metadata=torch.zeros(1024, dtype=i32t) + 7), ValueError, "metadata"),
    (dict(seqused_q=torch.zeros(4)), TypeError, "seqused_q"),
    (dict(cmp_kv=None), ValueError, "cmp_sparse_indices"),
]:
    add("sparse_attn_sharedkv", skv_args, over, exc, arg, ops.sparse_attn_sharedkv)


def packed_args():
    c = cases.packed_sharedkv_case("TND", 4, bf16)
    return dict(q=c.q, **c.kwargs)


def _fp8_cmp():
    kw = packed_args()
    return dict(cmp_kv=kw["cmp_kv"].view(torch.uint8).view(torch.float8_e4m3fn))


for over, exc, arg in [
    (_fp8_cmp(), TypeError, "cmp_kv"),
    (dict(kv_tile_size=7), ValueError, "kv_tile_size"),
    (dict(kv_rope_dim=8), ValueError, "kv_tile_size"),
    (dict(cmp_ratio=0), ValueError, "cmp_ratio"),
]:
    add("sparse_attn_sharedkv_packed", packed_args, over, exc, arg, ops.sparse_attn_sharedkv_packed)
add("sparse_attn_sharedkv_packed", lambda: dict(packed_args(), ori_kv=packed_args()["ori_kv"].view(torch.uint8)),
    {}, TypeError, "ori_kv", ops.sparse_attn_sharedkv_packed, name="uint8")


def meta_args():
    return dict(num_heads_q=64, num_heads_kv=1, head_dim=512, cu_seqlens_q=i32(0, 1, 2), seqused_kv=i32(900, 4000),
                layout_q="TND", cmp_ratio=4, cmp_topk=512)


for over, exc, arg in [
    (dict(aic_core_num=0), ValueError, "aic_core_num"),
    (dict(aic_core_num=37), ValueError, "aic_core_num"),
    (dict(aiv_core_num=80), ValueError, "aiv_core_num"),
    (dict(support_fd=True, aic_core_num=36, aiv_core_num=8), ValueError, "aiv_core_num"),
    (dict(cmp_topk=300), ValueError, "cmp_topk"),
    (dict(cmp_ratio=3), ValueError, "cmp_ratio"),
    (dict(num_heads_kv=2), ValueError, "num_heads_kv"),
    (dict(layout_q="BNSD"), ValueError, "layout_q"),
    (dict(seqused_kv=i32(-1, 4)), ValueError, "seqused_kv"),
    (dict(cu_seqlens_q=torch.tensor([0, 1, 2])), TypeError, "cu_seqlens_q"),
]:
    add("sparse_attn_sharedkv_metadata", meta_args, over, exc, arg, ops.sparse_attn_sharedkv_metadata)


def host_meta_args():
    return dict(num_heads_q=64, num_heads_kv=1, head_dim=512, layout_q="TND", layout_kv="PA_ND",
                cu_seqlens_q=i32(0, 1, 2), seqused_kv=i32(900, 4000), cmp_ratio=4, cmp_topk=512)


for over, exc, arg in [
    (dict(layout_q="BSND"), ValueError, "layout_q"),
    (dict(batch_size=5), ValueError, "batch_size"),
    (dict(out=torch.zeros(1024)), ValueError, "out"),
    (dict(seqused_kv=torch.tensor([900, 4000])), TypeError, "seqused_kv"),
]:
    add("sparse_attn_sharedkv_metadata_host", host_meta_args, over, exc, arg,
        serving.sparse_attn_sharedkv_metadata_host)


# ----------------------------------------------------------------------------- serving helpers
def last_loc_args():
    return dict(req_to_token=torch.arange(40, dtype=i32t).view(4, 10), req_pool_indices=torch.tensor([0, 3]),
                prefix_lens=torch.tensor([5, 0]))


for over, exc, arg in [
    (dict(req_pool_indices=torch.tensor([-1, 3])), ValueError, "req_pool_indices"),
    (dict(req_pool_indices=torch.tensor([0, 4])), ValueError, "req_pool_indices"),
    (dict(prefix_lens=torch.tensor([-2, 0])), ValueError, "prefix_lens"),
    (dict(prefix_lens=torch.tensor([11, 0])), ValueError, "prefix_lens"),
    (dict(prefix_lens=torch.tensor([1, 0, 0])), ValueError, "prefix_lens"),
    (dict(req_to_token=torch.zeros(4, 10)), TypeError, "req_to_token"),
    (dict(req_pool_indices=torch.tensor([0.0, 1.0])), TypeError, "req_pool_indices"),
]:
    add("get_last_loc", last_loc_args, over, exc, arg, serving.get_last_loc)

for over, exc, arg in [
    (dict(seq_lens_cpu=torch.tensor([2**31 - 5, 10])), ValueError, "seq_lens_cpu"),
    (dict(seq_lens_cpu=torch.tensor([3, -1])), ValueError, "seq_lens_cpu"),
    (dict(seq_lens_cpu=torch.tensor([3.0])), TypeError, "seq_lens_cpu"),
    (dict(mode="chunked"), ValueError, "mode"),
    (dict(mode="decode", seq_lens_cpu=None), ValueError, "batch_size"),
    (dict(mode="decode", seq_lens_cpu=None, batch_size=-1), ValueError, "batch_size"),
    (dict(mode="decode", seq_lens_cpu=None, batch_size=2.5), TypeError, "batch_size"),
    (dict(mode="verify", seq_lens_cpu=None, batch_size=2, tokens_per_req=0), ValueError, "tokens_per_req"),
    (dict(mode="verify", seq_lens_cpu=None, batch_size=2**20, tokens_per_req=2**12), ValueError, "batch_size"),
    (dict(new_tokens_cpu=torch.tensor([1])), ValueError, "new_tokens_cpu"),
]:
    add("build_cu_seqlens_q_cpu", lambda: dict(mode="prefill", seq_lens_cpu=torch.tensor([3, 4])), over, exc, arg,
        serving.build_cu_seqlens_q_cpu)

for over, exc, arg in [
    (dict(batch_size=-1), ValueError, "batch_size"),
    (dict(batch_size=3), ValueError, "final_seq_lens_cpu"),
    (dict(final_seq_lens_cpu=torch.tensor([5, -3])), ValueError, "final_seq_lens_cpu"),
    (dict(final_seq_lens_cpu=torch.tensor([5, 2**32])), ValueError, "final_seq_lens_cpu"),
    (dict(clamp_min=-1), ValueError, "clamp_min"),
]:
    add("build_seqused_kv_cpu", lambda: dict(final_seq_lens_cpu=torch.tensor([5, 9]), batch_size=2), over, exc, arg,
        serving.build_seqused_kv_cpu)


def cmeta_args():
    return dict(rope_cos=torch.randn(64, 8), rope_sin=torch.randn(64, 8), cu_seqlens=i32(0, 8, 12),
                start_pos=i32(0, 4), kv_block_table=i32(1, 2, 3, 4).view(2, 2), kv_block_size=4, compress_ratio=4,
                num_rows=4)


for over, exc, arg in [
    (dict(cu_seqlens=i32(0, 8, 6)), ValueError, "cu_seqlens"),
    (dict(cu_seqlens=i32(1, 8, 12)), ValueError, "cu_seqlens"),
    (dict(start_pos=i32(0, 70)), ValueError, "start_pos"),
    (dict(start_pos=i32(0, -4)), ValueError, "start_pos"),
    (dict(start_pos=i32(0, 4, 0)), ValueError, "start_pos"),
    (dict(kv_block_table=i32(1, 2, -1, 4).view(2, 2)), ValueError, "kv_block_table"),
    (dict(kv_block_table=i32(1, 2)), ValueError, "kv_block_table"),
    (dict(num_rows=2), ValueError, "num_rows"),
    (dict(num_rows=-1), ValueError, "num_rows"),
    (dict(compress_ratio=0), ValueError, "compress_ratio"),
    (dict(kv_block_size=0), ValueError, "kv_block_size"),
    (dict(rope_cos=torch.randn(64, 8).double()), TypeError, "rope_cos"),
    (dict(rope_sin=torch.randn(32, 8)), ValueError, "rope_sin"),
    (dict(seqused=i32(9, 4)), ValueError, "seqused"),
    (dict(slot_mapping_format="pairs"), ValueError, "slot_mapping_format"),
    (dict(cu_seqlens=torch.tensor([0, 8, 12])), TypeError, "cu_seqlens"),
]:
    add("compressor_metadata", cmeta_args, over, exc, arg, serving.compressor_metadata)


def store_args():
    return dict(cache=torch.zeros(2, 4, 3), rows=torch.randn(2, 3), slot_mapping=torch.tensor([1, -1]))


for over, exc, arg in [
    (dict(slot_mapping=torch.tensor([1, 8])), ValueError, "slot_mapping"),
    (dict(slot_mapping=torch.tensor([-2, 0])), ValueError, "slot_mapping"),
    (dict(slot_mapping=torch.tensor([1.0, 0.0])), TypeError, "slot_mapping"),
    (dict(rows=torch.randn(2, 4)), ValueError, "rows"),
    (dict(rows=torch.randn(2, 3).half()), TypeError, "rows"),
    (dict(cache=torch.zeros(8)), ValueError, "cache"),
]:
    add("store_rows", store_args, over, exc, arg, serving.store_rows)


def merge_args():
    return dict(outs=[torch.randn(3, 2, 4), torch.randn(3, 2, 4)], lses=[torch.randn(3, 2), torch.randn(3, 2)])


for over, exc, arg in [
    (dict(outs=[torch.randn(3, 2, 4), torch.randn(3, 2, 5)]), ValueError, "outs"),
    (dict(outs=[torch.randn(3, 2, 4), torch.randn(3, 2, 4).half()]), TypeError, "outs"),
    (dict(outs=[]), ValueError, "outs"),
    (dict(lses=[torch.randn(3, 2), torch.randn(3, 3)]), ValueError, "lses"),
    (dict(lses=[torch.randn(3, 2), torch.randn(3, 2).double()]), TypeError, "lses"),
    (dict(sinks=torch.randn(5)), ValueError, "sinks"),
    (dict(sinks=torch.ones(2, dtype=torch.int64)), TypeError, "sinks"),
    (dict(valid=[torch.ones(3, 2, dtype=torch.bool)]), ValueError, "valid"),
    (dict(valid=[torch.ones(3, 2, dtype=torch.bool), torch.ones(2, dtype=torch.bool)]), ValueError, "valid"),
]:
    add("merge_attention_states", merge_args, over, exc, arg, serving.merge_attention_states)


# ----------------------------------------------------------------------------- model layer
CFG = PRESETS["small"]


def _layer_ctor(**over):
    kw = dict(cfg=CFG, ratio=4)
    kw.update(over)
    return kw


for over, exc, arg in [
    (dict(ratio=8), ValueError, "ratio"),
    (dict(dtype=torch.int64), TypeError, "dtype"),
    (dict(kv_cache_dtype=torch.int16), TypeError, "kv_cache_dtype"),
    (dict(max_positions=0), ValueError, "max_positions"),
]:
    add("DeepseekV4Attention", _layer_ctor, over, exc, arg, DeepseekV4Attention)


def _layer_step():
    layer = DeepseekV4Attention(CFG, 4)
    batch = PagedBatch(CFG, 64, 16)
    step = batch.step(["a", "b"], [5, 3], CFG.heads)
    return dict(layer=layer, x=torch.randn(8, CFG.hidden), step=step, caches=layer.new_caches(64))


def _forward(layer, x, step, caches):
    return layer.forward(x, step, caches)


for over, exc, arg in [
    (dict(x=torch.randn(8, CFG.hidden + 1)), ValueError, "x"),
    (dict(x=torch.randn(7, CFG.hidden)), ValueError, "x"),
    (dict(x=torch.randn(8, CFG.hidden).half()), TypeError, "x"),
    (dict(x=torch.randn(1, 8, CFG.hidden)), ValueError, "x"),
    (dict(x=[[0.0] * CFG.hidden] * 8), TypeError, "x"),
    (dict(step=None), TypeError, "step"),
]:
    add("DeepseekV4Attention.forward", _layer_step, over, exc, arg, _forward)


def _load(layer, state_dict):
    layer.load_state_dict(state_dict)


def _load_args():
    layer = DeepseekV4Attention(CFG, 4)
    return dict(layer=layer, state_dict=layer.state_dict())


def _drop_one():
    a = _load_args()
    a["state_dict"].pop(next(iter(a["state_dict"])))
    return a


def _reshape_one():
    a = _load_args()
    k = next(iter(a["state_dict"]))
    a["state_dict"][k] = torch.zeros(3, 3)
    return a


add("DeepseekV4Attention.load_state_dict", _drop_one, {}, ValueError, "state_dict", _load, name="missing")
add("DeepseekV4Attention.load_state_dict", _reshape_one, {}, ValueError, "state_dict", _load, name="shape")
add("DeepseekV4Attention.load_state_dict", lambda: dict(_load_args(), state_dict={**_load_args()["state_dict"],
                                                                                   "bogus": torch.zeros(1)}),
    {}, ValueError, "state_dict", _load, name="unexpected")

for over, exc, arg in [
    (dict(num_pages=-5), ValueError, "num_pages"),
    (dict(num_pages=1), ValueError, "num_pages"),
    (dict(max_pages_per_req=0), ValueError, "max_pages_per_req"),
    (dict(num_pages=3.5), TypeError, "num_pages"),
]:
    add("PagedBatch", lambda: dict(cfg=CFG, num_pages=16, max_pages_per_req=4), over, exc, arg, PagedBatch)


def _step(batch, requests, new_tokens, heads, pad_to=None):
    return batch.step(requests, new_tokens, heads, pad_to=pad_to)


for over, exc, arg in [
    (dict(new_tokens=[3]), ValueError, "new_tokens"),
    (dict(new_tokens=[3, -1]), ValueError, "new_tokens"),
    (dict(requests=["a", "a"]), ValueError, "requests"),
    (dict(pad_to=1), ValueError, "pad_to"),
]:
    add("PagedBatch.step", lambda: dict(batch=PagedBatch(CFG, 64, 16), requests=["a", "b"], new_tokens=[3, 2],
                                        heads=CFG.heads), over, exc, arg, _step)

for over, exc, arg in [
    (dict(enabled="yes"), TypeError, "enabled"),
]:
    add("set_content_checks", lambda: dict(enabled=True), over, exc, arg, dsattn.set_content_checks)


# ----------------------------------------------------------------------------- run
@pytest.mark.parametrize("case_id,call,exc,arg", BAD, ids=[b[0] for b in BAD])
def test_bad_call(case_id, call, exc, arg):
    fn, base, over = call
    kw = dict(base())
    kw.update(over)
    faulthandler.dump_traceback_later(60, exit=True)          # a hang kills this worker with a traceback
    try:
        with pytest.raises(exc) as info:
            fn(**kw)
    finally:
        faulthandler.cancel_dump_traceback_later()
    msg = str(info.value)
    assert re.match(rf"^{re.escape(arg)}:", msg), f"message does not start with {arg!r}: {msg!r}"


# ----------------------------------------------------------------------------- the CLI
CLI = [
    (["plan", "--lengths", ""], "--lengths"),
    (["plan", "--lengths", "abc"], "--lengths"),
    (["plan", "--lengths", "4:x"], "--lengths"),
    (["plan", "--lengths", "1:-3"], "--lengths"),
    (["plan", "--lengths", "1:99999999999"], "--lengths"),
    (["bench", "--emulate-avx2", "--emulate-avx512bf16"], "--emulate-avx2"),
    (["plan", "--cores", "0"], "--cores"),
    (["plan", "--cores", "99"], "--cores"),
    (["plan", "--aiv", "100"], "--aiv"),
    (["plan", "--fd", "--cores", "36", "--aiv", "8"], "--aiv"),
    (["plan", "--heads", "x"], "--heads"),
    (["plan", "--heads", "0"], "--heads"),
    (["plan", "--topk", "300"], "--topk"),
    (["plan", "--scenario", "dense"], "--scenario"),
    (["plan", "--preset", "huge"], "--preset"),
    (["plan", "--window", "-7"], "--window"),
    (["plan", "--plot", "/nonexistent-dir/x.png", "--lengths", "1:100"], "--plot"),
    (["demo", "--requests", "0"], "--requests"),
    (["demo", "--decode-steps", "-1"], "--decode-steps"),
    (["demo", "--budget", "abc"], "--budget"),
    (["demo", "--dtype", "fp64"], "--dtype"),
    (["demo", "--kv-cache", "int4"], "--kv-cache"),
    (["demo", "--preset", "v5"], "--preset"),
    (["demo", "--tokens", "0", "--ops"], "--tokens"),
    (["verify", "--impl", "cuda"], "--impl"),
    (["verify", "--fuzz", "0"], "--fuzz"),
    (["verify", "--batch-invariance", "0"], "--batch-invariance"),
    (["verify", "--fuzz", "1", "--batch-invariance", "1"], "--batch-invariance"),
    (["verify", "--fuzz", "3", "--family", "attention"], "--family"),
    (["verify", "--seed", "3"], "--seed"),
    (["bench", "--family", "gpu2"], "--family"),
    (["frobnicate"], "command"),
]


@pytest.mark.parametrize("argv,flag", CLI, ids=[" ".join(a) for a, _ in CLI])
def test_cli_bad_argument_is_one_line(argv, flag, capsys):
    from dsattn.cli import main
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith(f"dsattn {argv[0]}: error: " if argv[0] != "frobnicate"
                                                else "dsattn: error: "), err
    assert flag in err[0] and "Traceback" not in err[0]


def test_the_zoo_is_large():
    assert len(BAD) + len(CLI) >= 150


def test_backend_variable_is_validated(monkeypatch):
    from dsattn import backend
    monkeypatch.setenv("DSATTN_BACKEND", "cuda")
    with pytest.raises(ValueError, match="^DSATTN_BACKEND: value 'cuda'"):
        ops.sparse_flash_mla(torch.randn(1, 2, 2, 16), ori_kv=torch.randn(1, 3, 1, 16))
    monkeypatch.setenv("DSATTN_BACKEND", "torch")
    assert not backend.use_triton(torch.device("cpu"))
