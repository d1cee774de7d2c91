"""Registration of ``dsattn::sparse_flash_mla`` and ``dsattn::sparse_flash_mla_grad``."""
from __future__ import annotations

import torch

from .._registry import register
from ..common.checks import stat_dtype
from . import dispatch
from .problem import check_grad_inputs, lse_shape, parse_mla

SPARSE_FLASH_MLA_SCHEMA = (
    "sparse_flash_mla(Tensor q, *, Tensor? ori_kv=None, Tensor? cmp_kv=None, "
    "Tensor? ori_sparse_indices=None, Tensor? cmp_sparse_indices=None, "
    "Tensor? ori_block_table=None, Tensor? cmp_block_table=None, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, "
    "Tensor? seqused_q=None, Tensor? seqused_ori_kv=None, Tensor? seqused_cmp_kv=None, "
    "Tensor? cmp_residual_kv=None, Tensor? ori_topk_length=None, Tensor? cmp_topk_length=None, "
    "Tensor? sinks=None, Tensor? metadata=None, "
    "float softmax_scale=1.0, int cmp_ratio=1, "
    "int ori_mask_mode=4, int cmp_mask_mode=3, int ori_win_left=127, int ori_win_right=0, "
    'str layout_q="BSND", str layout_kv="BSND", '
    "int topk_value_mode=1, bool return_softmax_lse=False) -> (Tensor, Tensor)")

SPARSE_FLASH_MLA_GRAD_SCHEMA = (
    "sparse_flash_mla_grad(Tensor q, Tensor dout, Tensor attn_out, Tensor softmax_lse, *, "
    "Tensor? ori_kv=None, Tensor? cmp_kv=None, "
    "Tensor? ori_sparse_indices=None, Tensor? cmp_sparse_indices=None, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, "
    "Tensor? seqused_q=None, Tensor? seqused_ori_kv=None, Tensor? seqused_cmp_kv=None, "
    "Tensor? cmp_residual_kv=None, Tensor? ori_topk_length=None, Tensor? cmp_topk_length=None, "
    "Tensor? sinks=None, Tensor? metadata=None, "
    "float softmax_scale=1.0, int cmp_ratio=1, "
    "int ori_mask_mode=4, int cmp_mask_mode=3, int ori_win_left=127, int ori_win_right=0, "
    'str layout_q="BSND", str layout_kv="BSND") '
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _forward_kernel(q, **kw):
    want_lse = kw.pop("return_softmax_lse", False)
    return dispatch.forward(parse_mla(q, **kw), want_lse)


def _forward_fake(q, **kw):
    want_lse = kw.pop("return_softmax_lse", False)
    parse_mla(q, content=False, **kw)
    lse = q.new_empty(lse_shape(q, kw.get("layout_q", "BSND")), dtype=stat_dtype(q)) if want_lse \
        else q.new_zeros((), dtype=stat_dtype(q))
    return torch.empty_like(q), lse


def _grad_parse(q, dout, attn_out, softmax_lse, kw, content):
    check_grad_inputs(q, dout, attn_out, softmax_lse, kw.get("layout_q", "BSND"), kw.get("layout_kv", "BSND"))
    return parse_mla(q, content=content, **kw)


def _grad_kernel(q, dout, attn_out, softmax_lse, **kw):
    return dispatch.backward(_grad_parse(q, dout, attn_out, softmax_lse, kw, None), dout, attn_out, softmax_lse)


def _grad_fake(q, dout, attn_out, softmax_lse, **kw):
    _grad_parse(q, dout, attn_out, softmax_lse, kw, False)
    sdt = stat_dtype(q)
    ori_kv, cmp_kv, sinks = kw.get("ori_kv"), kw.get("cmp_kv"), kw.get("sinks")
    osi, csi = kw.get("ori_sparse_indices"), kw.get("cmp_sparse_indices")
    empty = q.new_empty((0,), dtype=sdt)
    return (torch.empty_like(q), torch.empty_like(ori_kv),
            torch.empty_like(cmp_kv) if cmp_kv is not None else q.new_empty((0,)),
            q.new_empty(sinks.shape, dtype=sdt) if sinks is not None else empty,
            q.new_empty(osi.shape, dtype=sdt) if osi is not None else empty.clone(),
            q.new_empty(csi.shape, dtype=sdt) if csi is not None else empty.clone())


register(SPARSE_FLASH_MLA_SCHEMA, _forward_kernel, _forward_fake)
register(SPARSE_FLASH_MLA_GRAD_SCHEMA, _grad_kernel, _grad_fake)
