"""Large fresh CPU outputs are advised to transparent huge pages (dsattn/common/memory.py)."""
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


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="no transparent huge pages here")
def test_large_outputs_fault_in_as_huge_pages(monkeypatch):
    monkeypatch.delenv("DSATTN_HUGE_PAGES", raising=False)
    t = memory.empty_output(64 << 20, dtype=torch.uint8, device="cpu")
    t.fill_(1)
    assert _huge_kb_at(t.data_ptr() + (32 << 20)) >= 2048
    small = memory.empty_output(1 << 20, dtype=torch.uint8, device="cpu")
    assert not memory.advise_huge_pages(small)          # below MIN_BYTES: left alone


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="no transparent huge pages here")
def test_the_op_output_is_on_huge_pages(monkeypatch):
    """(64 MB: past glibc's largest mmap threshold, so a fresh mapping, never reused heap pages.)"""
    monkeypatch.delenv("DSATTN_HUGE_PAGES", raising=False)
    q, kw, _ = workloads.prefill(1024, ratio=1)         # out: 1024 x 64 x 512 bf16
    out = ops.sparse_flash_mla(q, **kw)[0]
    assert _huge_kb_at(out.data_ptr() + out.nbytes // 2) >= 2048


def test_the_switch_is_checked(monkeypatch):
    monkeypatch.setenv("DSATTN_HUGE_PAGES", "yes")
    with pytest.raises(ValueError, match="DSATTN_HUGE_PAGES"):
        memory.empty_output(16 << 20, dtype=torch.uint8, device="cpu")
    monkeypatch.setenv("DSATTN_HUGE_PAGES", "0")
    assert not memory.advise_huge_pages(torch.empty(16 << 20, dtype=torch.uint8))
