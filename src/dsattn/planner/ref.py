"""The golden planner: §2 of 50-metadata-planner transcribed literally, one row record and
one cursor step at a time, in plain Python integers."""
from __future__ import annotations

from dataclasses import dataclass

from .params import S2_BASE, PlanParams, cdiv


def cost(M: int, N: int) -> int:
    return 6 * cdiv(M, 16) + 10 * cdiv(N, 64)


@dataclass
class RowRecord:
    """One m-block of one batch (§2.2)."""
    cost: int
    blocks: int
    last_block_cost: int
    s2_start: int
    s2_end: int
    win_end: int          # window blocks [0, win_end)
    cmp_start: int        # compressed blocks [cmp_start, cmp_end)
    cmp_end: int
    win_tail: int
    cmp_tail: int
    tail_row: bool        # rowType T
    first: int            # clipped token range of the window
    last: int
    act: int              # compressed entries / top-k slots covered
    s1g_tail: int         # rows of the batch's tail m-block
    m_size: int           # rows (query row x head) of this m-block

    def block_cost(self, pp: PlanParams, k: int) -> int:
        """Cost of s2-block k (FD mode, §2.2): window blocks, then compressed blocks."""
        if k < self.win_end:
            return type_cost(pp, self.s1g_tail, self.tail_row, k == self.win_end - 1 and self.win_tail != 0,
                             self.win_tail)
        return type_cost(pp, self.s1g_tail, self.tail_row, k == self.cmp_end - 1 and self.cmp_tail != 0,
                         self.cmp_tail)


def type_cost(pp: PlanParams, s1g_tail: int, row_t: bool, col_t: bool, tail: int) -> int:
    m = pp.m_base
    if not row_t and not col_t:
        return cost(m, S2_BASE)
    if row_t and not col_t:
        return cost(s1g_tail, S2_BASE) if s1g_tail else 0
    if not row_t and col_t:
        return cost(m, tail) if tail else 0
    return cost(s1g_tail, tail) if s1g_tail and tail else 0


def high_perf(pp: PlanParams, b: int) -> bool:
    S1v, S2 = pp.S1v(b), pp.S2[b]
    return pp.high_perf_gate and (S1v >= S2 or S2 - S1v + 1 < pp.cmp_topk * pp.cmp_ratio)


def batch_rows(pp: PlanParams, b: int) -> list[RowRecord]:
    G, m_base = pp.G, pp.m_base
    S1, S2 = pp.S1[b], pp.S2[b]
    S1v = min(S1, S2)
    n_m = cdiv(S1v * G, m_base)
    s1g_tail = (S1v * G) % m_base
    if pp.ori_mask_mode == 4:
        pre_lu, next_lu = S1v - S2 + pp.pre, S2 - S1v + 0
    else:
        pre_lu, next_lu = pp.pre, S2 - S1v
    rows = []
    for idx in range(n_m):
        empty = False
        if S1 == 0 or S2 == 0:
            first = last = 0
            empty = True
        elif pp.no_mask:
            first, last = 0, S2 - 1
        else:
            f = idx * m_base
            l = min(f + m_base, S1v * G) - 1
            first, last = f // G - pre_lu, l // G + next_lu
        if empty or first >= S2 or last < 0 or last < first:
            win_start = win_end = win_tail = 0
            first = last = 0
        else:
            first, last = max(first, 0), min(last, S2 - 1)
            win_start = 0
            win_end = (last - first) // S2_BASE + 1
            win_tail = (last - first + 1) % S2_BASE
        cmp_start = win_end
        cmp_tok = (last + 1) // pp.cmp_ratio if pp.has_cmp else 0
        act = min(cmp_tok, pp.cmp_topk) if pp.is_scfa else cmp_tok
        cmp_end = cmp_start if act == 0 else cmp_start + (act - 1) // S2_BASE + 1
        cmp_tail = act % S2_BASE
        row_t = idx == n_m - 1 and s1g_tail != 0

        def part(start, end, tail):
            n_blk = end - start
            n_tail = 1 if tail else 0
            n_norm = n_blk - n_tail
            normal, last_c = type_cost(pp, s1g_tail, row_t, False, tail), type_cost(pp, s1g_tail, row_t, True, tail)
            c = normal * n_norm + last_c * n_tail
            return n_blk, c, (last_c if n_tail else normal)

        wb, wc, wl = part(win_start, win_end, win_tail)
        cb, cc, cl = part(cmp_start, cmp_end, cmp_tail)
        row = RowRecord(cost=wc + cc, blocks=wb + cb, last_block_cost=cl if cb > 0 else wl,
                        s2_start=win_start if wb > 0 else cmp_start, s2_end=cmp_end if cb > 0 else win_end,
                        win_end=win_end, cmp_start=cmp_start, cmp_end=cmp_end, win_tail=win_tail,
                        cmp_tail=cmp_tail, tail_row=row_t, first=first, last=last, act=act,
                        s1g_tail=s1g_tail, m_size=min(m_base, S1v * G - idx * m_base))
        if high_perf(pp, b):
            L = min(pp.cmp_topk * pp.cmp_ratio, last + 1)
            c = 15 * cdiv(m_base, 16) + 5 * cdiv(L, 64)
            if L == pp.cmp_topk * pp.cmp_ratio:
                c -= c // 21
            if L < 2048:
                c -= c // 18
            if 2048 < L < 3392:
                c += c // 7
            row.cost = c
        rows.append(row)
    return rows


