"""The fast planner: the same plan as :mod:`.ref`, byte for byte, in time that does not grow
with a Python loop per m-block.

Row records of every batch are computed at once with NumPy int64 arithmetic.  The greedy
assignment jumps instead of stepping: AssignByBatch and AssignByRow evaluate their
take-conditions for all remaining batches / rows of a batch at once (prefix sums of cost)
and take everything up to the first failure; AssignByBlock does the same over the blocks
of one row at a time.
"""
from __future__ import annotations

import numpy as np

from .params import S2_BASE, PlanParams, cdiv
from .ref import Plan, split_fd


def _cost(M, N):
    return 6 * ((M + 15) // 16) + 10 * ((N + 63) // 64)


class RowView:
    """The fields of one row record that walking and checking a plan need."""
    __slots__ = ("s2_start", "s2_end", "blocks", "m_size")

    def __init__(self, s2_start, s2_end, blocks, m_size):
        self.s2_start, self.s2_end, self.blocks, self.m_size = s2_start, s2_end, blocks, m_size


class Rows:
    """Row records of all batches as flat int64 arrays; batch b owns ``[off[b], off[b+1])``."""

    def __init__(self, pp: PlanParams, costs: bool = True):
        """``costs=False``: only the geometry an executor reads (offsets, blocks, s2 ranges, the
        window's first key), not the cost model's arrays."""
        G, mb = pp.G, pp.m_base
        S1 = np.asarray(pp.S1, dtype=np.int64)
        S2 = np.asarray(pp.S2, dtype=np.int64)
        S1v = np.minimum(S1, S2)
        n_m = (S1v * G + mb - 1) // mb
        self.off = np.concatenate([[0], np.cumsum(n_m)]).astype(np.int64)
        R = int(self.off[-1])
        b = np.repeat(np.arange(pp.B, dtype=np.int64), n_m)
        idx = np.arange(R, dtype=np.int64) - self.off[b]
        s1v, s2, s1 = S1v[b], S2[b], S1[b]
        tail_g = (S1v * G) % mb
        if pp.ori_mask_mode == 4:
            pre_lu, next_lu = s1v - s2 + pp.pre, s2 - s1v
        else:
            pre_lu, next_lu = np.full(R, pp.pre, dtype=np.int64), s2 - s1v
        f = idx * mb
        l = np.minimum(f + mb, s1v * G) - 1
        if pp.no_mask:
            first, last = np.zeros(R, np.int64), s2 - 1
        else:
            first, last = f // G - pre_lu, l // G + next_lu
        empty = (s1 == 0) | (s2 == 0) | (first >= s2) | (last < 0) | (last < first)
        first = np.where(empty, 0, np.maximum(first, 0))
        last = np.where(empty, 0, np.minimum(last, s2 - 1))
        win_end = np.where(empty, 0, (last - first) // S2_BASE + 1)
        win_tail = np.where(empty, 0, (last - first + 1) % S2_BASE)
        cmp_tok = (last + 1) // pp.cmp_ratio if pp.has_cmp else np.zeros(R, np.int64)
        act = np.minimum(cmp_tok, pp.cmp_topk) if pp.is_scfa else cmp_tok
        cmp_end = np.where(act == 0, win_end, win_end + (act - 1) // S2_BASE + 1)
        cmp_tail = act % S2_BASE
        self.win_end, self.cmp_end, self.win_tail, self.cmp_tail = win_end, cmp_end, win_tail, cmp_tail
        self.first = first
        self.S1v, self.S2 = S1v, S2
        self.G, self.m_base, self.B = G, mb, pp.B
        wb, cb = win_end, cmp_end - win_end
        self.blocks = wb + cb
        self.s2_start = np.where(wb > 0, 0, win_end)
        self.s2_end = np.where(cb > 0, cmp_end, win_end)
        if not costs:
            return
        row_t = (idx == n_m[b] - 1) & (tail_g[b] != 0)
        tg = tail_g[b]
        full = _cost(mb, S2_BASE)
        # typeCost for the normal (N) and tail (T) column types of each branch
        def col_costs(tail):
            n = np.where(row_t, np.where(tg != 0, _cost(tg, S2_BASE), 0), full)
            t_nn = np.where(tail != 0, _cost(mb, tail), 0)
            t_tt = np.where((tg != 0) & (tail != 0), _cost(tg, tail), 0)
            return n, np.where(row_t, t_tt, t_nn)
        self.win_n, self.win_t = col_costs(win_tail)
        self.cmp_n, self.cmp_t = col_costs(cmp_tail)
        w_tail1, c_tail1 = (win_tail != 0).astype(np.int64), (cmp_tail != 0).astype(np.int64)
        wc = self.win_n * (wb - w_tail1) + self.win_t * w_tail1
        cc = self.cmp_n * (cb - c_tail1) + self.cmp_t * c_tail1
        w_last = np.where(w_tail1 == 1, self.win_t, self.win_n)
        c_last = np.where(c_tail1 == 1, self.cmp_t, self.cmp_n)
        self.cost = wc + cc
        self.lbc = np.where(cb > 0, c_last, w_last)
        self.high_perf = np.zeros(pp.B, dtype=bool)
        if pp.high_perf_gate:
            self.high_perf = (S1v >= S2) | (S2 - S1v + 1 < pp.cmp_topk * pp.cmp_ratio)
            hp = self.high_perf[b]
            K = pp.cmp_topk * pp.cmp_ratio
            L = np.minimum(K, last + 1)
            c = 15 * cdiv(mb, 16) + 5 * ((L + 63) // 64)
            c = np.where(L == K, c - c // 21, c)
            c = np.where(L < 2048, c - c // 18, c)
            c = np.where((L > 2048) & (L < 3392), c + c // 7, c)
            self.cost = np.where(hp, c, self.cost)

    def views(self, bn2: int) -> list[RowView]:
        """Row records of batch ``bn2`` (N2 = 1) for :func:`dsattn.planner.table.walk`; [] past the end."""
        if bn2 >= self.B:
            return []
        lo, hi = int(self.off[bn2]), int(self.off[bn2 + 1])
        return [RowView(int(a), int(b), int(n), self.m_size(bn2, m))
                for m, (a, b, n) in enumerate(zip(self.s2_start[lo:hi], self.s2_end[lo:hi], self.blocks[lo:hi]))]

    def m_size(self, bn2: int, m: int) -> int:
        """Query (row, head) pairs in m-block ``m`` of batch ``bn2`` (the last one may be short)."""
        return min(self.m_base, int(self.S1v[bn2]) * self.G - m * self.m_base)

    def block_costs(self, g: int, s2_from: int) -> np.ndarray:
        """Costs of blocks ``[s2_from, s2_end)`` of global row ``g``."""
        we, ce = int(self.win_end[g]), int(self.cmp_end[g])
        win = np.full(we, self.win_n[g], dtype=np.int64)
        if we and self.win_tail[g]:
            win[-1] = self.win_t[g]
        cmp = np.full(ce - we, self.cmp_n[g], dtype=np.int64)
        if ce > we and self.cmp_tail[g]:
            cmp[-1] = self.cmp_t[g]
        return np.concatenate([win, cmp])[s2_from - int(self.s2_start[g]):]


def plan(pp: PlanParams) -> Plan:
    rw = Rows(pp)
    B, N2 = pp.B, pp.N2
    off = rw.off
    n_rows = off[1:] - off[:-1]
    s2_num = (np.asarray(pp.S2, dtype=np.int64) + S2_BASE - 1) // S2_BASE
    if B == 0 or bool(np.all((n_rows == 0) | (s2_num == 0))):
        return Plan([(0, 0, 0)], [(B * N2, 0, 0)], [0], [])
    empty_b = (rw.S1v == 0) | (rw.S2 == 0)
    bid = np.repeat(np.arange(B), n_rows)
    batch_cost = np.where(empty_b, 0, np.bincount(bid, weights=rw.cost, minlength=B).astype(np.int64))
    batch_blocks = np.where(empty_b, 0, np.bincount(bid, weights=rw.blocks, minlength=B).astype(np.int64))
    live = rw.blocks > 0
    batch_lbc = np.zeros(B, dtype=np.int64)
    if live.any():
        last_live = np.full(B, -1, dtype=np.int64)
        np.maximum.at(last_live, bid[live], np.nonzero(live)[0])
        batch_lbc = np.where(last_live >= 0, rw.lbc[np.maximum(last_live, 0)], 0)
    max_row_cost = int(rw.cost.max()) if len(rw.cost) else 0
    total = int(batch_cost.sum()) * N2
    hp_b = rw.high_perf

    bn2, row, s2 = 0, 0, 0
    finished = False
    bn2_cost, bn2_blocks = int(batch_cost[0]), int(batch_blocks[0])

    def goto_bn2(k):
        nonlocal bn2, row, s2, finished, bn2_cost, bn2_blocks
        bn2, row, s2 = k, 0, 0
        if bn2 == B * N2:
            finished = True
        else:
            bn2_cost, bn2_blocks = int(batch_cost[bn2 // N2]), int(batch_blocks[bn2 // N2])

    def next_row():
        nonlocal row, s2
        b = bn2 // N2
        rest = np.nonzero(rw.blocks[off[b] + row + 1:off[b + 1]] > 0)[0]
        if len(rest) == 0:
            goto_bn2(bn2 + 1)
        else:
            row = row + 1 + int(rest[0])
            s2 = int(rw.s2_start[off[b] + row])

    def skip_empty():
        while not finished and batch_blocks[bn2 // N2] == 0:
            goto_bn2(bn2 + 1)

    def take_blocks(costs_taken: int, n: int, g: int):
        """Advance the cursor by n blocks of row g (cost costs_taken)."""
        nonlocal s2, bn2_cost, bn2_blocks
        s2 += n
        bn2_cost = max(0, bn2_cost - costs_taken)
        bn2_blocks -= n
        if s2 == int(rw.s2_end[g]):
            next_row()

    unassigned = total
    pre_fd, cur_split, split_row = 0, 1, None
    starts, ends, first_fd, tasks = [], [], [], []
    for i in range(pp.aic):
        if finished or unassigned <= 0:
            break
        starts.append((bn2, row, s2))
        first_fd.append(pre_fd + cur_split - 1)
        limit = unassigned // (pp.aic - i)
        if not pp.support_fd:
            limit = max(limit, max_row_cost)
        core_cost = core_blocks = 0
        # 1. AssignByBatch over bn2 units [bn2, B·N2) at once (N2 = 1: bn2 == b)
        if not finished:
            bs = np.arange(bn2, B * N2) // N2
            c = batch_cost[bs].copy()
            c[0] = bn2_cost
            cum = core_cost + np.cumsum(c)
            before = cum - c
            ok_plain = limit + batch_lbc[bs] // 2 >= cum
            ok_hp = 5 * (limit - before) > 4 * c
            ok = (c == 0) | np.where(hp_b[bs], ok_hp, ok_plain)
            n_take = int(np.argmin(ok)) if not ok.all() else len(ok)
            if n_take:
                blocks = batch_blocks[bs[:n_take]].copy()
                blocks[0] = bn2_blocks
                core_cost = int(cum[n_take - 1])
                core_blocks += int(blocks.sum())
                goto_bn2(bn2 + n_take)
        # 2. AssignByRow over the rows of the current bn2
        if not finished:
            b = bn2 // N2
            g0 = int(off[b]) + row
            gs = np.arange(g0, int(off[b + 1]))
            gs = np.concatenate([gs[:1], gs[1:][rw.blocks[gs[1:]] > 0]])
            rc = rw.cost[gs].copy()
            if s2 != int(rw.s2_start[g0]):
                rc[0] = int(rw.block_costs(g0, s2).sum())
            cum = core_cost + np.cumsum(rc)
            before = cum - rc
            ok = 5 * (limit - before) > 4 * rc if hp_b[b] else limit + rw.lbc[gs] // 2 >= cum
            n_take = int(np.argmin(ok)) if not ok.all() else len(ok)
            if n_take:
                nblk = rw.s2_end[gs[:n_take]] - rw.s2_start[gs[:n_take]]
                nblk[0] = int(rw.s2_end[g0]) - s2
                core_cost = int(cum[n_take - 1])
                core_blocks += int(nblk.sum())
                bn2_cost = max(0, bn2_cost - int(rc[:n_take].sum()))
                bn2_blocks -= int(nblk.sum())
                if n_take == len(gs):
                    goto_bn2(bn2 + 1)
                else:
                    row = int(gs[n_take] - off[b])
                    s2 = int(rw.s2_start[gs[n_take]])
        if pp.support_fd:
            while True:                                                    # 3. AssignByBlock
                skip_empty()
                if finished:
                    break
                g = int(off[bn2 // N2]) + row
                bc = rw.block_costs(g, s2)
                cum = core_cost + np.cumsum(bc)
                ok = limit + bc // 2 >= cum
                n_take = int(np.argmin(ok)) if not ok.all() else len(ok)
                if n_take == 0:
                    break
                core_cost = int(cum[n_take - 1])
                core_blocks += n_take
                take_blocks(int(bc[:n_take].sum()), n_take, g)
                if n_take < len(bc):
                    break
            skip_empty()                                                   # 4. ForceAssign
            if core_blocks == 0 and not finished:
                g = int(off[bn2 // N2]) + row
                c0 = int(rw.block_costs(g, s2)[0])
                core_cost += c0
                core_blocks += 1
                take_blocks(c0, 1, g)
        ends.append((bn2, row, s2))
        unassigned -= core_cost
        if i > 0 and cur_split > 1 and (bn2, row) != split_row:              # 5. RecordFDInfo
            fbn2, fm = split_row
            fb = fbn2 // N2
            m_size = (int(rw.S1v[fb]) * pp.G - fm * pp.m_base) if fm == int(n_rows[fb]) - 1 else pp.m_base
            tasks.append((fbn2, fm, pre_fd, cur_split, m_size))
            pre_fd += cur_split
            cur_split = 1
        if not finished and row < int(n_rows[bn2 // N2]) and s2 > int(rw.s2_start[int(off[bn2 // N2]) + row]):
            cur_split += 1
            split_row = (bn2, row)
    if not finished:
        ends[-1] = (B * N2, 0, 0)
    return Plan(starts, ends, first_fd, split_fd(tasks, pp.aiv))
