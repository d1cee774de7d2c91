"""The compiled layer's invariance checks in one process, run by test_vendor_invariance.py under each of the
vendor libraries' settings (MKL's code path and instruction cap, oneDNN's ISA cap) and each DSATTN_CPU_ISA cap:
rows of rows_matmul alone and inside calls of every M from 1 to 600, on 1 and 2 threads, and the kernels' batch
invariance (dsattn.cases.invariance) on a few fuzz configurations per family, on every GEMM path that is dsattn's
own.  Prints one line per failure and exits 1 if there was any.

    python tests/invariance_worker.py [--families mla,indexer,...] [--seeds N] [--seed S]
"""
from __future__ import annotations

import argparse
import sys

import torch

from dsattn import native
from dsattn.cases import invariance

# (builds before 2026-12 named it _threads; the worker runs against them too, to show what they fail)
on_threads = getattr(invariance, "on_threads", None) or getattr(invariance, "_threads")

# every M from 1 to 17, then both sides of the kernels' tile, block and panel edges, up to 600
MS = sorted(set(range(1, 18)) | {23, 31, 32, 33, 47, 48, 63, 64, 65, 96, 127, 128, 129, 255, 256, 257, 300, 383,
                                  384, 511, 512, 513, 577, 599, 600})
SHAPES = [(64, 1030), (530, 40), (7, 33)]            # (K, N): the Zen 4 failure's, a long K, odd sizes


def check_rows_matmul(module, dtype, failures: list[str]) -> None:
    for K, N in SHAPES:
        g = torch.Generator().manual_seed(K * 1000 + N)
        a = torch.randn(max(MS), K, generator=g).to(dtype)
        b = torch.randn(N, K, generator=g).to(dtype)
        half = b[:N // 2].contiguous()
        full = on_threads(2, lambda: module.rows_matmul(a, [b, half]))
        where = f"rows_matmul {dtype} K={K} N={N}"
        if not torch.equal(full[1], full[0][:, :N // 2]):
            failures.append(f"{where}: the columns of b[:N/2] differ from b's")
        for threads in (1, 2):
            for M in MS:
                got = on_threads(threads, lambda: module.rows_matmul(a[:M].contiguous(), [b, half]))
                for which, (c, want) in enumerate(zip(got, full)):
                    if not torch.equal(c, want[:M]):
                        bad = int((c != want[:M]).any(1).nonzero()[0])
                        failures.append(f"{where}: M={M}, {threads} thread(s), b[{which}]: row {bad} differs from "
                                        "its bits in the 600-row call")
                        break


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default=",".join(invariance.FAMILIES))
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    module = native.kernels()
    if module is None:
        print(f"no compiled layer: {native.status()}")
        return 1
    own_paths = ["fp32"] + (["avx512bf16"] if module.cpu_has_avx512bf16() else [])
    failures: list[str] = []
    for path in own_paths:
        with native.gemm_path(path):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                if hasattr(native, "gemm_is_own") and not native.gemm_is_own(dtype):   # (builds before it: own)
                    failures.append(f"{path} path: {dtype} is not on dsattn's own GEMM")
                check_rows_matmul(module, dtype, failures)
            for family in [f for f in args.families.split(",") if f]:
                seeds = range(args.seed, args.seed + args.seeds)
                failures += [f"{path} path: {line}" for line in invariance.check_seeds(family, seeds)[1]]
    print(f"cpu class {module.cpu_isa()}, own GEMM paths {', '.join(own_paths)}: {len(failures)} failure(s)")
    for line in failures[:40]:
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
