"""Positions and visibility rules (00-overview §6, 20-sparse-flash-mla §1.2, 10-indexer §1.4).

Each rule exists twice, side by side: a scalar form on Python ints (used by the golden
references, the spec in code) and a vectorised form on int64 tensors (used by the fast
kernels).  ``tests/test_masks.py`` checks that the two agree on a grid of cases.
"""
from __future__ import annotations

import torch

# ----------------------------------------------------------------------------- scalar rules


def n_visible(x: int, r: int) -> int:
    """Compressed entries visible to position ``x``: floor((x+1)/r), never negative."""
    return (x + 1) // r if x + 1 > 0 else 0


def ori_range(p: int, S2o: int, om: int, wl: int, wr: int) -> tuple[int, int]:
    """Raw keys ``[lo, hi)`` of a valid row at position ``p`` (mask modes 0, 3, 4)."""
    if om == 0:
        return 0, S2o
    if om == 3:
        return 0, min(p + 1, S2o)
    lo = 0 if wl == -1 else max(p - wl, 0)
    hi = S2o if wr == -1 else min(p + wr + 1, S2o)
    return lo, max(lo, hi)


def cmp_threshold(pc: int, S2o: int, S2c: int, r: int, cm: int) -> int:
    """Number of leading compressed entries a row may see (mode 3: causal via pc; mode 0: all)."""
    thr = n_visible(pc, r) if cm == 3 else S2o // r
    return min(thr, S2c)


def sparse_walk(indices: list[int], limit: int, thr: int) -> list[tuple[int, int]]:
    """Walk a -1 padded index list: (slot, key) pairs kept.

    At most ``limit`` slots are examined; the first negative value ends the list; an index
    ``>= thr`` is skipped; duplicates are kept."""
    kept = []
    for s in range(min(len(indices), limit)):
        j = indices[s]
        if j < 0:
            break
        if j >= thr:
            continue
        kept.append((s, j))
    return kept


def indexer_num_valid(Kc: int, r: int, resid: int, S1e: int, i: int, mask_mode: int) -> int:
    """Selectable compressed keys of indexer row ``i`` (10-indexer §1.4 / §2.4)."""
    if mask_mode == 0:
        return Kc
    x = Kc * r + resid - S1e + i + 1
    return 0 if x <= 0 else min(Kc, x // r)


# ----------------------------------------------------------------------------- tensor rules


def n_visible_t(x: torch.Tensor, r: int) -> torch.Tensor:
    return torch.where(x + 1 > 0, torch.div(x + 1, r, rounding_mode="floor"), torch.zeros_like(x))


def ori_range_t(p, S2o, om: int, wl: int, wr: int):
    if om == 0:
        return torch.zeros_like(p), S2o.expand_as(p)
    if om == 3:
        return torch.zeros_like(p), torch.minimum(p + 1, S2o)
    lo = torch.zeros_like(p) if wl == -1 else (p - wl).clamp(min=0)
    hi = S2o.expand_as(p) if wr == -1 else torch.minimum(p + wr + 1, S2o)
    return lo, torch.maximum(lo, hi)


def cmp_threshold_t(pc, S2o, S2c, r: int, cm: int):
    thr = n_visible_t(pc, r) if cm == 3 else torch.div(S2o, r, rounding_mode="floor").expand_as(pc)
    return torch.minimum(thr, S2c)


def sparse_walk_t(indices: torch.Tensor, limit: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """Vectorised :func:`sparse_walk`: bool mask ``[R, K]`` of kept slots.

    ``limit`` and ``thr`` are ``[R]``; ``indices`` is ``[R, K]`` (any int dtype)."""
    K = indices.size(-1)
    slot = torch.arange(K, device=indices.device)
    ended = torch.cumsum((indices < 0).to(torch.int32), dim=-1) > 0
    return (slot[None, :] < limit[:, None]) & ~ended & (indices < thr[:, None])


def indexer_num_valid_t(Kc, r: int, resid, S1e, i, mask_mode: int):
    if mask_mode == 0:
        return Kc.expand_as(i)
    x = Kc * r + resid - S1e + i + 1
    return torch.where(x <= 0, torch.zeros_like(x), torch.minimum(Kc, torch.div(x, r, rounding_mode="floor")))
