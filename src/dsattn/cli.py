"""Command line: ``dsattn demo`` and ``dsattn verify``."""
from __future__ import annotations

import argparse
import sys

import torch


def _verify(args) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from . import verify
    console = Console()
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(f"parity matrix ({args.impl} vs golden)", total=None)
        rows = verify.matrix(args.impl, quick=args.quick,
                             progress=lambda n, total: bar.update(task, completed=n, total=total))
    table = Table(title=f"dsattn verify: {args.impl} against the golden references")
    for col in ("case", "output", "rule", "max abs err", "within tol", "result"):
        table.add_column(col)
    failed = 0
    for r in rows:
        failed += not r.result.passed
        if args.failures_only and r.result.passed:
            continue
        table.add_row(r.case, r.output, r.result.rule, f"{r.result.max_abs:.2e}", f"{100 * r.result.fraction:.3f}%",
                      "[green]pass" if r.result.passed else f"[red]FAIL {r.result.detail}")
    console.print(table)
    console.print(f"{len(rows) - failed} passed, {failed} failed ({len(rows)} comparisons)")
    return 1 if failed else 0


def _demo(args) -> int:
    from . import demo
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    return 0 if demo.run(args.tokens, dtype) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dsattn", description="DeepSeek sparse attention operators")
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="run the parity matrix against the golden references")
    v.add_argument("--impl", choices=("ops", "facade", "reference"), default="ops",
                   help="implementation under test (default: the registered ops)")
    v.add_argument("--quick", action="store_true", help="fp16/bf16 only, no paged cases")
    v.add_argument("--failures-only", action="store_true", help="list failing comparisons only")
    v.set_defaults(fn=_verify)
    d = sub.add_parser("demo", help="a DeepSeek-V4-Flash CSA step, fast path vs golden")
    d.add_argument("--tokens", type=int, default=384)
    d.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    d.set_defaults(fn=_demo)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
