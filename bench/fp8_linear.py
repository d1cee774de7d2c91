"""dsattn's FP8 block-scaled linear (``fp8_block_linear``: e4m3 codes read in place, one scale per 128 x 128 block,
bf16 activations) on DeepSeek-V3.2 and V4-Flash layer shapes, side by side with the same product on a bf16 weight
(``x @ W.T``: the checkpoint dequantised offline, twice the bytes; V4-Flash's MXFP4 routed experts through
``mxfp4_linear``, four times) and, where vLLM's AMX kernel runs, vLLM's own
``fp8_scaled_mm_cpu`` -- with the machine's copy bandwidth and GEMM ceilings measured in the same run.  dsattn's
kernel runs in both its modes side by side: the default (rows of up to 8 streamed, larger calls tiled on the GEMM
path) and the batch-invariant one (``dsattn.weights.batch_invariant``: every call streamed, one summation order for
every M).  Where vLLM's kernel runs, it ends with the kernel the plug-in serves each layer with (a rule, not a timing).

Decode-shaped calls (M 1-8) report the weight bytes read a second against the copy bandwidth (each call reads
another copy of the layer: the copies together exceed the last-level cache, as a model's layers do) and against
the roofline: at 8 rows of x the vector units, not memory, bound a 2-core CPU (M products a weight); prefill-shaped
ones (M 256, 1024) report GFLOP/s against the GEMM ceiling of the path's operand type (bf16 where the class
multiplies bf16, fp32 otherwise).  Peak RSS growth of one decode call shows no dequantised copy is made.

    .venv/bin/python bench/fp8_linear.py [--quick]            # (or .venv-vllm/bin/python: vLLM's kernel too)
"""
from __future__ import annotations

import argparse
import time

import torch

# (model, layer, N, K)
SHAPES = [("V3.2", "q_b_proj", 24576, 1536), ("V3.2", "o_proj", 7168, 16384), ("V3.2", "kv_a_proj (N 576)", 576, 7168),
          ("V3.2", "expert gate+up", 4096, 7168), ("V4-Flash", "wq_b", 32768, 1024),
          ("V4-Flash", "shared expert down", 4096, 2048)]
# DeepSeek-V4-Flash's routed experts as it ships them: MXFP4 (e2m1 pairs, a ue8m0 scale per 32), ``mxfp4_linear``
MX_SHAPES = [("V4-Flash", "routed expert w1 + w3 (MXFP4)", 4096, 4096), ("V4-Flash", "routed expert w2 (MXFP4)", 4096, 2048)]
DECODE_M = (1, 2, 4, 8)
PREFILL_M = (256, 1024)
STREAM_BYTES = 1 << 30          # the decode calls rotate over this many weight bytes (past any last-level cache)


def best_of(fn, n=5):
    fn()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def ceilings():
    from dsattn.native import isa
    src = torch.empty(STREAM_BYTES, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / best_of(lambda: dst.copy_(src), 3) / 1e9
    read = src.numel() / best_of(lambda: torch.sum(src.view(torch.int64)), 3) / 1e9
    del src, dst
    out = {"copy": copy, "read": read}
    for dt in ((torch.bfloat16, torch.float32) if isa.bf16_units() else (torch.float32,)):
        a, b = torch.randn(2048, 2048).to(dt), torch.randn(2048, 2048).to(dt)
        out[dt] = 2 * 2048 ** 3 / best_of(lambda: a @ b, 10) / 1e9
    # the vector units the streamed (decode) path multiplies on: dsattn's own GEMM in cache, one thread, times the
    # threads -- vdpbf16ps for bf16 x where the CPU has it, fp32 FMAs otherwise
    from dsattn import native
    module = native.kernels()
    path = "avx512bf16" if module.cpu_has_avx512bf16() else "fp32"
    out["vector"] = (path, torch.get_num_threads() * module.gemm_gflops(path, 64, 64, 1024, 64))
    return out


def best_ceilings(a, b):
    return {k: max(a[k], b[k], key=lambda v: v[1] if isinstance(v, tuple) else v) for k in a}


def decode_roofline(c, M: int, weight_bytes: float) -> float:
    """The weight bytes a second a streamed call can reach at M rows of x: the copy bandwidth, or the vector units'
    rate where M products a weight cost more (``weight_bytes``: bytes a weight, codes and scales)."""
    return min(c["copy"], c["vector"][1] / 2 / M * weight_bytes)


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith("VmHWM:")).split()[1]) / 1024


