"""``dsattn plan``: build a plan for a workload and report how evenly it loads the cores.

A core's cost is the planner's own cost model (50 §2.2) summed over its work: whole rows at
``row.cost`` and the blocks of split rows at their block costs.  The balance figure is
``max core cost / (total cost / cores)`` (1.0 is perfect).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import fast
from .params import PlanParams, plan_params
from .ref import Plan
from .table import walk

SCENARIOS = {"swa": dict(has_cmp_kv=False, cmp_ratio=1, cmp_topk=0),
             "csa": dict(has_cmp_kv=True, cmp_ratio=4, cmp_topk=512),
             "hca": dict(has_cmp_kv=True, cmp_ratio=128, cmp_topk=0)}


def preset(name: str, seed: int = 0) -> list[tuple[int, int]]:
    """(query tokens, kv tokens) per request for a named workload."""
    g = torch.Generator().manual_seed(seed)
    if name == "decode":
        return [(1, int(x)) for x in torch.randint(8192, 131072, (32,), generator=g)]
    if name == "mixed":
        decode = [(1, int(x)) for x in torch.randint(2048, 65536, (24,), generator=g)]
        chunks = [(2048, 2048 + int(x)) for x in torch.randint(0, 30000, (2,), generator=g)]
        return chunks + decode
    if name == "prefill":
        return [(32768, 32768)]
    raise ValueError(f"preset: unknown workload {name!r}; expected decode, mixed or prefill")


@dataclass
class CoreLoad:
    core: int
    units: int       # (row, s2-block) units
    rows: int        # whole rows
    partial: int     # split-row pieces
    cost: int


def build(lengths, scenario="csa", heads=64, topk=None, cores=24, aiv=48, support_fd=False, window=127):
    sc = dict(SCENARIOS[scenario])
    if topk is not None and scenario == "csa":
        sc["cmp_topk"] = topk
    cu = [0]
    for s1, _ in lengths:
        cu.append(cu[-1] + s1)
    pp = plan_params(heads, 1, 512, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                     seqused_kv=torch.tensor([s2 for _, s2 in lengths], dtype=torch.int32), layout_q="TND",
                     aic_core_num=cores, aiv_core_num=aiv,
                     support_fd=support_fd, ori_win_left=window, **sc)
    return pp, fast.plan(pp)


def core_loads(pp: PlanParams, plan: Plan) -> list[CoreLoad]:
    rw = fast.Rows(pp)
    off = rw.off

    rows_of = rw.views
    loads = [CoreLoad(i, 0, 0, 0, 0) for i in range(plan.used_cores)]
    for s in walk(plan, rows_of):
        g = int(off[s.bn2]) + s.m
        c = loads[s.core]
        c.units += s.s2_hi - s.s2_lo
        if s.partial:
            c.partial += 1
            c.cost += int(rw.block_costs(g, s.s2_lo)[:s.s2_hi - s.s2_lo].sum())
        else:
            c.rows += 1
            c.cost += int(rw.cost[g])
    return loads


def balance(loads: list[CoreLoad], cores: int) -> float:
    total = sum(c.cost for c in loads)
    return max((c.cost for c in loads), default=0) / (total / cores) if total else 1.0


def plot(loads: list[CoreLoad], cores: int, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    total = sum(c.cost for c in loads)
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * cores), 3.5))
    costs = [c.cost for c in loads] + [0] * (cores - len(loads))
    ax.bar(range(cores), costs, color="#4c72b0")
    if total:
        ax.axhline(total / cores, color="#c44e52", linestyle="--", label="ideal (total / cores)")
        ax.legend(loc="upper right")
    ax.set_xlabel("cube core")
    ax.set_ylabel("planner cost")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
