"""Large fresh CPU outputs on transparent huge pages.

An op's output is new memory on every call, and the allocator takes a large block straight from
the kernel (glibc maps blocks of 32 MB and more afresh and unmaps them when freed): every 4 KB page
of it faults in on its first write.  The 512 MB output of an 8K-token V4 prefill takes 131,072
such faults, about 0.09 s of a 0.25 s window-attention call on a 2-core AMX machine.  Asked for
huge pages (``madvise(MADV_HUGEPAGE)``) before the first write, the same memory faults in 2 MB at
a time: 8K SWA prefill 245-255 -> 179-183 ms, CSA 618-649 -> 544-552 ms (bench/RESULTS.md notes).

Caches gain too: a decode step reads rows scattered over them, one page walk per row in 4 KB
pages; in 2 MB pages the walks mostly hit (V4-Flash CSA decode B 32: 3.12-3.16 -> 2.89-2.99 ms with
its caches collapsed to huge pages).  :func:`cache_zeros` allocates a cache that way.

This is advice, not a requirement: it takes effect where the kernel's transparent huge pages are
``madvise`` or ``always`` (``/sys/kernel/mm/transparent_hugepage/enabled``), only on the 2 MB-aligned
part of a block, and nowhere but Linux.  ``DSATTN_HUGE_PAGES=0`` turns it off (with THP ``defrag``
set to ``madvise``, a fault may compact memory first when no huge page is free).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 8 << 20            # smaller blocks: few faults, and often reused heap memory already
MADV_HUGEPAGE = 14             # <sys/mman.h> on Linux

_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        fn = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                fn = libc.madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = False
        _madvise = fn
    return _madvise


def enabled() -> bool:
    """Whether outputs are advised to huge pages: on unless ``DSATTN_HUGE_PAGES=0``."""
    value = os.environ.get("DSATTN_HUGE_PAGES", "1")
    if value not in ("0", "1"):
        raise ValueError(f"DSATTN_HUGE_PAGES: expected 0 or 1, got {value!r}")
    return value == "1" and bool(_libc_madvise())


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Advise the 2 MB-aligned pages inside CPU tensor ``t``'s bytes to be huge pages; call it before
    anything is written.  Returns whether advice was given (a best effort: failures are ignored)."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES or not enabled():
        return False
    start = t.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    return last > first and _libc_madvise()(first, last - first, MADV_HUGEPAGE) == 0


def empty_output(*shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty`` for an op's output, on huge pages where it is large and on the CPU."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t


def cache_zeros(*shape: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """A zero-filled cache (long-lived, read at scattered rows), on huge pages where it is large and on
    the CPU."""
    return empty_output(*shape, dtype=dtype, device=device).zero_()
