"""Command line: ``dsattn demo``, ``dsattn verify``, ``dsattn plan`` and ``dsattn bench``.

Bad arguments are one line on stderr naming the argument, exit code 2 (argparse's checks with a
one-line :class:`_Parser`, value ranges in the types, the planner's own checks translated to
the flags that carry them)."""
from __future__ import annotations

import argparse
import contextlib
import sys

import torch


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line on stderr, ``dsattn <command>: error: <argument>: <why>``, and
    exit code 2: never a traceback."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    parse.__name__ = f"int >= {lo}"
    return parse


INT32_MAX = 2**31 - 1


def _parse_lengths(text: str) -> list[tuple[int, int]]:
    """``"1:8192,1:65536,2048:4096"`` -> [(q tokens, kv tokens), ...]; ``"N"`` alone means N:N."""
    out = []
    for item in text.split(","):
        q, sep, kv = item.strip().partition(":")
        try:
            pair = (int(q), int(kv if sep else q))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected 'q_tokens:kv_tokens' pairs of ints separated by commas, "
                                             f"got {item.strip()!r} in {text!r}") from None
        if pair[0] < 0 or pair[1] < 0:
            raise argparse.ArgumentTypeError(f"token counts must be >= 0, got {item.strip()!r}")
        if max(pair) > INT32_MAX:                  # the planner's length mirrors are int32
            raise argparse.ArgumentTypeError(f"token counts must be <= {INT32_MAX} (int32 lengths), "
                                             f"got {item.strip()!r}")
        out.append(pair)
    return out


def _fuzz(args) -> int:
    from rich.console import Console

    from .cases import fuzz
    console = Console()
    families = [args.family] if args.family else list(fuzz.FAMILIES)
    seed = args.seed if args.seed is not None else int(torch.randint(0, 2**31 - 10**7, ()).item())
    failed = 0
    for fam in families:
        rep = fuzz.check_seeds(fam, range(seed, seed + args.fuzz))
        failed += len(rep.failures)
        status = "[green]pass" if not rep.failures else f"[red]{len(rep.failures)} failing"
        console.print(f"{fam:>10}: {rep.configs} configurations (seeds {seed}..{seed + args.fuzz - 1}), "
                      f"{rep.compared} outputs compared: {status}")
        for line in rep.failures:
            console.print(f"  {line}", markup=False, highlight=False)
    return 1 if failed else 0


def _batch_invariance(args) -> int:
    from rich.console import Console

    from . import native
    from .cases import invariance
    console = Console()
    if args.family is not None and args.family not in invariance.FAMILIES:
        print(f"dsattn verify: error: --family: {args.family!r} has no batch-invariance check; expected one of "
              f"{', '.join(invariance.FAMILIES)}", file=sys.stderr)
        return 2
    families = [args.family] if args.family else list(invariance.FAMILIES)
    seed = args.seed if args.seed is not None else int(torch.randint(0, 2**31 - 10**7, ()).item())
    gemm = contextlib.nullcontext()
    module = native.kernels()
    vendor = [str(d).split(".")[-1] for d in (torch.bfloat16, torch.float16) if not native.gemm_is_own(d)]
    if module is not None and vendor:
        kinds = ", ".join(f"{d}: {module.attention_gemm(d)}" for d in vendor)
        if native.gemm_requested() == "best":
            console.print(f"this CPU's best GEMMs run on oneDNN's kernels ({kinds}), where no batch invariance is "
                          "promised: checking dsattn's own GEMMs (DSATTN_NATIVE_GEMM=own)")
            gemm = native.gemm_path("own")
        else:
            console.print(f"DSATTN_NATIVE_GEMM={native.gemm_requested()} runs oneDNN's kernels ({kinds}), where no "
                          "batch invariance is promised: differences there are oneDNN's")
    from .weights import batch_invariant
    if "weights" in families:
        console.print("the quantised linears run in their batch-invariant mode (DSATTN_BATCH_INVARIANT=1: every call "
                      "streamed, one summation order for every M)")
    with gemm, batch_invariant():
        return _batch_invariance_families(console, invariance, families, seed, args.batch_invariance)


def _batch_invariance_families(console, invariance, families, seed: int, count: int) -> int:
    failed = 0
    for fam in families:
        n, failures = invariance.check_seeds(fam, range(seed, seed + count))
        failed += len(failures)
        status = "[green]bit-identical" if not failures else f"[red]{len(failures)} differing"
        console.print(f"{fam:>10}: {n} configurations (seeds {seed}..{seed + n - 1}), each request alone vs. in "
                      f"its batch, 1 vs. {torch.get_num_threads()} threads: {status}")
        for line in failures:
            console.print(f"  {line}", markup=False, highlight=False)
    return 1 if failed else 0


