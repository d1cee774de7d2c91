"""dsattn.common.paged.write_rows: one fixed-size write whose skipped rows leave the cache's bytes alone."""
import torch

from dsattn.common.paged import write_rows


def test_rows_by_index_and_by_block_and_slot():
    """Row targets, and ``(block, slot)`` targets into a strided view of blocks padded past their rows (vLLM's
    V4 pages): kept rows written, skipped ones and every other byte untouched, with or without a kept row."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    raw = torch.randint(0, 256, (5, 40), dtype=torch.uint8, generator=g)        # 5 blocks, 4 rows of 8 + 8 pad
    paged = raw.as_strided((5, 4, 8), (40, 8, 1))
    values = torch.randint(0, 256, (6, 8), dtype=torch.uint8, generator=g)
    slots = torch.tensor([7, -1, 0, 19, -1, 12])
    keep = slots >= 0
    want = raw.clone()
    for s, v in zip(slots.tolist(), values):
        if s >= 0:
            want[s // 4, (s % 4) * 8:(s % 4) * 8 + 8] = v
    got = raw.clone()
    view = got.as_strided((5, 4, 8), (40, 8, 1))
    write_rows(view, (slots.clamp(min=0) // 4, slots.clamp(min=0) % 4), keep, values)
    assert torch.equal(got, want)
    flat = paged.reshape(20, 8).clone()
    write_rows(flat, slots.clamp(min=0), keep, values)
    assert torch.equal(flat, want[:, :32].reshape(20, 8))
    none = raw.clone()
    write_rows(none.as_strided((5, 4, 8), (40, 8, 1)), (torch.zeros(3, dtype=torch.long),) * 2,
               torch.zeros(3, dtype=torch.bool), values[:3])
    assert torch.equal(none, raw)