@dataclass
class Plan:
    """The split result: per enabled cube core its range and first FD slot; the FD vector entries."""
    starts: list[tuple[int, int, int]]
    ends: list[tuple[int, int, int]]
    first_fd: list[int]
    fd: list[tuple[int, int, int, int, int, int]]   # (bn2, m, workspaceIdx, s2SplitNum, mStart, mNum)

    @property
    def used_cores(self) -> int:
        return len(self.starts)


def split_fd(tasks, aiv: int):
    """§2.5: spread the FD tasks (bn2, m, workspaceIdx, s2SplitNum, mSize) over the vector cores."""
    out = []
    if not tasks:
        return out
    total = sum(t[3] * t[4] for t in tasks)
    avg = cdiv(total, aiv)
    v = 0
    for t, (bn2, m, ws, split, m_size) in enumerate(tasks):
        work = split * m_size
        n = max(1, work // avg)
        n = min(n, aiv - v - (len(tasks) - t - 1))
        per = cdiv(m_size, n)
        n = cdiv(m_size, per)
        for k in range(n):
            out.append((bn2, m, ws, split, k * per, min(per, m_size - k * per)))
            v += 1
    return out


def plan(pp: PlanParams, rows=None) -> Plan:
    """§2.3-§2.5 literally."""
    rows = [batch_rows(pp, b) for b in range(pp.B)] if rows is None else rows
    N2, B = pp.N2, pp.B
    s2_base_num = [cdiv(pp.S2[b], S2_BASE) for b in range(B)]
    if all(len(rows[b]) == 0 or s2_base_num[b] == 0 for b in range(B)):
        return Plan([(0, 0, 0)], [(B * N2, 0, 0)], [0], [])
    empty_b = [pp.S1v(b) == 0 or pp.S2[b] == 0 for b in range(B)]
    batch_cost = [0 if empty_b[b] else sum(r.cost for r in rows[b]) for b in range(B)]
    batch_blocks = [0 if empty_b[b] else sum(r.blocks for r in rows[b]) for b in range(B)]
    batch_lbc = []
    for b in range(B):
        live = [r for r in rows[b] if r.blocks > 0]
        batch_lbc.append(live[-1].last_block_cost if live else 0)
    max_row_cost = max((r.cost for rs in rows for r in rs), default=0)
    total = sum(batch_cost) * N2

    st = dict(bn2=0, row=0, s2=0, finished=False, bn2_cost=batch_cost[0], bn2_blocks=batch_blocks[0])

    def bb():
        return st["bn2"] // N2

    def next_bn2():
        st["bn2"] += 1
        st["row"], st["s2"] = 0, 0
        if st["bn2"] == B * N2:
            st["finished"] = True
        else:
            st["bn2_cost"], st["bn2_blocks"] = batch_cost[bb()], batch_blocks[bb()]

    def next_row():
        rs = rows[bb()]
        st["row"] += 1
        while st["row"] < len(rs) and rs[st["row"]].blocks == 0:
            st["row"] += 1
        if st["row"] >= len(rs):
            next_bn2()
        else:
            st["s2"] = rs[st["row"]].s2_start

    def skip_empty():
        while not st["finished"] and batch_blocks[bb()] == 0:
            next_bn2()

    def cur_row():
        return rows[bb()][st["row"]]

    def remaining_row_cost():
        r = cur_row()
        if st["s2"] == r.s2_start:
            return r.cost
        return sum(r.block_cost(pp, k) for k in range(st["s2"], r.s2_end))

    def take_block():
        r = cur_row()
        c = r.block_cost(pp, st["s2"])
        st["s2"] += 1
        st["bn2_cost"] = max(0, st["bn2_cost"] - c)
        st["bn2_blocks"] -= 1
        if st["s2"] == r.s2_end:
            next_row()
        return c

    unassigned = total
    pre_fd, cur_split, split_row = 0, 1, None
    starts, ends, first_fd, tasks = [], [], [], []
    aic = pp.aic
    for i in range(aic):
        if st["finished"] or unassigned <= 0:
            break
        starts.append((st["bn2"], st["row"], st["s2"]))
        first_fd.append(pre_fd + cur_split - 1)
        avg = unassigned // (aic - i)
        limit = avg if pp.support_fd else max(avg, max_row_cost)
        core_cost = core_blocks = 0
        while not st["finished"]:                                       # 1. AssignByBatch
            b, c = bb(), st["bn2_cost"]
            if high_perf(pp, b):
                ok = c == 0 or 5 * (limit - core_cost) > 4 * c
            else:
                ok = c == 0 or limit + batch_lbc[b] // 2 >= core_cost + c
            if not ok:
                break
            core_cost += c
            core_blocks += st["bn2_blocks"]
            next_bn2()
        while not st["finished"]:                                       # 2. AssignByRow
            b, r = bb(), cur_row()
            rc = remaining_row_cost()
            if high_perf(pp, b):
                ok = 5 * (limit - core_cost) > 4 * rc
            else:
                ok = limit + r.last_block_cost // 2 >= core_cost + rc
            if not ok:
                break
            core_cost += rc
            core_blocks += r.s2_end - st["s2"]
            st["bn2_cost"] = max(0, st["bn2_cost"] - rc)
            st["bn2_blocks"] -= r.s2_end - st["s2"]
            before = st["bn2"]
            next_row()
            if st["finished"] or st["bn2"] != before:
                break
        if pp.support_fd:
            while True:                                                 # 3. AssignByBlock
                skip_empty()
                if st["finished"]:
                    break
                r = cur_row()
                c = r.block_cost(pp, st["s2"])
                if not (limit + c // 2 >= core_cost + c):
                    break
                core_cost += take_block()
                core_blocks += 1
            skip_empty()                                                # 4. ForceAssign
            if core_blocks == 0 and not st["finished"]:
                core_cost += take_block()
                core_blocks += 1
        ends.append((st["bn2"], st["row"], st["s2"]))
        unassigned -= core_cost
        if i > 0 and cur_split > 1 and (st["bn2"], st["row"]) != split_row:     # 5. RecordFDInfo
            fbn2, fm = split_row
            fb = fbn2 // N2
            m_size = (pp.S1v(fb) * pp.G - fm * pp.m_base) if fm == len(rows[fb]) - 1 else pp.m_base
            tasks.append((fbn2, fm, pre_fd, cur_split, m_size))
            pre_fd += cur_split
            cur_split = 1
        if (not st["finished"] and st["row"] < len(rows[bb()])
                and st["s2"] > rows[bb()][st["row"]].s2_start):
            cur_split += 1
            split_row = (st["bn2"], st["row"])
    if not st["finished"]:
        ends[-1] = (B * N2, 0, 0)
    return Plan(starts, ends, first_fd, split_fd(tasks, pp.aiv))
