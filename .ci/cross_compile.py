"""The compiled layer's sources built for another architecture (default aarch64-linux-gnu: Graviton, Grace, Ampere):
every source compiled to an object by zig's clang (the ``ziglang`` wheel from PyPI: a cross compiler with its own
libc and C++ headers, no system package needed), against this torch's headers, OpenMP's header taken from the
host compiler.  There the x86 paths are guarded off and the generic code serves (what ``DSATTN_CPU_ISA=generic``
runs on x86).  Exit status 1, with each failing source's first errors, if any source does not build.

    python .ci/cross_compile.py [--target aarch64-linux-gnu] [--jobs 2]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import sysconfig
import tempfile

from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src", "dsattn", "native"))
import sources  # noqa: E402  (the build's list, without importing dsattn: no torch extension is built here)


def omp_include() -> list[str]:
    """The host compiler's omp.h (declarations only; zig ships none)."""
    for cxx in (os.environ.get("CXX", "c++"), "g++", "c++"):
        try:
            path = subprocess.run([cxx, "-print-file-name=include/omp.h"], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except OSError:
            continue
        if os.path.isabs(path) and os.path.isfile(path):
            return ["-isystem", os.path.dirname(path)]
    raise SystemExit("cross_compile: no host C++ compiler to take omp.h from (CXX, g++, c++)")


def compile_one(source: str, target: str, flags: list[str], out_dir: str) -> tuple[str, int, str]:
    out = os.path.join(out_dir, os.path.basename(source) + ".o")
    cmd = [sys.executable, "-m", "ziglang", "c++", "-target", target, *flags, "-c", source, "-o", out]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    return os.path.basename(source), proc.returncode, "\n".join(errors[:8])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="aarch64-linux-gnu")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    flags = ["-std=c++17", "-O0", "-fopenmp", "-w", "-DTORCH_EXTENSION_NAME=dsattn_native",
             *[f"-I{p}" for p in cpp_extension.include_paths()], f"-I{sysconfig.get_paths()['include']}",
             *omp_include()]
    failed = 0
    with tempfile.TemporaryDirectory() as out_dir, concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        jobs = [pool.submit(compile_one, path, args.target, flags, out_dir) for path in sources.paths(sources.SOURCES)]
        for job in jobs:
            name, rc, errors = job.result()
            print(f"{args.target}: {name}: {'ok' if rc == 0 else 'FAILED'}", flush=True)
            if rc:
                failed += 1
                print(errors)
    print(f"{args.target}: {len(jobs) - failed} of {len(jobs)} sources build")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
