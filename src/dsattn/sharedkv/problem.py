"""``sparse_attn_sharedkv`` arguments (20-sparse-flash-mla §4.2) mapped onto the shared
two-branch problem of ``sparse_flash_mla`` (:class:`MlaProblem`): the math is §1 exactly."""
from __future__ import annotations

import math

import torch

from ..common.checks import check_choice, check_int32, fail
from ..common.layout import PAGED
from ..planner.params import TABLE_SIZE
from ..sparse_mla.problem import MlaProblem, check_index_list, parse_mla

KV_LAYOUTS = {"PA_ND": PAGED, "BSND": "BSND", "TND": "TND"}


def _paged_4d(name: str, kv: torch.Tensor | None) -> torch.Tensor | None:
    """PA_ND accepts ``[num_blocks, block_size, D]`` as a view of ``[num_blocks, block_size, 1, D]``."""
    return kv.unsqueeze(2) if kv is not None and kv.dim() == 3 else kv


def check_metadata(metadata: torch.Tensor | None) -> None:
    if metadata is None:
        return
    check_int32("metadata", metadata)
    if tuple(metadata.shape) != (TABLE_SIZE,):
        fail("metadata", f"expected shape ({TABLE_SIZE},) from sparse_attn_sharedkv_metadata, "
             f"got {tuple(metadata.shape)}")


def parse_sharedkv(q, *, content=None, packed=None, **kwargs) -> MlaProblem:
    """Validate a ``sparse_attn_sharedkv`` call (``packed``: the ``_packed`` variant's row format)."""
    return parse_mla(q, content=content, packed=packed, **mla_arguments(q, **kwargs))


def mla_arguments(q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, cmp_sparse_indices=None,
                  ori_block_table=None, cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                  cu_seqlens_cmp_kv=None, seqused_q=None, seqused_kv=None, sinks=None, metadata=None,
                  softmax_scale=0.0, cmp_ratio=0, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=127,
                  ori_win_right=0, layout_q="BSND", layout_kv="PA_ND", return_softmax_lse=False,
                  cmp_topk_length=None) -> dict:
    """The ``sparse_flash_mla`` arguments of a ``sparse_attn_sharedkv`` call (20 §4.2: the same
    math), after the checks that only the sharedkv signature needs."""
    if return_softmax_lse:
        fail("return_softmax_lse", "sparse_attn_sharedkv returns no LSE; use sparse_flash_mla for it",
             NotImplementedError)
    check_choice("layout_kv", layout_kv, tuple(KV_LAYOUTS))
    check_choice("layout_q", layout_q, ("BSND", "TND"))
    if layout_kv != "PA_ND" and layout_kv != layout_q:
        fail("layout_kv", f"{layout_kv!r} cannot be combined with layout_q={layout_q!r}; allowed pairs: "
             "(BSND, BSND), (TND, TND), (BSND, PA_ND), (TND, PA_ND)")
    check_metadata(metadata)
    check_int32("seqused_q", seqused_q)                                # ignored, still checked
    check_index_list("ori_sparse_indices", ori_sparse_indices, q, layout_q)  # ignored, still checked
    check_int32("seqused_kv", seqused_kv)
    paged = layout_kv == "PA_ND"
    if paged:
        ori_kv, cmp_kv = _paged_4d("ori_kv", ori_kv), _paged_4d("cmp_kv", cmp_kv)
        if seqused_kv is None:
            fail("seqused_kv", "is required for layout_kv PA_ND")
        for name, table, kv in (("ori_block_table", ori_block_table, ori_kv), ("cmp_block_table", cmp_block_table,
                                                                                cmp_kv)):
            if kv is not None and table is None:
                fail(name, f"is required for layout_kv PA_ND when {name[:3]}_kv is given")
    if ori_kv is None:
        fail("ori_kv", "is required (every scenario has the ori branch)")
    if cmp_kv is None:
        r = 1                                                          # cmp_ratio is ignored without cmp_kv
    else:
        r = cmp_ratio
        if not 1 <= r <= 128:
            fail("cmp_ratio", f"value {r} is not in [1, 128] (DeepSeek-V4: 4 or 128)")
    if seqused_kv is not None:
        s2o = seqused_kv
    elif layout_kv == "TND":
        if cu_seqlens_ori_kv is None:
            fail("cu_seqlens_ori_kv", "is required for layout_kv TND")
        check_int32("cu_seqlens_ori_kv", cu_seqlens_ori_kv)
        s2o = (cu_seqlens_ori_kv[1:] - cu_seqlens_ori_kv[:-1]).to(torch.int32)
    else:
        B = q.size(0) if layout_q == "BSND" else None
        s2o = torch.full((B,), ori_kv.size(1), dtype=torch.int32, device=q.device) if B is not None else None
    kw = dict(ori_kv=ori_kv, cmp_kv=cmp_kv, cmp_sparse_indices=cmp_sparse_indices, cu_seqlens_q=cu_seqlens_q,
              seqused_ori_kv=s2o, sinks=sinks, cmp_ratio=r, ori_mask_mode=ori_mask_mode,
              cmp_mask_mode=cmp_mask_mode, ori_win_left=ori_win_left, ori_win_right=ori_win_right,
              layout_q=layout_q, layout_kv=KV_LAYOUTS[layout_kv], cmp_topk_length=cmp_topk_length,
              softmax_scale=softmax_scale if softmax_scale != 0.0 else 1.0 / math.sqrt(q.size(-1)))
    if layout_kv == "TND":
        kw["cu_seqlens_ori_kv"] = cu_seqlens_ori_kv
        if cmp_kv is not None:
            if cu_seqlens_cmp_kv is None:
                fail("cu_seqlens_cmp_kv", "is required for layout_kv TND when cmp_kv is given")
            kw["cu_seqlens_cmp_kv"] = cu_seqlens_cmp_kv
    if paged:
        kw["ori_block_table"] = ori_block_table
        kw["cmp_block_table"] = cmp_block_table if cmp_kv is not None else None
    elif cmp_kv is not None and s2o is not None:
        kw["seqused_cmp_kv"] = torch.div(s2o, r, rounding_mode="floor").to(torch.int32)   # S2c = floor(S2o / r)
    if cmp_kv is None and cmp_sparse_indices is not None:
        fail("cmp_sparse_indices", "is given but cmp_kv is None")
    return kw
