"""Arguments of the metadata planner (50-metadata-planner §1.1, §2.1), validated and resolved
to plain Python ints: the planner is host code and works on CPU integer mirrors."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..common.checks import check_choice, fail

INF = 2 ** 63 - 1
S2_BASE = 512
FA_CORES = 36          # fixed capacities of the table (§3)
FD_CORES = 72
TABLE_SIZE = 1024


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@dataclass
class PlanParams:
    B: int
    N1: int
    N2: int
    S1: list[int]
    S2: list[int]
    has_cmp: bool
    cmp_topk: int
    cmp_ratio: int
    ori_mask_mode: int
    ori_win_left: int
    aic: int
    aiv: int
    support_fd: bool

    @property
    def G(self) -> int:
        return self.N1 // self.N2

    @property
    def is_scfa(self) -> bool:          # CSA: sparse compressed branch
        return self.has_cmp and self.cmp_topk > 0

    @property
    def m_base(self) -> int:
        return self.G if self.is_scfa else 256

    @property
    def no_mask(self) -> bool:
        return self.ori_mask_mode == 0

    @property
    def pre(self) -> int:
        if self.ori_mask_mode == 4 and self.ori_win_left > -1:
            return self.ori_win_left
        return INF

    @property
    def high_perf_gate(self) -> bool:
        return self.is_scfa and self.N1 == 128 and self.cmp_topk == 1024 and not self.support_fd

    def S1v(self, b: int) -> int:
        return min(self.S1[b], self.S2[b])


def _diffs(arg: str, cu: list[int]) -> list[int]:
    if len(cu) < 1:
        fail(arg, "expected shape [B+1] with B >= 0, got an empty tensor")
    out = []
    for b in range(len(cu) - 1):
        if cu[b + 1] < cu[b]:
            fail(arg, f"must be non-decreasing, got {cu[b]} then {cu[b + 1]} at batch {b}")
        out.append(cu[b + 1] - cu[b])
    if cu and cu[0] < 0:
        fail(arg, f"must not be negative, got {cu[0]}")
    return out


def check_scalars(num_heads_q, num_heads_kv, head_dim, *, batch_size=0, max_seqlen_q=0, max_seqlen_kv=0, cmp_topk=0,
                  cmp_ratio=-1, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=127, ori_win_right=0,
                  layout_q="BSND", layout_kv="PA_ND", has_ori_kv=True, has_cmp_kv=True, aic_core_num=24,
                  aiv_core_num=48, support_fd=False) -> None:
    """The checks of every argument but the length tensors (50 §1.1)."""
    if num_heads_kv != 1:
        fail("num_heads_kv", f"value {num_heads_kv} is not supported; the shared-KV planner needs 1")
    if num_heads_q < 1:
        fail("num_heads_q", f"value {num_heads_q} must be >= 1")
    if head_dim < 1:
        fail("head_dim", f"value {head_dim} must be >= 1")
    if not has_ori_kv:
        fail("has_ori_kv", "must be True (every scenario has the window branch)")
    if has_cmp_kv:
        check_choice("cmp_ratio", cmp_ratio, (4, 128))
        check_choice("cmp_topk", cmp_topk, (0, 512, 1024))
        check_choice("cmp_mask_mode", cmp_mask_mode, (3,))
    check_choice("ori_mask_mode", ori_mask_mode, (0, 3, 4))
    for name, v in (("ori_win_left", ori_win_left), ("ori_win_right", ori_win_right)):
        if v < -1:
            fail(name, f"value {v} must be >= -1")
    if ori_mask_mode == 4 and ori_win_right != 0:
        fail("ori_win_right", f"value {ori_win_right} is not supported with ori_mask_mode 4: the planner's band "
             "ends at the query (0)")
    check_choice("layout_q", layout_q, ("BSND", "TND"))
    check_choice("layout_kv", layout_kv, ("PA_ND", "BSND", "TND"))
    if not 1 <= aic_core_num <= FA_CORES:
        fail("aic_core_num", f"value {aic_core_num} is not in [1, {FA_CORES}]")
    if not 1 <= aiv_core_num <= FD_CORES:
        fail("aiv_core_num", f"value {aiv_core_num} is not in [1, {FD_CORES}]")
    if support_fd and aiv_core_num < aic_core_num:
        fail("aiv_core_num", f"value {aiv_core_num} must be >= aic_core_num={aic_core_num} with support_fd")
    for name, v in (("batch_size", batch_size), ("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
        if v < 0:
            fail(name, f"value {v} must be >= 0")


LENGTH_NAMES = ("seqused_q", "cu_seqlens_q", "seqused_kv", "cu_seqlens_ori_kv", "cu_seqlens_cmp_kv")


def length_tensors(allow_device: bool, **lengths) -> dict:
    """The length mirrors (``LENGTH_NAMES``) checked for dtype and rank, as CPU tensors (a device
    tensor is copied, blocking, where the operator allows it: 50 §1.1); None stays None."""
    out = {}
    for arg in LENGTH_NAMES:
        t = lengths.get(arg)
        if t is not None:
            if t.dtype != torch.int32:
                fail(arg, f"dtype {t.dtype} is not supported; expected torch.int32", TypeError)
            if t.dim() != 1:
                fail(arg, f"expected a 1-D tensor, got shape {tuple(t.shape)}")
            if t.device.type != "cpu":
                if not allow_device:
                    fail(arg, f"must be a CPU int32 tensor (the host planner never reads device memory), got device "
                         f"{t.device}")
                t = t.cpu()
        out[arg] = t
    return out


def checked_arguments(num_heads_q, num_heads_kv, head_dim, *, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                      cu_seqlens_cmp_kv=None, seqused_q=None, seqused_kv=None, batch_size=0, max_seqlen_q=0,
                      max_seqlen_kv=0, ori_topk=0, cmp_topk=0, cmp_ratio=-1, ori_mask_mode=4, cmp_mask_mode=3,
                      ori_win_left=127, ori_win_right=0, layout_q="BSND", layout_kv="PA_ND", has_ori_kv=True,
                      has_cmp_kv=True, aic_core_num=24, aiv_core_num=48, support_fd=False,
                      allow_device=True) -> SimpleNamespace:
    """Every argument of the planner (50 §1.1) checked, the length mirrors as CPU tensors (``ori_topk``
    is accepted and unused)."""
    check_scalars(num_heads_q, num_heads_kv, head_dim, batch_size=batch_size, max_seqlen_q=max_seqlen_q,
                  max_seqlen_kv=max_seqlen_kv, cmp_topk=cmp_topk, cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode,
                  cmp_mask_mode=cmp_mask_mode, ori_win_left=ori_win_left, ori_win_right=ori_win_right,
                  layout_q=layout_q, layout_kv=layout_kv, has_ori_kv=has_ori_kv, has_cmp_kv=has_cmp_kv,
                  aic_core_num=aic_core_num, aiv_core_num=aiv_core_num, support_fd=support_fd)
    ts = length_tensors(allow_device, seqused_q=seqused_q, cu_seqlens_q=cu_seqlens_q, seqused_kv=seqused_kv,
                        cu_seqlens_ori_kv=cu_seqlens_ori_kv, cu_seqlens_cmp_kv=cu_seqlens_cmp_kv)
    return SimpleNamespace(num_heads_q=num_heads_q, num_heads_kv=num_heads_kv, batch_size=batch_size,
                           max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, cmp_topk=cmp_topk,
                           cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode, ori_win_left=ori_win_left,
                           layout_q=layout_q, layout_kv=layout_kv, has_cmp_kv=bool(has_cmp_kv), aic=aic_core_num,
                           aiv=aiv_core_num, support_fd=bool(support_fd), **ts)


def plan_params(num_heads_q, num_heads_kv, head_dim, **kw) -> PlanParams:
    """The planner's arguments (those of :func:`checked_arguments`) resolved to plain ints."""
    a = checked_arguments(num_heads_q, num_heads_kv, head_dim, **kw)
    layout_q, layout_kv, batch_size = a.layout_q, a.layout_kv, a.batch_size
    sq, cq, skv, ckv = ([int(v) for v in t.tolist()] if t is not None else None
                        for t in (a.seqused_q, a.cu_seqlens_q, a.seqused_kv, a.cu_seqlens_ori_kv))
    if sq is not None:
        B = len(sq)
    elif layout_q == "TND" and cq is not None:
        B = len(cq) - 1
    else:
        B = batch_size
    if B < 0:
        fail("cu_seqlens_q", "expected shape [B+1] with B >= 0")
    if sq is not None:
        S1 = sq
    elif layout_q == "TND" and cq is not None:
        S1 = _diffs("cu_seqlens_q", cq)
    else:
        S1 = [a.max_seqlen_q] * B
    if skv is not None:
        S2 = skv
        if len(S2) != B:
            fail("seqused_kv", f"has {len(S2)} entries but the batch size is {B}")
    elif layout_kv == "TND" and ckv is not None:
        S2 = _diffs("cu_seqlens_ori_kv", ckv)
        if len(S2) != B:
            fail("cu_seqlens_ori_kv", f"has {len(ckv)} entries but the batch size is {B} (expected {B + 1})")
    else:
        S2 = [a.max_seqlen_kv] * B
    for name, vals in (("seqused_q", S1 if sq is not None else []), ("seqused_kv", S2 if skv is not None else [])):
        for b, v in enumerate(vals):
            if v < 0:
                fail(name, f"value {v} at batch {b} is negative")
    if batch_size and batch_size != B and (sq is not None or cq is not None):
        fail("batch_size", f"value {batch_size} does not match the {B} batches of the length tensors")
    return PlanParams(B, a.num_heads_q, a.num_heads_kv, list(S1), list(S2), a.has_cmp_kv,
                      a.cmp_topk if a.has_cmp_kv else 0, a.cmp_ratio, a.ori_mask_mode, a.ori_win_left, a.aic, a.aiv,
                      a.support_fd)
