"""Context parallelism by key sharding (60-serving §7.2) over ``torch.distributed``.

Each rank holds a contiguous shard of one long request's caches: raw (window) positions
``[ori_start, ori_start + ori_shard.size(0))`` and compressed positions
``[cmp_start, cmp_start + cmp_shard.size(0))``.  Every rank computes, for all query rows, the
attention over the visible keys *of its own shard* (20 §1.2 selection restricted to the
shard) without the sink, giving a normalised partial output and its LSE; the partials are
all-gathered and merged by :func:`merge_attention_states`, which adds the sink exactly once.
Every rank ends with the same result, equal to the single-process attention within the
tolerance of a merge (P is rounded per partial).
"""
from __future__ import annotations

import torch

from ..common.checks import fail
from ..common.masks import cmp_threshold_t, ori_range_t, sparse_walk_t
from ..common.softmax import attend_branches, merge_attention_states


def shard_partial(q, ori_shard, ori_start: int, total_len: int, *, cmp_shard=None, cmp_start: int = 0,
                  cmp_sparse_indices=None, softmax_scale: float, cmp_ratio: int = 1, window: int = 128):
    """Partial attention of the query rows over this shard's visible keys, without the sink.

    ``q [S1, H, D]`` are the last S1 rows of a request of ``total_len`` tokens (right-aligned:
    row i is at position ``total_len - S1 + i``); the compressed branch is causal (mode 3), dense
    (HCA) or, with ``cmp_sparse_indices [S1, 1, K]`` of global compressed indices, sparse (CSA).
    Returns ``(out [S1, H, D] fp32, lse [S1, H] fp32, valid [S1, H] bool)``."""
    S1, H, D = q.shape
    dev = q.device
    cdt = torch.float32
    i = torch.arange(S1, device=dev)
    p = total_len - S1 + i
    row_ok = p >= 0
    lo, hi = ori_range_t(p, torch.tensor(total_len, device=dev), 4, window - 1, 0)
    xs = ori_start + torch.arange(ori_shard.size(0), device=dev)
    masks = [row_ok[:, None] & (xs[None] >= lo[:, None]) & (xs[None] < hi[:, None])]
    qf = q.to(cdt)
    scores = [torch.einsum("nhd,ud->nhu", qf, ori_shard.reshape(-1, D).to(cdt))]
    values = [("shared", ori_shard.reshape(-1, D).to(cdt))]
    if cmp_shard is not None:
        Sc = total_len // cmp_ratio
        thr = cmp_threshold_t(p, torch.tensor(total_len, device=dev), torch.tensor(Sc, device=dev), cmp_ratio, 3)
        cmp = cmp_shard.reshape(-1, D).to(cdt)
        if cmp_sparse_indices is None:
            js = cmp_start + torch.arange(cmp.size(0), device=dev)
            masks.append(row_ok[:, None] & (js[None] < thr[:, None]))
            scores.append(torch.einsum("nhd,ud->nhu", qf, cmp))
            values.append(("shared", cmp))
        else:
            idx = cmp_sparse_indices[:, 0].to(torch.int64)
            sel = sparse_walk_t(idx, thr, thr) & row_ok[:, None]
            local = idx - cmp_start
            mine = sel & (local >= 0) & (local < cmp.size(0))
            K = cmp[torch.where(mine, local, torch.zeros_like(local))]
            K = torch.where(mine[..., None], K, torch.zeros((), dtype=cdt, device=dev))
            masks.append(mine)
            scores.append(torch.einsum("nhd,nwd->nhw", qf, K))
            values.append(("per_row", K))
    keep = [k for k, m in enumerate(masks) if m.size(1) > 0]             # a shard may hold no key of a branch
    if not keep:
        z = torch.zeros(S1, H, dtype=cdt, device=dev)
        return torch.zeros(S1, H, D, dtype=cdt, device=dev), z, z.bool()
    out, lse, has = attend_branches([scores[k] for k in keep], [masks[k] for k in keep], [values[k] for k in keep],
                                    softmax_scale, None, q.dtype)
    return out, lse, has.expand(S1, H)


def context_parallel_attention(q, ori_shard, ori_start: int, total_len: int, *, sinks=None, group=None,
                               **branch) -> torch.Tensor:
    """All ranks: partial attention over the local shard, all-gather, merge with the sink once.
    Returns the merged output ``[S1, H, D]`` in q's dtype (the same on every rank)."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        fail("group", "torch.distributed is not initialised (call init_process_group first)")
    if sinks is not None and sinks.dtype != torch.float32:
        fail("sinks", f"dtype {sinks.dtype} is not supported; expected torch.float32", TypeError)
    out, lse, valid = shard_partial(q, ori_shard, ori_start, total_len, **branch)
    world = dist.get_world_size(group)
    outs = [torch.empty_like(out) for _ in range(world)]
    lses = [torch.empty_like(lse) for _ in range(world)]
    valids = [torch.empty_like(valid, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(outs, out, group=group)
    dist.all_gather(lses, lse, group=group)
    dist.all_gather(valids, valid.to(torch.uint8), group=group)
    merged, _ = merge_attention_states(outs, lses, sinks=sinks, valid=[v.bool() for v in valids])
    return merged.to(q.dtype)
