"""``dsattn bench``: run the benchmark families, print one table, append it to bench/RESULTS.md."""
from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

import torch

from . import attention, flashmla, others
from .harness import Result, measure_ceilings

FAMILIES = {"attention": attention.run, "indexer": others.indexer, "backward": others.backward,
            "kv_quant": others.kv_quant, "planner": others.planner, "flashmla": flashmla.run}
BASE = "dsattn (default)"
BASE_VARIANTS = (BASE, "dsattn", "dsattn fwd + grad", "dsattn (default): compiled planner",
                 "dsattn (default): NumPy fast planner")


class _Progress(list):
    """The results list, saying each row as it arrives (a full family runs for many minutes)."""

    def __init__(self, say):
        super().__init__()
        self.say, self.family = say, ""

    def append(self, r: Result) -> None:
        super().append(r)
        if self.say:
            self.say(f"{self.family}: {len(self)} rows; last: {r.workload} / {r.variant} {_seconds(r.seconds)} s")


def run(families=None, smoke=False, progress=None):
    ceil = measure_ceilings(1024 if smoke else 2048, progress=progress)
    results = _Progress(progress)
    for name in families or list(FAMILIES):
        results.family = name
        if progress:
            progress(f"{name}: starting")
        FAMILIES[name](smoke=smoke, results=results)
    return ceil, list(results)


def _speedups(results):
    """For each row: how many times faster the library's default path is than this variant."""
    base = {(r.family, r.workload): r.seconds for r in results if r.variant in BASE_VARIANTS}
    out = {}
    for r in results:
        b = base.get((r.family, r.workload))
        out[id(r)] = (r.seconds / b) if b and r.seconds == r.seconds and r.variant not in BASE_VARIANTS else None
    return out


def _seconds(s: float) -> str:
    """Four decimals, or four significant digits below a millisecond (a one-request decode step)."""
    if s != s:
        return "-"
    return f"{s:.4f}" if s >= 1e-3 else f"{s:.3e}"


def rows(ceil, results):
    sp = _speedups(results)
    for r in results:
        g = r.gflops
        yield [r.family, r.workload, r.variant, _seconds(r.seconds),
               f"{g:.1f}" if g else "-",
               f"{100 * g / ceil.bf16_gflops:.0f} %" if g and ceil.bf16_gflops else "-",
               f"{100 * g / ceil.fp32_gflops:.0f} %" if g else "-",
               f"{100 * g / ceil.best_gflops:.0f} %" if g else "-",
               _roofline_cell(r, ceil),
               f"{sp[id(r)]:.1f}x" if sp[id(r)] else "", f"{r.peak_mb:.0f}" if r.peak_mb is not None else "",
               r.note + ("; " + ", ".join(f"{k}={v}" for k, v in r.extra.items()) if r.extra else "")]


HEADER = ["family", "workload", "variant", "seconds", "GFLOP/s", "of bf16 peak", "of fp32 peak",
          "of best ceiling", "of roofline", "dsattn default faster by", "peak RSS growth MB", "note"]


def _roofline_cell(r: Result, ceil) -> str:
    roof = r.roofline(ceil)
    return f"{100 * roof[0]:.0f} % ({roof[1]})" if roof else "-"


def markdown(ceil, results, command: str) -> str:
    lines = [f"## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
             f"Command: `{command}`", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
             f"{torch.__version__}, {ceil.threads} threads. Ceilings measured in this run: "
             f"{_ceilings_md(ceil)}." + _emulation_note(), "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows(ceil, results)]
    return "\n".join(lines) + "\n\n"


def _ceilings_md(ceil) -> str:
    bf16 = (f"bf16 GEMM **{ceil.bf16_gflops:.0f} GFLOP/s**" if ceil.bf16_gflops else
            f"bf16 GEMM not timed (CPU class {ceil.cpu_class}: no bf16 units, every GEMM runs in fp32; the "
            "bf16 columns are empty)")
    return f"{bf16}, fp32 GEMM **{ceil.fp32_gflops:.0f} GFLOP/s**, copy **{ceil.copy_gbs:.1f} GB/s**"


def _emulation_note() -> str:
    how = os.environ.get("DSATTN_BENCH_EMULATION")
    return (f" Emulating {how}: that machine class's libraries, GEMM path and ceilings (the code that class runs, "
            "not its speed: this CPU's caches, ports and clocks)." if how else "")


def record(text: str, path: Path) -> None:
    if not path.exists():
        path.write_text("# Benchmark results\n\nAppended by `dsattn bench`; each section names the command that "
                        "produced it. FLOPs count only visible keys.\n\n")
    with path.open("a") as f:
        f.write(text)


def results_path() -> Path:
    """bench/RESULTS.md of the source checkout (the package lives in <root>/src/dsattn)."""
    root = Path(__file__).resolve().parents[3]
    return (root / "bench" / "RESULTS.md") if (root / "bench").is_dir() else Path("bench") / "RESULTS.md"


def main(families=None, smoke=False, record_results=True, argv=None) -> int:
    from rich.console import Console
    from rich.table import Table
    console = Console(width=max(Console().width, 200))
    with console.status("measuring") as status:
        ceil, results = run(families, smoke, progress=lambda n: status.update(f"benchmark family: {n}"))
    how = os.environ.get("DSATTN_BENCH_EMULATION", "")
    emulated = f" ({how.split(' ')[0]} emulated)" if how else ""
    table = Table(title=f"dsattn bench{' (smoke)' if smoke else ''}{emulated}: {ceil.describe()}")
    for h in HEADER:
        table.add_column(h)
    for row in rows(ceil, results):
        table.add_row(*row)
    console.print(table)
    bad = [r for r in results if r.extra and not all(v for k, v in r.extra.items() if k.startswith("matches"))]
    if record_results:
        command = "dsattn " + " ".join(argv if argv is not None else sys.argv[1:])
        record(markdown(ceil, results, command), results_path())
        console.print(f"appended to {results_path()}")
    if bad:
        console.print(f"[red]fast path disagrees with the golden in: {[r.workload for r in bad]}")
        return 1
    return 0
