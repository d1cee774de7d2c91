"""The 1024-int32 plan table (50 §3): encoding, decoding into per-core work, and the checker
of the plan invariants (§5)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
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
    v = table.detach().cpu().reshape(-1).to(torch.int64).numpy()
    if v.size != TABLE_SIZE:
        raise ValueError(f"metadata: expected {TABLE_SIZE} entries, got {v.size}")
    fa = v[:FD_BASE].reshape(FA_CORES, 8)
    fa = fa[fa[:, 0] == 1].tolist()
    fd = v[FD_BASE:FD_BASE + 8 * FD_CORES].reshape(FD_CORES, 8)
    fd = fd[fd[:, 0] == 1].tolist()
    return Plan([tuple(e[1:4]) for e in fa], [tuple(e[4:7]) for e in fa], [e[7] for e in fa],
                [tuple(e[1:7]) for e in fd])


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
    _check_chain(p, n_bn2, aic)
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
    _check_fd(p, segs, lambda bn2, m: rows_of(bn2)[m].m_size, aiv, support_fd)


def _check_chain(p: Plan, n_bn2: int, aic: int) -> None:
    """Invariants 1-3: the enabled cores' ranges follow one another from (0, 0, 0) to the end."""
    n = p.used_cores
    assert 1 <= n <= aic, f"1: usedCoreNum {n} not in [1, {aic}]"
    assert p.starts[0] == (0, 0, 0), f"2: start[0] = {p.starts[0]}"
    for i in range(1, n):
        assert p.starts[i] == p.ends[i - 1], f"2: start[{i}] = {p.starts[i]} != end[{i - 1}] = {p.ends[i - 1]}"
    assert p.ends[-1] == (n_bn2, 0, 0), f"3: end[last] = {p.ends[-1]}"


def _check_fd(p: Plan, segs, m_size_of, aiv: int, support_fd: bool) -> None:
    """Invariants 5-6: FD data only with support_fd; the FD tasks match the split rows' partial
    segments, their workspace slots and their M ranges.  ``segs``: every segment, or the partial ones."""
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
        m_size = m_size_of(bn2, m)
        assert pos == m_size, f"6: FD M ranges of {(bn2, m)} cover {pos} rows, the m-block has {m_size}"


def _position(t, off: list, B: int) -> tuple[int, int]:
    """Global (row, s2) of a core range bound ``t = (bn2, m, s2)`` as :func:`walk` moves: row m of
    batch b is ``off[b] + m``, a position past a batch's rows is the next batch's first row, and
    past the last batch is the end (row ``off[B]``)."""
    b, m, s = t
    if min(t) < 0:
        raise AssertionError(f"0: negative entry in the core range bound {t}")
    if b >= B:
        return off[B], 0
    if m >= off[b + 1] - off[b]:
        return off[b + 1], 0
    return off[b] + m, s


@dataclass
class Coverage:
    """A plan's work in the executor's terms: ``whole``, the global row records (``Rows``
    numbering: batch b's rows are ``off[b] + m``) that one core holds whole, ascending; and the
    ``partial`` segments of split rows with their workspace slots, in :func:`walk`'s order."""
    whole: np.ndarray
    partial: list[Segment]


def coverage(p: Plan, rw) -> Coverage:
    """:func:`walk` over the row arrays of a :class:`~dsattn.planner.fast.Rows`, vectorised: a
    core's range covers the tail of its first row, every row in between whole and the head of
    its last row, so only the (at most two) edge rows of each core are looked at one by one
    (positions: :func:`_position`).  (Every row record starts at s2-block 0, so a row's blocks
    are ``[0, blocks)``.)"""
    off, blocks, B = rw.off.tolist(), rw.blocks, rw.B
    R = off[-1]

    def position(t):
        return _position(t, off, B)

    # rows held whole: the interiors of the cores' ranges as [lo, hi) bounds (summed into one
    # mask at the end), and edge rows a core holds whole
    lo_hi, single, partial = [], [], []
    for core, (start, end, first) in enumerate(zip(p.starts, p.ends, p.first_fd)):
        (gs, ss), (ge, se) = position(start), position(end)
        if (gs, ss) >= (ge, se):
            continue
        k = 0
        edges = [(gs, ss, se if ge == gs else int(blocks[gs]))] if gs < R else []
        if ge > gs:
            lo_hi.append((gs + 1, ge))
            if ge < R and se > 0:
                edges.append((ge, 0, se))
        for g, lo, hi in edges:
            if hi <= lo:
                continue
            if lo > 0 or hi < blocks[g]:
                b = bisect.bisect_right(off, g) - 1
                partial.append(Segment(core, b, g - off[b], lo, hi, True, first + k))
                k += 1
            else:
                single.append(g)
    held = np.zeros(R + 1, dtype=np.int64)
    if lo_hi:
        bounds = np.asarray(lo_hi, dtype=np.int64)
        np.add.at(held, bounds[:, 0], 1)
        np.add.at(held, bounds[:, 1], -1)
    held = np.cumsum(held[:R])
    np.add.at(held, np.asarray(single, dtype=np.int64), 1)
    held[blocks == 0] = 0
    # (a row held by two cores, which only a broken plan does, is listed twice: the executor's
    # count of computed rows then catches it)
    return Coverage(np.repeat(np.arange(R), held), partial)


def check_coverage(p: Plan, rw, cov: Coverage, n_bn2: int, aic: int, aiv: int, support_fd: bool) -> None:
    """:func:`check_invariants` for a plan read through :func:`coverage`, without a per-row loop.

    Invariant 4 (every block of every row done exactly once) is checked on block coordinates:
    position (row g, s2 s) is block ``cum_blocks[g] + s`` of the whole call.  The chained core
    ranges (invariants 1-3) tile the blocks exactly once when no core's range runs backwards
    in blocks and no range bound points past its row's blocks.  (Stricter than the golden
    checker in one degenerate case only: a bound past its row's blocks where no block is
    covered twice, which no planner writes.)"""
    _check_chain(p, n_bn2, aic)
    off, blocks = rw.off.tolist(), rw.blocks
    cum = np.concatenate([[0], np.cumsum(blocks)])

    def block_of(t):
        g, s = _position(t, off, rw.B)
        if s:
            assert s <= blocks[g], f"4: row {t[:2]} has blocks up to {int(blocks[g])} but a core range bound is {t}"
        return int(cum[g]) + s

    for core, (start, end) in enumerate(zip(p.starts, p.ends)):
        assert block_of(start) <= block_of(end), f"4: core {core} range {start} -> {end} runs backwards"
    _check_fd(p, cov.partial, rw.m_size, aiv, support_fd)
