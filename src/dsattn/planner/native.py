"""The compiled planner (``dsattn.native``'s ``plan_table``): the same arguments and checks as
:func:`.params.plan_params` (the scalars are checked in Python, the length mirrors are resolved
and checked in C++ with the same messages), and the table byte-identical to the golden's."""
from __future__ import annotations

import torch

from .params import checked_arguments


def plan_table(module, num_heads_q, num_heads_kv, head_dim, **kw) -> torch.Tensor:
    a = checked_arguments(num_heads_q, num_heads_kv, head_dim, **kw)
    return module.plan_table(num_heads_q, a.seqused_q, a.cu_seqlens_q, a.seqused_kv, a.cu_seqlens_ori_kv,
                             a.batch_size, a.max_seqlen_q, a.max_seqlen_kv, a.layout_q == "TND", a.layout_kv == "TND",
                             a.has_cmp_kv, a.cmp_topk, a.cmp_ratio, a.ori_mask_mode, a.ori_win_left, a.aic, a.aiv,
                             a.support_fd)