def vllm_kernel():
    """vLLM's own W8A16 CPU kernel (``_C.fp8_scaled_mm_cpu`` over AMX-packed weights), or None where absent."""
    try:
        import vllm._custom_ops as ops  # noqa: F401  (loads the kernel library)
    except Exception:
        return None
    if not (hasattr(torch.ops, "_C") and hasattr(torch.ops._C, "fp8_scaled_mm_cpu") and torch.cpu._is_amx_tile_supported()):
        return None

    def run(x, packed, scale):
        return torch.ops._C.fp8_scaled_mm_cpu(x, packed, scale, [128, 128], None, x.dtype, True)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two FP8 shapes and one MXFP4, M 1 / 8 / 256")
    parser.add_argument("--formats", default="fp8,mxfp4", help="which weight formats' rows: fp8, mxfp4")
    args = parser.parse_args()
    import dsattn
    from dsattn.native import isa
    from dsattn.weights import quantize_fp8_blocks  # noqa: F401
    formats = args.formats.split(",")
    if not formats or set(formats) - {"fp8", "mxfp4"}:
        parser.error(f"--formats {args.formats!r}: expected a comma-separated subset of fp8, mxfp4")
    shapes = [(*row, "fp8") for row in (SHAPES[:2] if args.quick else SHAPES) if "fp8" in formats]
    shapes += [(*row, "mxfp4") for row in (MX_SHAPES[:1] if args.quick else MX_SHAPES) if "mxfp4" in formats]
    decode_m, prefill_m = ((1, 8), (256,)) if args.quick else (DECODE_M, PREFILL_M)
    own = isa.cpu_class()
    label = "" if isa.cpu_isa() == own else f" (emulated on {own}: which code runs, not its speed there)"
    c = ceilings()          # (the header's; each layer's rows are set against ceilings measured beside them)
    gemm_dt = torch.bfloat16 if torch.bfloat16 in c else torch.float32
    print(f"python bench/fp8_linear.py{' --quick' if args.quick else ''}"
          f"{' --formats ' + args.formats if args.formats != 'fp8,mxfp4' else ''}  (DSATTN_CPU_ISA={isa.cpu_isa()}{label}, "
          f"{torch.get_num_threads()} threads)")
    print(f"copy bandwidth {c['copy']:.1f} GB/s (read + write, {STREAM_BYTES >> 20} MiB), read {c['read']:.1f} GB/s; "
          f"GEMM ceiling {c[gemm_dt]:.0f} GFLOP/s ({str(gemm_dt).split('.')[-1]} 2048^3)"
          + (f", fp32 {c[torch.float32]:.0f}" if gemm_dt != torch.float32 else "")
          + f"; decode's vector units ({c['vector'][0]}, in cache, x {torch.get_num_threads()} threads) "
            f"{c['vector'][1]:.0f} GFLOP/s")
    print("A decode row's roofline is the lower of the copy bandwidth and the weight bytes those vector units can "
          "multiply into M rows of x a second.")
    theirs = vllm_kernel()
    print("\n| model | layer | N x K | M | dsattn (FP8 or MXFP4) | dsattn batch-invariant | bf16 weight (x @ W.T) | "
          + ("vLLM fp8_scaled_mm_cpu | " if theirs else "") + "dsattn / ceiling |")
    print("|---|---|---|---|---|---|---|" + ("---|" if theirs else "") + "---|")
    g = torch.Generator().manual_seed(0)
    choices = []
    from dsattn.weights import batch_invariant
    for model, layer, N, K, fmt in shapes:
        mx = fmt == "mxfp4"
        nbytes = N * K // 2 + N * K // 32 if mx else N * K          # the weight bytes a call reads (codes + scales)
        copies = max(1, STREAM_BYTES // nbytes)
        if mx:
            codes = [torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g) for _ in range(copies)]
            scale = torch.randint(118, 124, (N, K // 32), dtype=torch.uint8, generator=g)     # ue8m0
        else:
            codes = [torch.randint(0, 126, (N, K), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
                     for _ in range(copies)]
            scale = torch.rand(-(-N // 128), -(-K // 128), generator=g) * 1e-2
        dense = torch.randn(N, K, generator=g).to(torch.bfloat16)
        packed = [torch.ops._C.convert_weight_packed(cd) for cd in codes] if theirs and not mx else None
        timed = []
        before = ceilings()
        for M in decode_m + prefill_m:
            x = torch.randn(M, K, generator=g).to(torch.bfloat16)
            decode = M in decode_m
            state = {"i": 0}

            def ours():
                state["i"] = (state["i"] + 1) % copies if decode else 0
                if mx:
                    return dsattn.ops.mxfp4_linear(x, codes[state["i"]], scale)
                return dsattn.ops.fp8_block_linear(x, codes[state["i"]], scale, [128, 128])
            t = best_of(ours, 2 * copies if decode else 3)
            with batch_invariant():
                ti = best_of(ours, 2 * copies if decode else 3)
            td = best_of(lambda: x @ dense.T, 3)
            tv = None
            if packed:                                  # (its packed copies rotated as ours are)
                def vllms():
                    state["i"] = (state["i"] + 1) % copies if decode else 0
                    return theirs(x, packed[state["i"]], scale)
                tv = best_of(vllms, 2 * copies if decode else 3)
            timed.append((M, decode, t, ti, td, tv))
        # this layer's ceilings: the better of those measured just before and just after its rows (a neighbour's
        # load on the host moves them within a run)
        c = best_ceilings(before, ceilings())
        for M, decode, t, ti, td, tv in timed:
            if decode:
                rate = lambda s: f"{nbytes / s / 1e9:.1f} GB/s"  # noqa: E731
                roof = decode_roofline(c, M, nbytes / (N * K))
                share = (f"{100 * nbytes / t / 1e9 / c['copy']:.0f} % of copy ({c['copy']:.1f} GB/s), "
                         f"{100 * nbytes / t / 1e9 / roof:.0f} % of roofline ({roof:.1f})")
                bf16 = f"{td * 1e3:.2f} ms ({2 * N * K / td / 1e9:.1f} GB/s, cached)"
            else:
                rate = lambda s: f"{2 * M * N * K / s / 1e9:.0f} GFLOP/s"  # noqa: E731
                share = f"{100 * 2 * M * N * K / t / 1e9 / c[gemm_dt]:.0f} % of GEMM ({c[gemm_dt]:.0f} GFLOP/s)"
                bf16 = f"{td * 1e3:.2f} ms ({rate(td)})"
            row = (f"| {model} | {layer} | {N} x {K} | {M} | {t * 1e3:.2f} ms ({rate(t)}) | {ti * 1e3:.2f} ms "
                   f"({rate(ti)}, {ti / t:.2f}x) | {bf16} | ")
            if theirs:
                row += f"{tv * 1e3:.2f} ms ({rate(tv)}) | " if tv is not None else "- | "
            print(row + share + " |", flush=True)
        if packed:
            choices.append(f"{model} {layer} [{N} x {K}]")
        del codes, packed
    if choices:
        print("\nThe plug-in's kernel for these bf16 layers here (DSATTN_FP8_KERNELS=auto, a rule: vLLM's AMX kernel "
              "wherever it takes the layer, as these rows measured it): vLLM's for " + ", ".join(choices))
    N, K = 24576, 1536
    w = torch.randint(0, 126, (N, K), dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.rand(N // 128, K // 128)
    x = torch.randn(4, K).to(torch.bfloat16)
    dsattn.ops.fp8_block_linear(x, w, s, [128, 128])
    with open("/proc/self/clear_refs", "w") as f:          # (resets the peak RSS to the current RSS)
        f.write("5")
    base = peak_rss_mb()
    dsattn.ops.fp8_block_linear(x, w, s, [128, 128])
    print(f"\npeak RSS growth of one {N} x {K} decode call: {peak_rss_mb() - base:.1f} MiB (its FP8 weight: "
          f"{N * K / 2 ** 20:.0f} MiB; a dequantised bf16 copy would be {2 * N * K / 2 ** 20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