def _verify(args) -> int:
    if args.impl == "triton":
        import os
        os.environ["DSATTN_BACKEND"] = "triton"
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")           # before triton is first imported
    if args.fuzz is not None:
        return _fuzz(args)
    if args.batch_invariance is not None:
        return _batch_invariance(args)
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
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype or
                                                                                 ("bf16" if args.ops else "fp32")]
    if args.ops:
        from . import demo
        return 0 if demo.run(args.tokens, dtype) else 1
    from . import serving_demo
    return 0 if serving_demo.run(args.requests, args.decode_steps, args.preset, dtype, args.budget,
                                 kv_cache=args.kv_cache) else 1


# the planner's argument names, as the plan command spells them
_PLAN_FLAGS = {"aic_core_num": "--cores", "aiv_core_num": "--aiv", "ori_win_left": "--window",
               "num_heads_q": "--heads", "cmp_topk": "--topk", "seqused_kv": "--lengths", "cu_seqlens_q": "--lengths"}


def _build(args) -> int:
    """``dsattn build``: build (or find) the compiled layer now, e.g. in an image build step, and say where."""
    import warnings

    from . import native
    if not native.requested():
        print("dsattn build: error: DSATTN_NATIVE=0 asks for no compiled layer", file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        module = native.load()
    if module is None:
        print(f"dsattn build: {native.status()}", file=sys.stderr)
        return 1
    print(f"{native.status()}\nmodule: {module.__file__}")
    return 0


def _plan(args) -> int:
    try:
        return _plan_table(args)
    except (ValueError, TypeError, NotImplementedError) as e:     # the planner's own checks of our values
        name, sep, why = str(e).partition(": ")
        print(f"dsattn plan: error: {_PLAN_FLAGS.get(name, name)}{sep}{why}", file=sys.stderr)
        return 2


def _plan_table(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .planner import report
    lengths = args.lengths if args.lengths is not None else report.preset(args.preset)
    pp, plan = report.build(lengths, args.scenario, args.heads, args.topk, args.cores, args.aiv, args.fd, args.window)
    loads = report.core_loads(pp, plan)
    total = sum(c.cost for c in loads)
    ideal = total / args.cores if total else 0
    console = Console()
    label = ",".join(f"{a}:{b}" for a, b in args.lengths) if args.lengths is not None else f"preset {args.preset}"
    table = Table(title=f"dsattn plan: {args.scenario.upper()}, {len(lengths)} requests ({label[:60]}), "
                        f"{args.cores} cores{', split-KV' if args.fd else ''}")
    for col in ("core", "range (bn2, m, s2)", "whole rows", "split pieces", "units", "cost", "share of ideal"):
        table.add_column(col, justify="right")
    for c, start, end in zip(loads, plan.starts, plan.ends):
        span = f"{start[0]},{start[1]},{start[2]} → {end[0]},{end[1]},{end[2]}"
        table.add_row(str(c.core), span, str(c.rows), str(c.partial), str(c.units), str(c.cost),
                      f"{c.cost / ideal:.2f}" if ideal else "-")
    console.print(table)
    console.print(f"enabled cores {plan.used_cores}/{args.cores}, FD tasks "
                  f"{len({(e[0], e[1]) for e in plan.fd})} on {len(plan.fd)} vector cores, total cost {total}, "
                  f"balance (max core / ideal) [bold]{report.balance(loads, args.cores):.3f}[/bold]")
    if args.plot:
        try:
            report.plot(loads, args.cores, args.plot, f"{args.scenario.upper()} plan, {len(lengths)} requests")
        except OSError as e:
            print(f"dsattn plan: error: --plot: cannot write {args.plot!r}: {e.strerror or e}", file=sys.stderr)
            return 2
        console.print(f"wrote {args.plot}")
    return 0


# ``--emulate-<class>``: a smaller machine's code on this one, in a fresh process: dsattn's compiled layer
# capped at that class (DSATTN_CPU_ISA: GEMM path, decoders, vector loops) and oneDNN, MKL and ATen's
# kernels limited to it (on AVX2, PyTorch's bf16 matmul falls to ~1 GFLOP/s, as there).
EMULATE_FLAGS = {"emulate_avx2": "avx2", "emulate_avx512": "avx512", "emulate_avx512bf16": "avx512_bf16"}


def _bench_emulated(args, cls: str) -> int:
    """The same command in a fresh interpreter (the libraries read these variables once, when they start)
    with the class's variables set."""
    import os
    import subprocess
    from .native import isa
    emulation = isa.environment(cls)
    env = dict(os.environ, **emulation, DSATTN_BENCH_EMULATION=f"{cls} (--emulate-{cls.replace('_', '')}: "
               + ", ".join(f"{k}={v}" for k, v in emulation.items()) + ")")
    code = "import sys; from dsattn.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args.argv], env=env).returncode


def _bench(args) -> int:
    import os
    asked = [flag for flag in EMULATE_FLAGS if getattr(args, flag)]
    if len(asked) > 1:
        names = " and ".join("--" + f.replace("_", "-") for f in asked)
        print(f"dsattn bench: error: {names} exclude each other", file=sys.stderr)
        return 2
    if asked and "DSATTN_BENCH_EMULATION" not in os.environ:
        from .native import isa
        cls = EMULATE_FLAGS[asked[0]]
        if isa.CLASSES.index(cls) > isa.CLASSES.index(isa.cpu_class()):
            print(f"dsattn bench: error: --{asked[0].replace('_', '-')}: this CPU's class is {isa.cpu_class()!r}, "
                  f"below {cls!r}", file=sys.stderr)
            return 2
        return _bench_emulated(args, cls)
    if args.which:
        from .which import describe
        print(describe())
        return 0
    if args.family and "gpu" in args.family:
        return _bench_gpu_static(args)
    from .benchmarks import runner
    return runner.main(args.family or None, smoke=args.smoke, record_results=not args.no_record, argv=args.argv)


def _bench_gpu_static(args) -> int:
    """``dsattn bench --family gpu --static``: the AOT compile table of the Triton kernels (no GPU needed)."""
    if not args.static:
        print("dsattn bench: error: --family gpu: timing needs a GPU (bench/gpu.py); without one use --static",
              file=sys.stderr)
        return 2
    from .gpu_static import run_in_subprocess
    res = run_in_subprocess(quick=args.smoke)
    print(res.stdout, end="")
    if res.returncode:
        print(res.stderr[-4000:], file=sys.stderr)
        return res.returncode
    if not args.no_record:
        from .benchmarks.runner import record, results_path
        record(f"## `dsattn {' '.join(args.argv)}`\n\nTriton kernels compiled ahead of time (no GPU): shared memory, "
               f"warps, stages, registers and spills (ptxas -v / AMDGCN metadata), occupancy estimate.\n\n"
               f"{res.stdout}\n", results_path())
        print(f"appended to {results_path()}")
    return 0


def main(argv=None) -> int:
    parser = _Parser(prog="dsattn", description="DeepSeek sparse attention operators")
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="run the parity matrix against the golden references")
    v.add_argument("--impl", choices=("ops", "facade", "reference", "triton"), default="ops",
                   help="implementation under test (default: the registered ops; triton: the ops with "
                        "DSATTN_BACKEND=triton, under Triton's interpreter without a GPU)")
    v.add_argument("--quick", action="store_true", help="fp16/bf16 only, no paged cases")
    v.add_argument("--failures-only", action="store_true", help="list failing comparisons only")
    v.add_argument("--fuzz", type=_int_at_least(1), metavar="N",
                   help="instead: N random configurations per operator family against the goldens, every row "
                        "no valid query may read poisoned (NaN / 0xFF); failures print their reproduction")
    v.add_argument("--batch-invariance", type=_int_at_least(1), metavar="N",
                   help="instead: N random batches per family; every request's rows must be the same bits alone "
                        "as in its batch, and the batch the same on 1 thread as on all")
    v.add_argument("--family", choices=("mla", "sharedkv", "packed", "indexer", "qindexer", "kl", "qsfa", "compressor",
                                           "weights"),
                   help="with --fuzz / --batch-invariance: one family only")
    v.add_argument("--seed", type=_int_at_least(0),
                   help="with --fuzz / --batch-invariance: the first seed (default: random)")
    v.set_defaults(fn=_verify)
    d = sub.add_parser("demo", help="serving simulation: chunked prefill + decode through SWA/CSA/HCA layers")
    d.add_argument("--requests", type=_int_at_least(1), default=32, help="ragged requests (serving simulation)")
    d.add_argument("--decode-steps", "--steps", dest="decode_steps", type=_int_at_least(0), default=24,
                   help="decode steps after the chunked prefill")
    d.add_argument("--budget", type=_int_at_least(1), default=512, help="tokens per chunked-prefill step")
    d.add_argument("--preset", choices=("small", "v4-flash"), default="small",
                   help="layer dimensions: 'small' runs in seconds, 'v4-flash' is the real attention")
    d.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="default: fp32 (serving simulation), bf16 (--ops)")
    d.add_argument("--kv-cache", choices=("model", "int8", "fp8"), default="model",
                   help="window / compressed KV caches in the model dtype, or as packed int8 / fp8 rows")
    d.add_argument("--ops", action="store_true",
                   help="instead: one V4-Flash CSA step, each operator's fast path against its golden")
    d.add_argument("--tokens", type=_int_at_least(1), default=384, help="tokens of the --ops step")
    d.set_defaults(fn=_demo)
    p = sub.add_parser("plan", help="build a sparse_attn_sharedkv_metadata plan and show the per-core load")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", type=_parse_lengths,
                     help="per request 'q_tokens:kv_tokens', comma separated (e.g. 1:8192,2048:4096)")
    src.add_argument("--preset", choices=("decode", "mixed", "prefill"), default="decode",
                     help="decode: 32 requests at 8K-128K; mixed: 2 prefill chunks + 24 decodes; prefill: one 32K")
    p.add_argument("--scenario", choices=("swa", "csa", "hca"), default="csa")
    p.add_argument("--heads", type=_int_at_least(1), default=64, help="query heads N1 (V4-Flash 64, V4-Pro 128)")
    p.add_argument("--topk", type=int, choices=(512, 1024), default=None, help="CSA top-k (default 512)")
    p.add_argument("--window", type=_int_at_least(-1), default=127, help="ori_win_left")
    p.add_argument("--cores", type=_int_at_least(1), default=24, help="cube cores (aic_core_num, 1..36)")
    p.add_argument("--aiv", type=_int_at_least(1), default=48, help="vector cores (aiv_core_num, 1..72)")
    p.add_argument("--fd", action="store_true", help="allow split-KV (support_fd)")
    p.add_argument("--plot", metavar="FILE", help="write a PNG bar chart of per-core cost")
    p.set_defaults(fn=_plan)
    bl = sub.add_parser("build", help="build the compiled CPU layer now (else it builds on first use) and say where")
    bl.set_defaults(fn=_build)
    bn = sub.add_parser("bench", help="CPU benchmarks: ceilings, every family's workloads, RESULTS.md")
    bn.add_argument("--family", action="append",
                    choices=("attention", "indexer", "backward", "kv_quant", "planner", "flashmla", "gpu"),
                    help="run only this family (repeatable); gpu: the Triton kernels (--static: the AOT compile "
                         "table)")
    bn.add_argument("--static", action="store_true", help="with --family gpu: compile for GPU targets, no GPU needed")
    bn.add_argument("--smoke", action="store_true", help="tiny shapes: checks the scripts run and match the golden")
    bn.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    bn.add_argument("--emulate-avx2", action="store_true",
                    help="run as an AVX2-only machine would: oneDNN / MKL / ATen limited to AVX2 and the compiled "
                         "layer capped there (DSATTN_CPU_ISA=avx2: fp32 GEMMs, AVX2 loops), in a fresh process "
                         "(its ceilings measured there too)")
    bn.add_argument("--emulate-avx512", action="store_true",
                    help="run as an AVX-512 CPU without BF16 would (Skylake-SP .. Ice Lake): the same, capped at "
                         "avx512")
    bn.add_argument("--emulate-avx512bf16", action="store_true",
                    help="run as an AVX512-BF16 CPU without AMX would (Zen 4 / 5 EPYC): oneDNN limited to "
                         "AVX512_CORE_BF16, the compiled kernels' vdpbf16ps micro-kernel, in a fresh process")
    bn.add_argument("--which", action="store_true",
                    help="instead: print which implementation each piece runs on this machine and exit")
    bn.set_defaults(fn=_bench)
    args = parser.parse_args(argv)
    if args.command == "verify" and args.fuzz is None and args.batch_invariance is None \
            and (args.family or args.seed is not None):
        v.error("--family and --seed go with --fuzz N or --batch-invariance N")
    if args.command == "verify" and args.fuzz is not None and args.batch_invariance is not None:
        v.error("--fuzz and --batch-invariance exclude each other")
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
