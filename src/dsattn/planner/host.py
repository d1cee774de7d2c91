"""``sparse_attn_sharedkv_metadata_host`` (50 §1.2): the serving entry point of the planner.

It takes the CPU int32 mirrors an engine keeps (``cu_seqlens_q``, ``seqused_kv``), never
reads device memory, and delivers the table to the target device without draining the
stream: on an accelerator target the table is built in a pinned staging buffer taken from a
small ring (two per output buffer), copied with ``non_blocking=True``, and an event recorded
after the copy guards the staging buffer until the copy has completed.
"""
from __future__ import annotations

import torch

from ..common.checks import fail
from ..planner.params import TABLE_SIZE

_RING_SIZE = 2
_rings: dict = {}        # key -> [ring index, [(pinned buffer, event or None)] * _RING_SIZE]


def _check_cpu_int32(arg: str, t: torch.Tensor | None) -> None:
    if t is None:
        fail(arg, "is required (a CPU int32 mirror)")
    if t.device.type != "cpu":
        fail(arg, f"must be a CPU tensor (the host planner never reads device memory), got device {t.device}")
    if t.dtype != torch.int32:
        fail(arg, f"dtype {t.dtype} is not supported; expected torch.int32", TypeError)


def _accelerator_target(out: torch.Tensor | None, device) -> torch.device | None:
    target = out.device if out is not None else (torch.device(device) if device is not None else None)
    if target is None or target.type == "cpu":
        return None
    if target.type == "cuda" and torch.cuda.is_available():
        return target
    return None


def _staging(key) -> torch.Tensor:
    """A pinned (1024,) int32 buffer whose previous copy has completed."""
    ring = _rings.get(key)
    if ring is None:
        ring = _rings[key] = [0, [(torch.empty(TABLE_SIZE, dtype=torch.int32, pin_memory=True), None)
                                  for _ in range(_RING_SIZE)]]
    idx, slots = ring
    buf, event = slots[idx]
    if event is not None:
        event.synchronize()                       # normally long complete: never overwrite in-flight DMA
    return buf, idx


def _record(key, idx, buf) -> None:
    event = torch.cuda.Event()
    event.record()
    ring = _rings[key]
    ring[1][idx] = (buf, event)
    ring[0] = (idx + 1) % _RING_SIZE


def sparse_attn_sharedkv_metadata_host(num_heads_q, num_heads_kv, head_dim, layout_q, layout_kv,
                                       cu_seqlens_q=None, seqused_kv=None, batch_size=0,
                                       cmp_topk=0, cmp_ratio=-1, ori_mask_mode=4, cmp_mask_mode=3,
                                       ori_win_left=127, ori_win_right=0,
                                       has_ori_kv=True, has_cmp_kv=True, *,
                                       aic_core_num=24, aiv_core_num=48, support_fd=False,
                                       out=None, device=None) -> torch.Tensor:
    """The plan table for CPU mirrors; equal bit for bit to ``sparse_attn_sharedkv_metadata``."""
    from ..sharedkv.op import build_table
    if layout_q != "TND":
        fail("layout_q", f"value {layout_q!r} is not supported by the host helper; expected 'TND'")
    _check_cpu_int32("cu_seqlens_q", cu_seqlens_q)
    _check_cpu_int32("seqused_kv", seqused_kv)
    B = cu_seqlens_q.numel() - 1
    if batch_size and batch_size != B:
        fail("batch_size", f"value {batch_size} does not match cu_seqlens_q's {B} batches")
    if out is not None and (out.dtype != torch.int32 or tuple(out.shape) != (TABLE_SIZE,)):
        fail("out", f"expected an int32 ({TABLE_SIZE},) tensor, got {out.dtype} {tuple(out.shape)}")
    table = build_table(num_heads_q, num_heads_kv, head_dim, cu_seqlens_q=cu_seqlens_q, seqused_kv=seqused_kv,
                        batch_size=batch_size, cmp_topk=cmp_topk, cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode,
                        cmp_mask_mode=cmp_mask_mode, ori_win_left=ori_win_left, ori_win_right=ori_win_right,
                        layout_q=layout_q, layout_kv=layout_kv, has_ori_kv=has_ori_kv, has_cmp_kv=has_cmp_kv,
                        aic_core_num=aic_core_num, aiv_core_num=aiv_core_num, support_fd=support_fd,
                        allow_device=False)
    target = _accelerator_target(out, device)
    if target is None:                                   # CPU target or no accelerator: nothing is pinned
        if out is not None:
            out.copy_(table)
            return out
        return table
    key = ("out", out.data_ptr()) if out is not None else ("device", str(target))
    staging, idx = _staging(key)
    staging.copy_(table)
    if out is not None:
        out.copy_(staging, non_blocking=True)
        result = out
    else:
        result = staging.to(target, non_blocking=True)
    _record(key, idx, staging)
    return result
