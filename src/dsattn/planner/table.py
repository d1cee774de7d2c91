"""The 1024-int32 plan table (50 §3): encoding, decoding into per-core work, and the checker
of the plan invariants (§5)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .params import FA_CORES, FD_CORES, TABLE_SIZE
from .ref import Plan

FD_BASE = 8 * FA_CORES


def encode(p: Plan) -> torch.Tensor:
    t = torch.zeros(TABLE_SIZE, dtype=torch.int32)
    for i, (s, e, f) in enumerate(zip(p.starts, p.ends, p.first_fd)):
        t[8 * i:8 * i + 8] = torch.tensor([1, *s, *e, f], dtype=torch.int32)
    for v, entry in enumerate(p.fd):
        t[FD_BASE + 8 * v:FD_BASE + 8 * v + 8] = torch.tensor([1, *entry, 0], dtype=torch.int32)
    return t


def decode(table: torch.Tensor) -> Plan:
    """Table -> :class:`Plan` (enabled entries only)."""
    v = [int(x) for x in table.detach().cpu().reshape(-1).tolist()]
    if len(v) != TABLE_SIZE:
        raise ValueError(f"metadata: expected {TABLE_SIZE} entries, got {len(v)}")
    starts, ends, first_fd, fd = [], [], [], []
    for i in range(FA_CORES):
        e = v[8 * i:8 * i + 8]
        if e[0] == 1:
            starts.append(tuple(e[1:4]))
            ends.append(tuple(e[4:7]))
            first_fd.append(e[7])
    for k in range(FD_CORES):
        e = v[FD_BASE + 8 * k:FD_BASE + 8 * k + 8]
        if e[0] == 1:
            fd.append(tuple(e[1:7]))
    return Plan(starts, ends, first_fd, fd)


@dataclass
class Segment:
    """A contiguous run of s2-blocks ``[s2_lo, s2_hi)`` of row ``m`` of ``bn2`` done by one core;
    ``partial`` when it is not the whole row (its state goes to FD workspace slot ``slot``)."""
    core: int
    bn2: int
    m: int
    s2_lo: int
    s2_hi: int
    partial: bool
    slot: int = -1


def walk(p: Plan, rows_of) -> list[Segment]:
    """§4: every core's range as row segments; partial rows get consecutive workspace slots
    from the core's ``firstFdDataWorkspaceIdx``."""
    segs = []
    cache: dict = {}
    for core, (start, end, first) in enumerate(zip(p.starts, p.ends, p.first_fd)):
        bn2, m, s2 = start
        k = 0
        while (bn2, m, s2) < end:
            if bn2 not in cache:
                cache[bn2] = rows_of(bn2)
            rows = cache[bn2]
            if m >= len(rows):
                bn2, m, s2 = bn2 + 1, 0, 0
                continue
            row = rows[m]
            stop = end[2] if (bn2, m) == tuple(end[:2]) else row.s2_end
            lo = max(s2, row.s2_start)
            if stop > lo:
                partial = lo > row.s2_start or stop < row.s2_end
                segs.append(Segment(core, bn2, m, lo, stop, partial, first + k if partial else -1))
                k += int(partial)
            bn2, m, s2 = bn2, m + 1, 0
    return segs


def check_invariants(p: Plan, rows_of, n_bn2: int, aic: int, aiv: int, support_fd: bool) -> None:
    """Raise AssertionError naming the first violated invariant of §5."""
    n = p.used_cores
    assert 1 <= n <= aic, f"1: usedCoreNum {n} not in [1, {aic}]"
    assert p.starts[0] == (0, 0, 0), f"2: start[0] = {p.starts[0]}"
    for i in range(1, n):
        assert p.starts[i] == p.ends[i - 1], f"2: start[{i}] = {p.starts[i]} != end[{i - 1}] = {p.ends[i - 1]}"
    assert p.ends[-1] == (n_bn2, 0, 0), f"3: end[last] = {p.ends[-1]}"
    segs = walk(p, rows_of)
    pieces: dict = {}
    for s in segs:
        pieces.setdefault((s.bn2, s.m), []).append((s.s2_lo, s.s2_hi, s.core))
    for bn2 in range(n_bn2):
        for m, row in enumerate(rows_of(bn2)):
            got = sorted(pieces.pop((bn2, m), []))
            if row.blocks == 0:
                assert not got, f"4: row {(bn2, m)} has no blocks but cores {got} work on it"
                continue
            pos = row.s2_start
            for lo, hi, core in got:
                assert lo == pos, f"4: row {(bn2, m)} blocks [{pos}, {lo}) uncovered or overlapping (core {core})"
                pos = hi
            assert pos == row.s2_end, f"4: row {(bn2, m)} covered up to {pos}, has blocks up to {row.s2_end}"
    assert not pieces, f"4: cores work on rows that do not exist: {sorted(pieces)[:3]}"
    if not support_fd:
        assert all(s[2] == 0 for s in p.starts) and all(e[2] == 0 for e in p.ends), "5: s2 != 0 without FD"
        assert all(f == 0 for f in p.first_fd) and not p.fd, "5: FD data without support_fd"
        return
    parts: dict = {}
    for s in segs:
        if s.partial:
            parts.setdefault((s.bn2, s.m), []).append(s)
    tasks = {}
    for e in p.fd:
        bn2, m, ws, split, m_start, m_num = e
        tasks.setdefault((bn2, m, ws, split), []).append((m_start, m_num))
    assert len(tasks) == len(parts), f"6: {len(tasks)} FD tasks for {len(parts)} split rows"
    assert len(p.fd) <= aiv, f"6: {len(p.fd)} FD entries > aiv_core_num {aiv}"
    next_slot = 0
    for (bn2, m, ws, split), ranges in sorted(tasks.items(), key=lambda kv: kv[0][2]):
        row_parts = parts.get((bn2, m))
        assert row_parts and len(row_parts) == split, f"6: FD task {(bn2, m)} split {split} vs {row_parts}"
        assert ws == next_slot, f"6: workspace slots not consecutive at task {(bn2, m)}"
        assert sorted(s.slot for s in row_parts) == list(range(ws, ws + split)), "6: partial rows vs slots"
        next_slot += split
        ranges.sort()
        pos = 0
        for m_start, m_num in ranges:
            assert m_start == pos and m_num > 0, f"6: FD M ranges of {(bn2, m)} do not partition"
            pos += m_num
        m_size = rows_of(bn2)[m].m_size
        assert pos == m_size, f"6: FD M ranges of {(bn2, m)} cover {pos} rows, the m-block has {m_size}"
