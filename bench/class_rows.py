"""The attention rows a CPU class is judged on (prefill 8K CSA / HCA / SWA, decode V4-Flash B32 @64K), run as that
class in a fresh process: dsattn capped by DSATTN_CPU_ISA and oneDNN / MKL / ATen limited to it
(``dsattn.native.isa.environment``), its fp32 ceiling measured there.  A few minutes, where ``dsattn bench --family
attention`` takes far longer; for A / B of a kernel change on one class (run it before and after, same machine).

    .venv/bin/python bench/class_rows.py --cpu-isa avx2

On a class below the machine's own the figures are emulated: the smaller class's code on this CPU's cores.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys



def rows() -> None:
    import torch
    from dsattn import native, ops
    from dsattn.benchmarks import workloads
    from dsattn.benchmarks.harness import measure_ceilings, timeit
    from dsattn.native import isa
    ceil = measure_ceilings(2048)
    module = native.kernels()
    print(f"CPU class {isa.cpu_isa()} (own: {isa.cpu_class()}), compiled layer: "
          f"{module.cpu_isa() if module is not None else native.status()}, {torch.get_num_threads()} threads; "
          f"{ceil.describe()}", flush=True)
    for ratio, name in ((4, "CSA"), (128, "HCA"), (1, "SWA")):
        q, kw, flops = workloads.prefill(8192, ratio=ratio)
        ops.sparse_flash_mla(q, **kw)
        t = min(timeit(lambda: ops.sparse_flash_mla(q, **kw), repeat=1) for _ in range(3))
        print(f"prefill {name} 8K: {t:.3f} s, {100 * flops / 1e9 / t / ceil.best_gflops:.0f} % of the best ceiling "
              "(best of 3)", flush=True)
        del q, kw
    for ratio, name in ((4, "CSA"), (128, "HCA")):
        q, kw, flops, _ = workloads.decode(ratio=ratio, fixed=65536, seed=2)
        t = timeit(lambda: ops.sparse_flash_mla(q, **kw), repeat=20)
        print(f"decode {name} V4-Flash B32 @64K: {1000 * t:.1f} ms, {100 * flops / 1e9 / t / ceil.best_gflops:.0f} % "
              "(median of 20)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-isa", help="the class to run as (default: the CPU's own)")
    args = parser.parse_args()
    if args.cpu_isa and os.environ.get("DSATTN_CPU_ISA") != args.cpu_isa:
        from dsattn.native import isa
        env = dict(os.environ, **isa.environment(args.cpu_isa))
        return subprocess.run([sys.executable, os.path.abspath(__file__)], env=env).returncode
    rows()
    return 0


if __name__ == "__main__":
    sys.exit(main())
