"""Transparent huge pages for large CPU caches, and on request for outputs (dsattn/common/memory.py)."""
import re

import pytest
import torch

from dsattn import ops
from dsattn.benchmarks import workloads
from dsattn.common import memory


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "none"
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else "none"


def _huge_kb_at(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


# 64 MB blocks: past glibc's largest mmap threshold, so fresh mappings, never reused heap pages
BIG = 64 << 20
needs_thp = pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="no transparent huge pages here")
needs_madvise = pytest.mark.skipif(_thp_mode() != "madvise", reason="huge pages here are not only on request")


@needs_thp
def test_caches_are_on_huge_pages_by_default(monkeypatch):
    monkeypatch.delenv("DSATTN_HUGE_PAGES", raising=False)
    t = memory.cache_zeros(BIG, dtype=torch.uint8)
    assert not t.any()
    assert _huge_kb_at(t.data_ptr() + BIG // 2) >= 2048
    assert not memory.advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8))   # below MIN_BYTES


@needs_madvise
def test_outputs_only_on_request(monkeypatch):
    q, kw, _ = workloads.prefill(1024, ratio=1)         # out: 1024 x 64 x 512 bf16 = 64 MB
    monkeypatch.delenv("DSATTN_HUGE_PAGES", raising=False)
    out = ops.sparse_flash_mla(q, **kw)[0]
    assert _huge_kb_at(out.data_ptr() + out.nbytes // 2) == 0
    monkeypatch.setenv("DSATTN_HUGE_PAGES", "outputs")
    out = ops.sparse_flash_mla(q, **kw)[0]
    assert _huge_kb_at(out.data_ptr() + out.nbytes // 2) >= 2048


def test_off_leaves_caches_alone(monkeypatch):
    """No advice is given. Whether the kernel backs the mapping with huge pages anyway is its own affair: a
    check of smaps here failed about once in a few dozen suite runs under THP `madvise`."""
    advised = []
    monkeypatch.setattr(memory, "advise_huge_pages", lambda t: advised.append(t) or True)
    monkeypatch.setenv("DSATTN_HUGE_PAGES", "off")
    t = memory.cache_zeros(BIG, dtype=torch.uint8)
    assert not advised and not t.any()
    monkeypatch.setenv("DSATTN_HUGE_PAGES", "caches")
    assert not memory.cache_zeros(BIG, dtype=torch.uint8).any() and len(advised) == 1


def test_the_switch_is_checked(monkeypatch):
    monkeypatch.setenv("DSATTN_HUGE_PAGES", "1")
    with pytest.raises(ValueError, match="DSATTN_HUGE_PAGES: expected one of off, caches, outputs"):
        memory.empty_output(4, dtype=torch.uint8, device="cpu")
