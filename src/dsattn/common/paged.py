"""Writes into paged caches shared by the compressor state cache and the quantised KV cache.

A cache write skips some rows (slot -1, block 0, a -1 table entry).  Selecting the kept rows
with a boolean mask has a data-dependent size, which forces a device-to-host sync and breaks
graph capture; :func:`write_rows` instead does one fixed-size ``index_put_``.
"""
from __future__ import annotations

import torch


def write_rows(flat_cache: torch.Tensor, target, keep: torch.Tensor, values: torch.Tensor) -> None:
    """``flat_cache[target[i]] = values[i]`` for every ``i`` with ``keep[i]``; other rows untouched.
    ``target``: row indices, or a tuple of index tensors for the cache's leading dims (a row of a paged
    view is ``(block, slot)`` where blocks are padded past their rows).

    Skipped rows are redirected to the first kept row's (target, value), so the duplicate
    writes store identical bytes; when nothing is kept, the redirected write stores the
    cache's own row ``target[0]`` back (which must then be a valid index, e.g. 0)."""
    targets = target if isinstance(target, tuple) else (target,)
    if targets[0].numel() == 0 or flat_cache.size(0) == 0:
        return
    values = values.to(flat_cache.dtype)
    shape = (-1,) + (1,) * (values.dim() - 1)
    first = torch.argmax(keep.to(torch.int8)).reshape(1)           # index ops only: no data-dependent int
    keep0 = keep.index_select(0, first)
    firsts = tuple(torch.where(keep0, t.index_select(0, first), torch.zeros_like(keep0, dtype=t.dtype))
                   for t in targets)
    value0 = torch.where(keep0.view(shape), values.index_select(0, first), flat_cache[firsts])
    flat_cache.index_put_(tuple(torch.where(keep, t, t0) for t, t0 in zip(targets, firsts)),
                          torch.where(keep.view(shape), values, value0))
