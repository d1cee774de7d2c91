"""Registration of ``dsattn::lightning_indexer`` and ``dsattn::sparse_lightning_indexer_kl_loss_grad``."""
from __future__ import annotations

import torch

from .._registry import register
from . import dispatch, fast
from .problem import (K_LAYOUTS, LIGHTNING_DEFAULTS, check_index_pair, check_lightning_attrs, check_offset,
                      check_offset_results, parse_indexer)

LIGHTNING_INDEXER_SCHEMA = (
    "lightning_indexer(Tensor q, Tensor k, Tensor w, int topk, *, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
    "Tensor? seqused_q=None, Tensor? seqused_k=None, "
    "Tensor? cmp_residual_k=None, Tensor? block_table=None, "
    "Tensor? output_idx_offset=None, Tensor? metadata=None, "
    'int max_seqlen_q=-1, str layout_q="BSND", str layout_k="BSND", '
    "int mask_mode=0, int cmp_ratio=1, int return_value=0) -> (Tensor, Tensor)")

KL_LOSS_GRAD_SCHEMA = (
    "sparse_lightning_indexer_kl_loss_grad(Tensor q, Tensor k, Tensor w, "
    "Tensor sparse_indices, Tensor attn_softmax_l1_norm, *, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
    "Tensor? seqused_q=None, Tensor? seqused_k=None, "
    "Tensor? cmp_residual_k=None, Tensor? metadata=None, "
    'str layout_q="TND", str layout_k="TND", int mask_mode=3, int cmp_ratio=1) '
    "-> (Tensor, Tensor, Tensor, Tensor)")

def _indexer_parse(q, k, w, topk, kw, content):
    check_lightning_attrs(topk, kw.pop("max_seqlen_q", -1), kw.get("return_value", 0))
    return_value = kw.pop("return_value", 0)
    offset = kw.pop("output_idx_offset", None)
    P = parse_indexer(q, k, w, k_layouts=K_LAYOUTS, content=content, **{**LIGHTNING_DEFAULTS, **kw})
    return P, check_offset(offset, P, kw.get("layout_q", "BSND")), return_value


def run_indexer(P, like, topk: int, offset, return_value: int, select):
    """The op's outputs from ``select(P, topk, offset)`` (a dispatch function): the table coverage checked
    first (every key a row scores must be mapped, on every path), offsets checked after, rows unflattened
    to ``like``'s layout."""
    if P.content:
        n = P.valid_counts().to(torch.int64)
        needed = torch.zeros(P.rows.B, dtype=torch.int64, device=n.device).scatter_reduce(
            0, P.rows.batch.to(torch.int64), n, "amax")
        P.k.check_table_covers(needed, "seqused_k")
    idx, val = select(P, topk, offset)
    check_offset_results(idx, offset, P.content)
    out_idx = P.rows.unflat(idx, like).unsqueeze(-2)
    if not return_value:
        return out_idx, torch.zeros(0, dtype=torch.float32, device=like.device)
    return out_idx, P.rows.unflat(val, like).unsqueeze(-2)


def _indexer_kernel(q, k, w, topk, **kw):
    P, offset, return_value = _indexer_parse(q, k, w, topk, kw, None)
    return run_indexer(P, q, topk, offset, return_value, dispatch.lightning_indexer)


def _indexer_fake(q, k, w, topk, **kw):
    _, _, return_value = _indexer_parse(q, k, w, topk, kw, False)
    shape = tuple(q.shape[:-2]) + (1, topk)
    return (q.new_empty(shape, dtype=torch.int32),
            q.new_empty(shape if return_value else (0,), dtype=torch.float32))


def _kl_parse(q, k, w, sparse_indices, attn_softmax_l1_norm, kw, content):
    args = dict(cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, cmp_residual_k=None,
                metadata=None, layout_q="TND", layout_k="TND", mask_mode=3, cmp_ratio=1)
    args.update(kw)
    P = parse_indexer(q, k, w, block_table=None, k_layouts=("BSND", "TND"), content=content, **args)
    check_index_pair(q, args["layout_q"], sparse_indices, attn_softmax_l1_norm)
    return P


def _kl_kernel(q, k, w, sparse_indices, attn_softmax_l1_norm, **kw):
    P = _kl_parse(q, k, w, sparse_indices, attn_softmax_l1_norm, kw, None)
    dq, dk, dw, soft = fast.kl_loss_grad(P, sparse_indices, attn_softmax_l1_norm)
    return P.rows.unflat(dq, q), dk, P.rows.unflat(dw, q), P.rows.unflat(soft, q).unsqueeze(-2)


def _kl_fake(q, k, w, sparse_indices, attn_softmax_l1_norm, **kw):
    _kl_parse(q, k, w, sparse_indices, attn_softmax_l1_norm, kw, False)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(w),
            sparse_indices.new_empty(sparse_indices.shape, dtype=torch.float32))


register(LIGHTNING_INDEXER_SCHEMA, _indexer_kernel, _indexer_fake)
register(KL_LOSS_GRAD_SCHEMA, _kl_kernel, _kl_fake)
