"""A decode-sized ``sparse_attn_sharedkv`` call over paged caches in one compiled step
(dsattn/native/sharedkv.cpp): the argument checks, query rows, key tables and attention that the
Python path runs as some hundred small operator calls (several times a one-request decode kernel's
time) happen in one.

It takes exactly the calls the Python path would give the compiled attention kernel (CPU tensors of
bf16 / fp16 / fp32, the compiled layer loaded, neither Triton nor the flash rounding opt-in chosen)
when they are of the serving shape: ``layout_kv="PA_ND"``, no plan (``metadata``), content checks on,
key tables within one block of rows.  Anything else, and any argument the checks would refuse, is
declined (``None``) before a byte is written, and the Python path runs the call: its results are the
same bits (the same key tables into the same kernel), its errors are worded once, in Python."""
from __future__ import annotations

import math

import torch

from .. import native
from ..backend import use_triton
from ..common.checks import content_checks_enabled
from ..common.memory import empty_output
from ..common.softmax import uses_flash
from ..quant.tokens import PackedTokens
from ..sparse_mla.fast import NATIVE_DTYPES

# arguments the step does not take (another shape of call); the Python path handles them
_OTHER_SHAPES = ("metadata", "seqused_q", "ori_sparse_indices")


def reasons(q: torch.Tensor, kw: dict) -> list[str]:
    """Why the compiled step does not take a call of these arguments (before it looks at their values);
    empty when it does (``dsattn bench --which``)."""
    why = []
    if q.device.type != "cpu" or q.dtype not in NATIVE_DTYPES:
        why.append(f"a {q.device.type} {str(q.dtype).split('.')[-1]} query (it takes CPU bf16 / fp16 / fp32)")
    if kw.get("layout_kv", "PA_ND") != "PA_ND" or kw.get("layout_q", "BSND") not in ("BSND", "TND"):
        why.append("not paged caches (layout_kv PA_ND)")
    if kw.get("return_softmax_lse", False) or any(kw.get(name) is not None for name in _OTHER_SHAPES) \
            or kw.get("ori_kv") is None:
        why.append("another shape of call (a plan, seqused_q, ori_sparse_indices, no ori_kv)")
    if uses_flash(q.dtype, q.device) or use_triton(q.device):
        why.append("the flash rounding opt-in or Triton is chosen")
    if not content_checks_enabled(q):
        why.append("content checks are off")
    if not why and native.kernels() is None:
        why.append(native.status())
    return why


def run(q: torch.Tensor, packed, kw: dict) -> torch.Tensor | None:
    """The call's ``attn_out``, or None when the compiled step declines it."""
    if reasons(q, kw):
        return None
    module = native.kernels()
    ori_kv, cmp_kv = kw["ori_kv"], kw.get("cmp_kv")
    formats = []
    if packed is not None:
        formats = _formats(packed, q, ori_kv, cmp_kv)
        if formats is None:
            return None
    scale = kw.get("softmax_scale", 0.0)
    out = empty_output(*q.shape, dtype=q.dtype, device=q.device)
    taken = module.sharedkv_paged(
        out, q, ori_kv, cmp_kv, kw.get("ori_block_table"), kw.get("cmp_block_table"), kw.get("seqused_kv"),
        kw.get("cu_seqlens_q"), kw.get("cmp_sparse_indices"), kw.get("cmp_topk_length"), kw.get("sinks"),
        scale if scale != 0.0 else 1.0 / math.sqrt(q.size(-1)), kw.get("cmp_ratio", 0), kw.get("ori_mask_mode", 4),
        kw.get("cmp_mask_mode", 3), kw.get("ori_win_left", 127), kw.get("ori_win_right", 0),
        kw.get("layout_q", "BSND") == "TND", formats)
    return out if taken else None


def _formats(packed, q, ori_kv, cmp_kv) -> list | None:
    """The packed caches' format fields for the kernel, or None where the Python path must look at
    them (a width or dtype its checks refuse, rows not one after another)."""
    fields = []
    for name, kv in (("ori_kv", ori_kv), ("cmp_kv", cmp_kv)):
        if kv is None:
            continue
        try:
            packed.check(name, kv, q.size(-1))
        except (TypeError, ValueError):
            return None
        tokens = PackedTokens.row_fields(kv, packed.rope_head_dim, packed.tile_size, q.dtype)
        if tokens is None:
            return None
        fields.append([int(f) for f in tokens])
    return fields
