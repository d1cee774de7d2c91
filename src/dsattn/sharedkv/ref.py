"""Goldens of ``sparse_attn_sharedkv`` and ``sparse_attn_sharedkv_packed``.

20 §4.4: ``sparse_attn_sharedkv`` is ``sparse_flash_mla`` with its arguments renamed, so its
golden is the ``sparse_flash_mla`` golden on the mapped arguments.  The packed variant is the
same call on caches dequantised row by row first (:func:`dsattn.quant.dequant_kv_rows`, fp32
then rounded once to the query dtype); unreferenced rows may hold anything.
"""
from __future__ import annotations

from ..quant.rows import dequant_kv_rows, rope_bytes_dtype
from ..sparse_mla.ref import sparse_flash_mla
from .problem import mla_arguments


def sparse_attn_sharedkv(q, *, compute_dtype=None, emulate_rounding=True, **kwargs):
    out, _ = sparse_flash_mla(q, compute_dtype=compute_dtype, emulate_rounding=emulate_rounding,
                              **mla_arguments(q, **kwargs))
    return out, q.new_zeros((0,))


def sparse_attn_sharedkv_packed(q, *, kv_rope_dim=64, kv_tile_size=64, compute_dtype=None, emulate_rounding=True,
                                ori_kv=None, cmp_kv=None, **kwargs):
    def dequant(kv):
        if kv is None:
            return None
        return dequant_kv_rows(kv, kv_rope_dim, q.dtype, rope_bytes_dtype(q.dtype), kv_tile_size)[0]
    return sparse_attn_sharedkv(q, ori_kv=dequant(ori_kv), cmp_kv=dequant(cmp_kv), compute_dtype=compute_dtype,
                                emulate_rounding=emulate_rounding, **kwargs)
