"""GPU timing of the Triton kernels beside the PyTorch path, in one run (issue 13).

    python bench/gpu.py [--smoke] [--out FILE]

On a CUDA / ROCm device: for each workload, the Triton path (``DSATTN_BACKEND=triton``) and the
vectorised PyTorch path (``DSATTN_BACKEND=torch``) run on the same inputs; the table gives the
median time (CUDA events), the Triton speed-up, the achieved bandwidth of the bytes a kernel must
read (the keys each row attends, with repeats: an upper bound on useful traffic) against this
device's measured copy bandwidth, achieved TFLOP/s against its measured bf16 matmul rate, the peak
memory of each path, and the largest difference between the two outputs (the spec's comparison
of the Triton output against the PyTorch one must hold).  ``--smoke`` uses tiny shapes; without
a GPU it runs them under Triton's interpreter (a crash check, no timing worth reading).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")          # before triton is imported

import torch  # noqa: E402

from dsattn import ops, testing  # noqa: E402
from dsattn.benchmarks import workloads  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeat: int) -> float:
    """Median seconds of ``repeat`` calls after one warm-up (CUDA events on a GPU)."""
    fn()
    _sync()
    times = []
    for _ in range(repeat):
        if DEV == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write counted)."""
    n = (1 << 30) // 2 if DEV == "cuda" else 1 << 20
    x = torch.empty(n, dtype=torch.bfloat16, device=DEV)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / timed(lambda: y.copy_(x), 5)


def matmul_rate() -> float:
    n = 8192 if DEV == "cuda" else 256
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEV)
    return 2 * n ** 3 / timed(lambda: a @ a, 5)


def _to(x):
    return {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in x.items()}


def attention_workloads(smoke: bool):
    """(name, call, bytes read) of sparse_flash_mla decode / prefill."""
    dec = dict(B=2, heads=16, lo=300, hi=600, topk=64) if smoke else dict(B=32, heads=64, lo=8192, hi=65536)
    out = []
    for ratio, label in ((4, "CSA"), (128, "HCA"), (1, "SWA")):
        q, kw, flops, S2o = workloads.decode(ratio=ratio, **dec)
        keys = flops / (2 * q.size(-2) * 2 * q.size(-1))
        q, kw = q.to(DEV), _to(kw)
        out.append((f"decode {label} B{q.size(0)}", lambda q=q, kw=kw: ops.sparse_flash_mla(q, **kw), flops,
                    keys * q.size(-1) * 2))
    L = 64 if smoke else 8192
    q, kw, flops = workloads.prefill(L=L, heads=16 if smoke else 64, topk=64 if smoke else 512)
    keys = flops / (2 * q.size(-2) * 2 * q.size(-1))
    q, kw = q.to(DEV), _to(kw)
    out.append((f"prefill CSA {L}", lambda: ops.sparse_flash_mla(q, **kw), flops, keys * q.size(-1) * 2))
    return out


def run(smoke: bool) -> str:
    bw, mm = copy_bandwidth(), matmul_rate()
    lines = [f"device: {torch.cuda.get_device_name() if DEV == 'cuda' else 'CPU (Triton interpreter)'}; "
             f"copy {bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.1f} TFLOP/s", "",
             "| workload | torch ms | triton ms | speed-up | triton GB/s (% copy) | triton TFLOP/s (% matmul) | "
             "peak MB torch / triton | max abs diff | spec rule |", "|" + "---|" * 9]
    repeat = 1 if smoke else 10
    for name, call, flops, nbytes in attention_workloads(smoke):
        res, peaks = {}, {}
        for backend in ("torch", "triton"):
            os.environ["DSATTN_BACKEND"] = backend
            if DEV == "cuda":
                torch.cuda.reset_peak_memory_stats()
            res[backend] = (timed(call, repeat), call()[0].float())
            peaks[backend] = torch.cuda.max_memory_allocated() / 2**20 if DEV == "cuda" else float("nan")
        (tt, ot), (tk, ok) = res["torch"], res["triton"]
        rule = testing.compare(ok.cpu(), ot.cpu())
        lines.append(f"| {name} | {tt * 1e3:.3f} | {tk * 1e3:.3f} | {tt / tk:.2f} | {nbytes / tk / 1e9:.0f} "
                     f"({100 * nbytes / tk / bw:.0f} %) | {flops / tk / 1e12:.2f} ({100 * flops / tk / mm:.0f} %) | "
                     f"{peaks['torch']:.0f} / {peaks['triton']:.0f} | {(ok - ot).abs().max().item():.2e} | "
                     f"{'pass' if rule else 'FAIL'} |")
    os.environ.pop("DSATTN_BACKEND", None)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/gpu.py")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (under the interpreter without a GPU)")
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args(argv)
    table = run(args.smoke)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
