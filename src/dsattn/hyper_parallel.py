"""The hyper-parallel ``npu_*`` interface (seed 001; 20-sparse-flash-mla §5).

Code written against that interface switches to dsattn by changing an import::

    from dsattn.hyper_parallel import npu_sparse_flash_mla   # or: from dsattn import ...

Each function maps its arguments onto the operator schema: ``layout`` goes to both layout
arguments, ``cu_seq_lens_*`` to ``cu_seqlens_*``, and the internals the interface does not
expose are fixed (``metadata=None``, ``max_seqlen_q=-1``, ``topk_value_mode=1``, ...).
"""
from __future__ import annotations

import contextlib

import torch

from . import ops
from .common.checks import check_choice, fail

_LAYOUTS = ("BSND", "TND")


def _layout(layout: str) -> str:
    check_choice("layout", layout, _LAYOUTS)
    return layout


def npu_lightning_indexer(query, key, weights, sparse_count, *, cu_seq_lens_q=None, cu_seq_lens_k=None,
                          cmp_residual_k=None, block_table=None, layout='BSND', sparse_mode=0, cmp_ratio=1,
                          return_value=False):
    """Top-k key indices per query token -> ``(sparse_indices, sparse_values)``.  No autograd.

    With ``block_table`` (a library extension) the keys are paged (``layout_k="PA_BBND"``) and
    their lengths come from ``cu_seq_lens_k`` (then required)."""
    layout = _layout(layout)
    layout_k, cu_k, seqused_k = layout, cu_seq_lens_k, None
    if block_table is not None:
        if cu_seq_lens_k is None:
            fail("cu_seq_lens_k", "is required with block_table (it gives the paged key lengths)")
        layout_k, cu_k, seqused_k = "PA_BBND", None, (cu_seq_lens_k[1:] - cu_seq_lens_k[:-1]).to(torch.int32)
    return ops.lightning_indexer(query, key, weights, sparse_count, cu_seqlens_q=cu_seq_lens_q,
                                 cu_seqlens_k=cu_k, seqused_q=None, seqused_k=seqused_k,
                                 cmp_residual_k=cmp_residual_k, block_table=block_table, output_idx_offset=None,
                                 metadata=None, max_seqlen_q=-1, layout_q=layout, layout_k=layout_k,
                                 mask_mode=sparse_mode, cmp_ratio=cmp_ratio, return_value=int(bool(return_value)))


_NO_WINDOW = 9223372036854775807         # pre_tokens / next_tokens: no sliding window (the only value supported)


def npu_quant_lightning_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode=0,
                                key_quant_mode=0, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                                block_table=None, metadata=None, layout_query="BSND", layout_key="BSND",
                                sparse_count=2048, sparse_mode=3, pre_tokens=_NO_WINDOW, next_tokens=_NO_WINDOW,
                                cmp_ratio=1, return_value=False):
    """The Ascend ``npu_quant_lightning_indexer`` call (vllm-ascend / SGLang) on
    ``quant_lightning_indexer`` -> ``(sparse_indices, sparse_values)``.

    ``actual_seq_lengths_query`` / ``_key`` are per-batch lengths, or cumulative ends for a TND side (the
    Ascend convention: no leading 0); ``layout_key="PA_BSND"`` is the paged pool (``block_table``)."""
    check_choice("layout_query", layout_query, _LAYOUTS)
    check_choice("layout_key", layout_key, ("BSND", "TND", "PA_BSND"))
    if query_quant_mode != key_quant_mode:
        fail("key_quant_mode", f"value {key_quant_mode} differs from query_quant_mode={query_quant_mode}; both take "
             "the per-token(-head) mode 0")
    for name, v in (("pre_tokens", pre_tokens), ("next_tokens", next_tokens)):
        if v != _NO_WINDOW:
            fail(name, f"value {v} is not supported; only the default {_NO_WINDOW} (no window)")
    layout_k = "PA_BBND" if layout_key == "PA_BSND" else layout_key

    def ends(name, t):                                  # cumulative ends -> cu_seqlens with a leading 0
        if t is None:
            fail(name, "is required for a TND layout (cumulative token counts per batch)")
        return torch.cat([t.new_zeros(1), t]).to(torch.int32)

    cu_q = ends("actual_seq_lengths_query", actual_seq_lengths_query) if layout_query == "TND" else None
    used_q = actual_seq_lengths_query if layout_query == "BSND" else None
    cu_k = ends("actual_seq_lengths_key", actual_seq_lengths_key) if layout_k == "TND" else None
    used_k = actual_seq_lengths_key if layout_k != "TND" else None
    return ops.quant_lightning_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, sparse_count,
                                       query_quant_mode, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q,
                                       seqused_k=used_k, block_table=block_table, metadata=metadata,
                                       layout_q=layout_query, layout_k=layout_k, mask_mode=sparse_mode,
                                       cmp_ratio=cmp_ratio, return_value=int(bool(return_value)))


