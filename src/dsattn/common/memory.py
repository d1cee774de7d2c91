"""Transparent huge pages for large CPU caches, and on request for large fresh outputs.

Caches: a decode step reads rows scattered over them, one page walk per row in 4 KB pages; in 2 MB
pages the walks mostly hit (V4-Flash CSA decode B 32: 3.12-3.16 -> 2.89-2.99 ms with its caches
on huge pages, 2-core AMX VM).  :func:`cache_zeros` allocates a cache that way: once, up front.

Outputs: an op's output is new memory on every call, and glibc maps blocks of 32 MB and more afresh
and unmaps them when freed, so every 4 KB page of it faults in on its first write (the 512 MB output
of an 8K-token V4 prefill: 131,072 faults, ~0.09 s of a 0.25 s window-attention call).  Advised to
huge pages before the first write it faults in 2 MB at a time, which was faster in a quiet process
(8K SWA prefill 245 -> 176 ms, 4K training step 1.12 -> 1.03 s) but not reliably: on this VM a
fresh huge page sometimes costs far more (the same SWA call 0.18-0.65 s from call to call, 0.87 s
median inside ``dsattn bench``), presumably where the host backs guest memory lazily.  So outputs
stay on 4 KB pages unless asked for (``DSATTN_HUGE_PAGES=outputs``); a serving process that keeps
freed memory (jemalloc / tcmalloc, glibc's tunables) avoids the faults altogether.

``DSATTN_HUGE_PAGES``: ``caches`` (default), ``outputs`` (caches and outputs) or ``off``.  Advice
only: it takes effect where the kernel's transparent huge pages are ``madvise`` or ``always``
(``/sys/kernel/mm/transparent_hugepage/enabled``), on the 2 MB-aligned part of a block, on Linux.
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
MODES = ("off", "caches", "outputs")

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


def mode() -> str:
    """``DSATTN_HUGE_PAGES``: what is advised to huge pages (see the module's docstring)."""
    value = os.environ.get("DSATTN_HUGE_PAGES", "caches")
    if value not in MODES:
        raise ValueError(f"DSATTN_HUGE_PAGES: expected one of {', '.join(MODES)}, got {value!r}")
    return value


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Advise the 2 MB-aligned pages inside CPU tensor ``t``'s bytes (8 MB or more) to be huge pages;
    call it before anything is written.  Returns whether advice was given (best effort: a failure
    leaves 4 KB pages)."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES or not _libc_madvise():
        return False
    start = t.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    return last > first and _libc_madvise()(first, last - first, MADV_HUGEPAGE) == 0


def empty_output(*shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty`` for an op's output: on huge pages when ``DSATTN_HUGE_PAGES=outputs``."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    if mode() == "outputs":
        advise_huge_pages(t)
    return t


def cache_zeros(*shape: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """A zero-filled cache (long-lived, read at scattered rows): on huge pages unless
    ``DSATTN_HUGE_PAGES=off``."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    if mode() != "off":
        advise_huge_pages(t)
    return t.zero_()
