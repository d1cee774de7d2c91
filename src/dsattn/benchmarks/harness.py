"""Timing, ceilings and peak-memory measurement shared by the benchmark families."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch


@dataclass
class Result:
    family: str
    workload: str
    variant: str
    seconds: float
    gflop: float = 0.0
    peak_mb: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)
    bytes: float = 0.0          # bytes the work must move at least (workloads.*_bytes), 0: not counted

    @property
    def gflops(self) -> float:
        return self.gflop / self.seconds if self.seconds > 0 else 0.0

    def roofline(self, ceil: "Ceilings") -> tuple[float, str] | None:
        """``(share of the roofline, its bound)``: the time at the roofline, ``max(FLOPs / the run's best
        GEMM rate, bytes / the run's copy bandwidth)``, over the measured time; None without a byte count."""
        if not self.bytes or not self.seconds == self.seconds or self.seconds <= 0:
            return None
        compute = self.gflop / ceil.best_gflops
        memory = self.bytes / 1e9 / ceil.copy_gbs
        return max(compute, memory) / self.seconds, ("memory" if memory >= compute else "compute")


def timeit(fn, *, repeat: int = 3, warmup: int = 1, budget_s: float = 60.0) -> float:
    """Median seconds of ``repeat`` calls after ``warmup`` calls (fewer when one call is slow)."""
    for _ in range(warmup):
        t = time.perf_counter()
        fn()
        if time.perf_counter() - t > budget_s / 3:
            repeat = 1
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@dataclass
class Ceilings:
    bf16_gflops: float | None      # None: the CPU (or its DSATTN_CPU_ISA cap) has no bf16 units, not timed
    fp32_gflops: float
    copy_gbs: float
    threads: int
    cpu_class: str = ""

    @property
    def best_gflops(self) -> float:
        return max(self.bf16_gflops or 0.0, self.fp32_gflops)

    def describe(self) -> str:
        bf16 = (f"bf16 GEMM {self.bf16_gflops:.0f} GFLOP/s" if self.bf16_gflops else
                "bf16 GEMM not timed (no bf16 units in this class: every GEMM runs in fp32)")
        return f"CPU class {self.cpu_class}: {bf16}, fp32 GEMM {self.fp32_gflops:.0f} GFLOP/s, copy {self.copy_gbs:.1f} GB/s"


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure_ceilings(n: int = 2048, progress=None) -> Ceilings:
    """Large-GEMM GFLOP/s in bf16 and fp32 and memory copy GB/s, measured now, in this process.  The
    GEMM rates are the best of ten calls (a ceiling is the best the machine does; on a shared machine
    the median of a few calls can fall far below it, which would flatter every ratio to it).  Where the
    CPU class (:mod:`dsattn.native.isa`, capped or not) has no bf16 units the bf16 GEMM is not timed:
    PyTorch's bf16 matmul is a scalar loop there (1.4 GFLOP/s on a Zen 2 core: minutes for this size) and
    no dsattn path runs one."""
    from ..native import isa
    out = {torch.bfloat16: None}
    for dt in ((torch.bfloat16, torch.float32) if isa.bf16_units() else (torch.float32,)):
        if progress:
            progress(f"ceilings: {str(dt).split('.')[-1]} GEMM {n} x {n}")
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        a @ b
        best = min(_seconds(lambda: a @ b) for _ in range(10))
        out[dt] = 2 * n ** 3 / best / 1e9
    src = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / timeit(lambda: dst.copy_(src), repeat=5) / 1e9   # read + write
    return Ceilings(out[torch.bfloat16], out[torch.float32], copy, torch.get_num_threads(), isa.cpu_isa())


# glibc keeps freed memory in its heap instead of returning it (large blocks otherwise come from mmap and
# go back at free): a fresh output then reuses pages the previous call freed, as in a serving process
# whose allocator pools memory (jemalloc / tcmalloc, which Intel recommends for PyTorch on CPUs), and
# its first writes fault no page in.  Applied to child processes only.
REUSED_PAGES_ENV = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295"}


def peak_rss_growth_mb(module: str, func: str, kwargs: dict, timeout: int = 1800, env: dict | None = None) -> dict:
    """Run ``module.func(**kwargs)`` in a fresh Python process (``env`` added to its environment) and
    report its resident-set growth: the peak RSS of the process minus its RSS after the inputs were
    built (the function reports that baseline itself and returns a JSON-able dict)."""
    # the peak is the child's VmHWM: getrusage's ru_maxrss survives exec on Linux and can report the RSS of
    # the (large) parent at fork time instead of the child's own
    code = (f"import json, sys; import {module} as m; "
            f"r = m.{func}(**json.loads(sys.argv[1])); "
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]; "
            "r['peak_rss_mb'] = int(hwm) / 1024; print(json.dumps(r))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["killed"])[-1], "returncode": proc.returncode}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def reused_pages_result(family: str, name: str, module: str, func: str, kwargs: dict) -> Result:
    """The default path timed in a fresh process whose freed memory stays in its heap (no page faults
    on fresh outputs)."""
    r = peak_rss_growth_mb(module, func, kwargs, env=REUSED_PAGES_ENV)
    variant = "dsattn (default), outputs on reused pages"
    if "error" in r:
        return Result(family, name, variant, float("nan"), note=f"failed: {r['error']}")
    return Result(family, name, variant, r["seconds"], r["gflop"],
                  note="fresh process with glibc's mmap_threshold and trim_threshold raised to 4 GiB "
                       "(GLIBC_TUNABLES): freed memory stays in the heap, so a call's fresh "
                       "outputs reuse the pages the last call freed, as with a pooling allocator; median of 3 calls "
                       "after a first" + (f"; {r['note']}" if r.get("note") else ""))


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
