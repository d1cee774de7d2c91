"""The compiled planner (``dsattn.native``'s ``plan_table``): the same arguments and checks as
:func:`.params.plan_params` (the scalars are checked here, the length mirrors are resolved and
checked in C++ with the same messages), and the table byte-identical to the golden's."""
from __future__ import annotations

import torch

from .params import check_scalars, length_tensors


def plan_table(module, num_heads_q, num_heads_kv, head_dim, *, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
               cu_seqlens_cmp_kv=None, seqused_q=None, seqused_kv=None, batch_size=0, max_seqlen_q=0,
               max_seqlen_kv=0, ori_topk=0, cmp_topk=0, cmp_ratio=-1, ori_mask_mode=4, cmp_mask_mode=3,
               ori_win_left=127, ori_win_right=0, layout_q="BSND", layout_kv="PA_ND", has_ori_kv=True,
               has_cmp_kv=True, aic_core_num=24, aiv_core_num=48, support_fd=False,
               allow_device=True) -> torch.Tensor:
    check_scalars(num_heads_q, num_heads_kv, head_dim, batch_size=batch_size, max_seqlen_q=max_seqlen_q,
                  max_seqlen_kv=max_seqlen_kv, cmp_topk=cmp_topk, cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode,
                  cmp_mask_mode=cmp_mask_mode, ori_win_left=ori_win_left, ori_win_right=ori_win_right,
                  layout_q=layout_q, layout_kv=layout_kv, has_ori_kv=has_ori_kv, has_cmp_kv=has_cmp_kv,
                  aic_core_num=aic_core_num, aiv_core_num=aiv_core_num, support_fd=support_fd)
    ts = length_tensors(allow_device, seqused_q=seqused_q, cu_seqlens_q=cu_seqlens_q, seqused_kv=seqused_kv,
                        cu_seqlens_ori_kv=cu_seqlens_ori_kv, cu_seqlens_cmp_kv=cu_seqlens_cmp_kv)
    return module.plan_table(num_heads_q, ts["seqused_q"], ts["cu_seqlens_q"], ts["seqused_kv"],
                             ts["cu_seqlens_ori_kv"], batch_size, max_seqlen_q, max_seqlen_kv, layout_q == "TND",
                             layout_kv == "TND", bool(has_cmp_kv), cmp_topk, cmp_ratio, ori_mask_mode, ori_win_left,
                             aic_core_num, aiv_core_num, bool(support_fd))
