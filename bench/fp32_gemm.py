"""dsattn's fp32 GEMM against ATen's cpublas::brgemm (oneDNN's fp32 ukernel, or MKL's sgemm where oneDNN is capped
below it: what the compiled layer's fp32 path ran before its GEMM was dsattn's), side by side on the shapes the
kernels run, one thread, operands in cache, with the one-thread fp32 ceiling (torch.mm 2048^3) measured in the same
process.  Each class runs in a fresh process capped as that class (``dsattn.native.isa.environment``); a class
below the machine's own is emulated (its code on this CPU's cores: which code runs, not its speed there).

    .venv/bin/python bench/fp32_gemm.py [--classes amx,avx512,avx2,generic]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

# (what, M, N, K): C [M, N] = A [M, K] B [K, N]
SHAPES = [("attention S^T: 128 keys x 64 heads, D 512", 128, 64, 512),
          ("attention P V: 64 heads x 512, 640 keys", 64, 512, 640),
          ("rows_matmul: 32 weight rows x 512 tokens, K 256", 32, 512, 256),
          ("decode: 16 keys x 64 heads, D 576", 16, 64, 576),
          ("odd edges: 37 x 50, K 130", 37, 50, 130)]


def rows() -> None:
    import time

    import torch
    from dsattn import native
    from dsattn.native import isa
    torch.set_num_threads(1)
    module = native.kernels()
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    best = min((lambda t0: (torch.mm(a, b), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(5))
    ceiling = 2 * 2048 ** 3 / best / 1e9
    own = isa.cpu_class()
    label = "" if isa.cpu_isa() == own else f" (emulated on {own})"
    print(f"\n### class {isa.cpu_isa()}{label}: one-thread fp32 ceiling (torch.mm 2048^3) {ceiling:.1f} GFLOP/s")
    print("| shape | dsattn fp32 GEMM GFLOP/s | cpublas::brgemm GFLOP/s | dsattn / brgemm | dsattn / ceiling |")
    print("|---|---|---|---|---|")
    for what, M, N, K in SHAPES:
        mine = max(module.gemm_gflops("fp32", M, N, K, 64) for _ in range(3))
        theirs = max(module.gemm_gflops("brgemm_fp32", M, N, K, 64) for _ in range(3))
        print(f"| {what} | {mine:.1f} | {theirs:.1f} | {mine / theirs:.2f} | {100 * mine / ceiling:.0f} % |",
              flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", default=None, help="comma-separated classes (default: this CPU's and below)")
    parser.add_argument("--rows", action="store_true", help=argparse.SUPPRESS)     # (the per-class child)
    args = parser.parse_args()
    if args.rows:
        rows()
        return 0
    from dsattn.native import isa
    classes = args.classes.split(",") if args.classes else [isa.cpu_class()] + isa.below()
    print(f"python bench/fp32_gemm.py --classes {','.join(classes)}")
    for cls in classes:
        env = dict(os.environ, **isa.environment(cls))
        code = subprocess.run([sys.executable, __file__, "--rows"], env=env).returncode
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