_LENGTHS = ("cu_seq_lens_q", "cu_seq_lens_ori_kv", "cu_seq_lens_cmp_kv", "seqused_q", "seqused_ori_kv",
            "seqused_cmp_kv", "cmp_residual_kv")
_ATTRS = ("softmax_scale", "cmp_ratio", "ori_mask_mode", "cmp_mask_mode", "ori_win_left", "ori_win_right")


def _length_kwargs(lengths: dict) -> dict:
    """Façade length names -> operator names (``cu_seq_lens_*`` -> ``cu_seqlens_*``)."""
    return {k.replace("cu_seq_lens_", "cu_seqlens_"): v for k, v in lengths.items()}


class SparseFlashMlaFunction(torch.autograd.Function):
    """Autograd of ``npu_sparse_flash_mla``: forward always asks for the LSE; backward calls
    ``sparse_flash_mla_grad`` with the forward's tensors and lengths (including ``seqused_*``,
    a deliberate difference from seed 001 that keeps gradients right for short lengths)."""

    @staticmethod
    def forward(ctx, query, ori_kv, cmp_kv, sinks, cmp_sparse_indices, lengths, attrs, layout,
                return_softmax_lse):
        attn_out, lse = ops.sparse_flash_mla(query, ori_kv=ori_kv, cmp_kv=cmp_kv, ori_sparse_indices=None,
                                             cmp_sparse_indices=cmp_sparse_indices, ori_block_table=None,
                                             cmp_block_table=None, **_length_kwargs(lengths),
                                             ori_topk_length=None, cmp_topk_length=None, sinks=sinks,
                                             metadata=None, **attrs, layout_q=layout, layout_kv=layout,
                                             topk_value_mode=1, return_softmax_lse=True)
        names = list(lengths)
        ctx.length_names = names
        ctx.attrs, ctx.layout = attrs, layout
        ctx.has_cmp, ctx.has_sinks = cmp_kv is not None, sinks is not None
        ctx.save_for_backward(query, ori_kv, cmp_kv, cmp_sparse_indices, sinks, attn_out, lse,
                              *[lengths[n] for n in names])
        second = lse if return_softmax_lse else torch.zeros((), dtype=lse.dtype, device=lse.device)
        ctx.mark_non_differentiable(second)
        return attn_out, second

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_attn_out, d_lse):
        if d_attn_out is None:
            return (None,) * 9
        query, ori_kv, cmp_kv, cmp_idx, sinks, attn_out, lse, *lens = ctx.saved_tensors
        lengths = dict(zip(ctx.length_names, lens))
        dq, dori, dcmp, dsinks, _, _ = ops.sparse_flash_mla_grad(
            query, d_attn_out.to(query.dtype), attn_out, lse, ori_kv=ori_kv, cmp_kv=cmp_kv,
            ori_sparse_indices=None, cmp_sparse_indices=cmp_idx, **_length_kwargs(lengths),
            ori_topk_length=None, cmp_topk_length=None, sinks=sinks, metadata=None, **ctx.attrs,
            layout_q=ctx.layout, layout_kv=ctx.layout)
        return (dq, dori, dcmp if ctx.has_cmp else None, dsinks if ctx.has_sinks else None,
                None, None, None, None, None)


# The operators' argument names -> this module's (CANN's torch_npu spelling), for error messages.
_CANN_NAMES = {"q": "query", "cu_seqlens_q": "cu_seq_lens_q", "cu_seqlens_ori_kv": "cu_seq_lens_ori_kv",
               "cu_seqlens_cmp_kv": "cu_seq_lens_cmp_kv", "layout_q": "layout", "layout_kv": "layout"}


@contextlib.contextmanager
def _cann_names():
    """Re-raise an operator's argument error under the name the caller used."""
    try:
        yield
    except (ValueError, TypeError, NotImplementedError) as e:
        name, sep, why = str(e).partition(": ")
        if sep and name in _CANN_NAMES and type(e) in (ValueError, TypeError, NotImplementedError):
            raise type(e)(f"{_CANN_NAMES[name]}: {why}") from None
        raise


def npu_sparse_flash_mla(query, *, ori_kv=None, cmp_kv=None, cmp_sparse_indices=None,
                         cu_seq_lens_q=None, cu_seq_lens_ori_kv=None, cu_seq_lens_cmp_kv=None,
                         seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None,
                         cmp_residual_kv=None, sinks=None,
                         softmax_scale=1.0, cmp_ratio=1, ori_mask_mode=4, cmp_mask_mode=3,
                         ori_win_left=127, ori_win_right=0, layout='BSND',
                         return_softmax_lse=False):
    """Two-branch sparse attention -> ``(attn_out, softmax_lse or 0-dim zero)``; differentiable
    in ``query``, ``ori_kv``, ``cmp_kv`` and ``sinks``."""
    layout = _layout(layout)
    lengths = dict(cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_ori_kv=cu_seq_lens_ori_kv,
                   cu_seq_lens_cmp_kv=cu_seq_lens_cmp_kv, seqused_q=seqused_q, seqused_ori_kv=seqused_ori_kv,
                   seqused_cmp_kv=seqused_cmp_kv, cmp_residual_kv=cmp_residual_kv)
    attrs = dict(softmax_scale=softmax_scale, cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode,
                 cmp_mask_mode=cmp_mask_mode, ori_win_left=ori_win_left, ori_win_right=ori_win_right)
    with _cann_names():
        return SparseFlashMlaFunction.apply(query, ori_kv, cmp_kv, sinks, cmp_sparse_indices, lengths, attrs,
                                            layout, return_softmax_lse)


