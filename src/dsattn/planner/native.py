"""The compiled planner (``dsattn.native``'s ``plan_table``): the same arguments and checks as
:func:`.params.plan_params` (the scalars are checked in Python, the length mirrors are resolved
and checked in C++ with the same messages), and the table byte-identical to the golden's; and
the compiled reading of a table for an executor (``plan_coverage``: :func:`read_plan`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .fast import Rows
from .params import PlanParams, checked_arguments
from .table import Coverage, Segment


def plan_table(module, num_heads_q, num_heads_kv, head_dim, **kw) -> torch.Tensor:
    a = checked_arguments(num_heads_q, num_heads_kv, head_dim, **kw)
    return module.plan_table(num_heads_q, a.seqused_q, a.cu_seqlens_q, a.seqused_kv, a.cu_seqlens_ori_kv,
                             a.batch_size, a.max_seqlen_q, a.max_seqlen_kv, a.layout_q == "TND", a.layout_kv == "TND",
                             a.has_cmp_kv, a.cmp_topk, a.cmp_ratio, a.ori_mask_mode, a.ori_win_left, a.aic, a.aiv,
                             a.support_fd)


@dataclass
class RowGeometry:
    """The row records' geometry the executor reads (:class:`.fast.Rows` with ``costs=False``):
    batch b's rows are ``[off[b], off[b+1])``."""
    off: np.ndarray
    S1v: np.ndarray
    first: np.ndarray
    win_end: np.ndarray
    s2_start: np.ndarray
    s2_end: np.ndarray
    blocks: np.ndarray
    G: int
    m_base: int
    B: int

    m_size = Rows.m_size            # (reads m_base, G and S1v only)


def read_plan(module, metadata: torch.Tensor, pp: PlanParams, check: bool):
    """:func:`.table.decode`, :class:`.fast.Rows` (``costs=False``), :func:`.table.coverage` and, with
    ``check``, :func:`.table.check_coverage`, in one compiled call: ``(rows, fd, coverage)``, ``fd`` the
    enabled FD entries as tuples.  A violated invariant raises AssertionError with the Python
    checkers' message."""
    (off, s1v, rows, whole, partial, fd), error = module.plan_coverage(
        metadata, pp.N1, pp.S1, pp.S2, pp.has_cmp, pp.cmp_topk, pp.cmp_ratio, pp.ori_mask_mode, pp.ori_win_left, check)
    if error:
        raise AssertionError(error)
    first, win_end, s2_start, s2_end, blocks = rows.numpy()
    rw = RowGeometry(off.numpy(), s1v.numpy(), first, win_end, s2_start, s2_end, blocks, pp.G, pp.m_base, pp.B)
    segments = [Segment(core, bn2, m, lo, hi, True, slot) for core, bn2, m, lo, hi, slot in partial.tolist()]
    return rw, [tuple(e) for e in fd.tolist()], Coverage(whole.numpy(), segments)
