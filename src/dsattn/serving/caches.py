"""Paged-cache plumbing of 60-serving §2 and §8: writing rows by flat slot, and the int32-safe
last-location lookup.

Both read device data only in their content checks (on by default, skipped during CUDA graph
capture, 00 §10): slots, pool indices and prefix lengths out of range are a ``ValueError``."""
from __future__ import annotations

import torch

from ..common.checks import check_same_device, check_slots, content_checks_enabled, fail, host_ints
from ..common.paged import write_rows


def store_rows(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``cache.view(-1, *row_shape)[slot] = rows[i]`` for every ``slot >= 0``; -1 skips the row.

    ``cache`` is ``[num_pages, page_size, *row_shape]``, ``rows`` ``[N, *row_shape]`` of the
    cache's dtype, ``slot_mapping`` int32 / int64 ``[N]``.  Other negative slots and slots past
    the cache are a ``ValueError`` (content check).  No device data is read otherwise: skipped
    rows are handled by one fixed-size write (:func:`dsattn.common.paged.write_rows`)."""
    if cache.dim() < 2:
        fail("cache", f"expected [num_pages, page_size, *row_shape], got shape {tuple(cache.shape)}")
    if cache.device.type == "meta":
        fail("cache", "is on the meta device (shapes only, no storage) but store_rows writes rows into it; "
             "allocate the cache on a real device")
    check_same_device(cache=cache, rows=rows, slot_mapping=slot_mapping)
    row_shape = tuple(cache.shape[2:])
    if rows.dtype != cache.dtype:
        fail("rows", f"dtype {rows.dtype} does not match the cache's {cache.dtype}", TypeError)
    if rows.dim() != 1 + len(row_shape) or tuple(rows.shape[1:]) != row_shape:
        fail("rows", f"expected shape [N, {', '.join(map(str, row_shape))}], got {tuple(rows.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        fail("slot_mapping", f"dtype {slot_mapping.dtype} is not supported; expected int32 or int64", TypeError)
    if slot_mapping.dim() != 1 or slot_mapping.size(0) != rows.size(0):
        fail("slot_mapping", f"expected shape [N={rows.size(0)}], got {tuple(slot_mapping.shape)}")
    total = cache.size(0) * cache.size(1)
    if content_checks_enabled(cache, slot_mapping):
        check_slots(slot_mapping, total)
    flat = cache.view(total, -1)
    slots = slot_mapping.to(torch.int64)
    write_rows(flat, slots.clamp(min=0), slots >= 0, rows.reshape(rows.size(0), -1))


def get_last_loc(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                 prefix_lens: torch.Tensor) -> torch.Tensor:
    """Slot of each request's last cached token (60 §8): ``req_to_token[req, prefix - 1]``, or -1
    when the prefix is empty.  The flat offset is formed in 64-bit arithmetic, an empty prefix
    never reads (no wrap-around to the last column), the element is loaded and kept as int32,
    and the widening to int64 is a separate cast at the end."""
    if req_to_token.dtype != torch.int32:
        fail("req_to_token", f"dtype {req_to_token.dtype} is not supported; expected torch.int32", TypeError)
    if req_to_token.dim() != 2:
        fail("req_to_token", f"expected [num_req_slots, max_context], got shape {tuple(req_to_token.shape)}")
    for name, t in (("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            fail(name, f"dtype {t.dtype} is not supported; expected int32 or int64", TypeError)
        if t.dim() != 1 or t.size(0) != req_pool_indices.size(0):
            fail(name, f"expected shape [B={req_pool_indices.size(0)}], got {tuple(t.shape)}")
    if content_checks_enabled(req_to_token, req_pool_indices, prefix_lens):
        slots, ctx = req_to_token.shape
        for b, (r, p) in enumerate(zip(host_ints(req_pool_indices), host_ints(prefix_lens))):
            if not 0 <= r < slots:
                fail("req_pool_indices", f"value {r} at batch {b} is not a request slot in [0, {slots})")
            if not 0 <= p <= ctx:
                fail("prefix_lens", f"value {p} at batch {b} is not in [0, max_context={ctx}]")
    req = req_pool_indices.to(torch.int64)
    pre = prefix_lens.to(torch.int64)
    has = pre > 0
    # Advanced indexing forms the element offset req·stride0 + col·stride1 in int64 (pools × context
    # lengths exceed 2^31) and never copies the pool; an empty prefix reads column 0, never -1.
    col = torch.where(has, pre - 1, torch.zeros_like(pre))
    loc32 = torch.where(has, req_to_token[req, col], torch.full((), -1, dtype=torch.int32, device=req_to_token.device))
    return loc32.to(torch.int64)