def npu_sparse_flash_mla_grad(query, dout, attn_out, softmax_lse, *, ori_kv=None, cmp_kv=None,
                              ori_sparse_indices=None, cmp_sparse_indices=None,
                              cu_seq_lens_q=None, cu_seq_lens_ori_kv=None, cu_seq_lens_cmp_kv=None,
                              seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None, cmp_residual_kv=None,
                              ori_topk_length=None, cmp_topk_length=None, sinks=None,
                              softmax_scale=1.0, cmp_ratio=1, ori_mask_mode=4, cmp_mask_mode=3,
                              ori_win_left=127, ori_win_right=0, layout='BSND'):
    """Backward of the two-branch attention -> ``(d_query, d_ori_kv, d_cmp_kv, d_sinks,
    ori_softmax_l1_norm, cmp_softmax_l1_norm)``."""
    layout = _layout(layout)
    with _cann_names():
        return _grad(query, dout, attn_out, softmax_lse, ori_kv, cmp_kv, ori_sparse_indices, cmp_sparse_indices,
                     cu_seq_lens_q, cu_seq_lens_ori_kv, cu_seq_lens_cmp_kv, seqused_q, seqused_ori_kv, seqused_cmp_kv,
                     cmp_residual_kv, ori_topk_length, cmp_topk_length, sinks, softmax_scale, cmp_ratio,
                     ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right, layout)


def _grad(query, dout, attn_out, softmax_lse, ori_kv, cmp_kv, ori_sparse_indices, cmp_sparse_indices, cu_seq_lens_q,
          cu_seq_lens_ori_kv, cu_seq_lens_cmp_kv, seqused_q, seqused_ori_kv, seqused_cmp_kv, cmp_residual_kv,
          ori_topk_length, cmp_topk_length, sinks, softmax_scale, cmp_ratio, ori_mask_mode, cmp_mask_mode,
          ori_win_left, ori_win_right, layout):
    return ops.sparse_flash_mla_grad(
        query, dout, attn_out, softmax_lse, ori_kv=ori_kv, cmp_kv=cmp_kv, ori_sparse_indices=ori_sparse_indices,
        cmp_sparse_indices=cmp_sparse_indices, cu_seqlens_q=cu_seq_lens_q, cu_seqlens_ori_kv=cu_seq_lens_ori_kv,
        cu_seqlens_cmp_kv=cu_seq_lens_cmp_kv, seqused_q=seqused_q, seqused_ori_kv=seqused_ori_kv,
        seqused_cmp_kv=seqused_cmp_kv, cmp_residual_kv=cmp_residual_kv, ori_topk_length=ori_topk_length,
        cmp_topk_length=cmp_topk_length, sinks=sinks, metadata=None, softmax_scale=softmax_scale,
        cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode, cmp_mask_mode=cmp_mask_mode,
        ori_win_left=ori_win_left, ori_win_right=ori_win_right, layout_q=layout, layout_kv=layout)


def npu_sparse_lightning_indexer_kl_loss_grad(query, key, weights, sparse_indices, attn_softmax_l1_norm, *,
                                              cu_seq_lens_q=None, cu_seq_lens_k=None,
                                              seqused_q=None, seqused_k=None, cmp_residual_k=None,
                                              layout='BSND', mask_mode=3, cmp_ratio=1):
    """Indexer KL-loss gradient -> ``(dq, dk, dw, softmax_out)``.  No autograd."""
    layout = _layout(layout)
    return ops.sparse_lightning_indexer_kl_loss_grad(
        query, key, weights, sparse_indices, attn_softmax_l1_norm, cu_seqlens_q=cu_seq_lens_q,
        cu_seqlens_k=cu_seq_lens_k, seqused_q=seqused_q, seqused_k=seqused_k, cmp_residual_k=cmp_residual_k,
        metadata=None, layout_q=layout, layout_k=layout, mask_mode=mask_mode, cmp_ratio=cmp_ratio)


__all__ = ["npu_lightning_indexer", "npu_quant_lightning_indexer", "npu_sparse_flash_mla", "npu_sparse_flash_mla_grad",
           "npu_sparse_lightning_indexer_kl_loss_grad", "SparseFlashMlaFunction"]
