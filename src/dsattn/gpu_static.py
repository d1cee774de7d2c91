"""Ahead-of-time compilation of the Triton kernels for GPU targets, without a GPU (issue 13).

Every configuration the dispatcher can select (:func:`dsattn.sparse_mla.triton.launch_config`)
is compiled with ``triton.compile(ASTSource(...), target=GPUTarget(...))`` for NVIDIA sm_90 and
sm_80 and AMD gfx942; the table gives shared memory, warps, stages, registers and spills (from
``ptxas -v`` on the PTX, or the AMDGCN metadata) and an occupancy estimate (resident warps per SM
limited by registers and shared memory).  ``python -m dsattn.gpu_static [--quick] [--check]``;
``--check`` exits non-zero on a spill or a shared-memory overflow.  Run it without
``TRITON_INTERPRET`` (the interpreter replaces every kernel).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# target -> (shared memory per block limit, per SM; registers per SM; max warps per SM)
TARGETS = {("cuda", 90): (227 * 1024, 228 * 1024, 65536, 64), ("cuda", 80): (163 * 1024, 164 * 1024, 65536, 64),
           ("hip", "gfx942"): (64 * 1024, 64 * 1024, 512 * 64 * 4, 32)}
SIGNATURE = {"Q": "*{t}", "KO": "*{t}", "KC": "*{t}", "A": "*i64", "SINK": "*fp32", "OUT": "*{t}", "LSE": "*fp32",
             "stride_qr": "i64", "stride_qh": "i64", "stride_or": "i64", "stride_oh": "i64", "stride_ar": "i64",
             "H": "i32", "D": "i32", "W": "i32", "WO": "i32", "scale": "fp32"}
TYPES = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


@dataclass
class Row:
    kernel: str
    target: str
    heads: int
    head_dim: int
    dtype: str
    block: str
    shared: int
    warps: int
    stages: int
    registers: int | None
    spills: int | None
    occupancy: float | None
    ok: bool


def configurations(quick: bool):
    """(heads, head dim, dtype) the dispatcher sees: V4 (512) and V3.2 (576) at 64 / 128 heads."""
    dims = (512, 576)
    heads = (64,) if quick else (16, 64, 128)
    dtypes = ("bf16",) if quick else ("bf16", "fp16", "fp32")
    return [(h, d, t) for h in heads for d in dims for t in dtypes]


def _ptxas_usage(ptx: str, arch: int):
    import triton
    # the wheel's plain ptxas is older than the PTX Triton 3.9 emits; ptxas-blackwell reads it (Triton's own flags)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        res = subprocess.run([ptxas, "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu}", path,
                              "-o", os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.findall(r"(\d+) bytes spill (?:stores|loads)", text)
    return (int(regs.group(1)) if regs else None), (sum(int(s) for s in spill) if spill else None)


def _amd_usage(asm: str):
    vgpr = re.search(r"\.vgpr_count:\s+(\d+)", asm) or re.search(r"NumVgprs:\s+(\d+)", asm)
    scratch = re.search(r"ScratchSize:\s+(\d+)", asm)
    return (int(vgpr.group(1)) if vgpr else None), (int(scratch.group(1)) if scratch else None)


def compile_one(heads: int, head_dim: int, dtype: str, target) -> Row:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .sparse_mla.triton import launch_config, sparse_mla_fwd_kernel
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    backend, arch = target
    cfg = launch_config(heads, head_dim, tdtype, backend)
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    consts = dict(HAS_SINK=True, DOT_FP32=dtype == "fp32", BF16_BY_BITS=False, **cfg)
    sig = {k: v.format(t=TYPES[dtype]) for k, v in SIGNATURE.items()}
    sig.update({k: "constexpr" for k in consts})
    compiled = triton.compile(ASTSource(sparse_mla_fwd_kernel, sig, consts),
                              target=GPUTarget(backend, arch, 32 if backend == "cuda" else 64),
                              options={"num_warps": warps, "num_stages": stages})
    md = compiled.metadata
    if backend == "cuda":
        regs, spills = _ptxas_usage(compiled.asm["ptx"], arch)
    else:
        regs, spills = _amd_usage(compiled.asm["amdgcn"])
    block_limit, sm_shared, sm_regs, sm_warps = TARGETS[target]
    warp = 32 if backend == "cuda" else 64
    occ = None
    if regs:
        per_block_regs = regs * md.num_warps * warp
        blocks = min(sm_regs // per_block_regs, sm_shared // max(md.shared, 1), sm_warps // md.num_warps)
        occ = blocks * md.num_warps / sm_warps
    ok = md.shared <= block_limit and spills == 0          # unknown spills are not "ok"
    block = f"H{cfg['BLOCK_H']} N{cfg['BLOCK_N']} D{cfg['DA']}+{cfg['DB']}"
    return Row("sparse_mla_fwd", f"{backend}:{arch}", heads, head_dim, dtype, block, md.shared, md.num_warps,
               md.num_stages, regs, spills, occ, ok)


def matrix(quick: bool, targets=None) -> list[Row]:
    rows = []
    for target in targets or TARGETS:
        for h, d, t in configurations(quick):
            rows.append(compile_one(h, d, t, target))
    return rows


def table(rows: list[Row]) -> str:
    head = "| kernel | target | heads | head dim | dtype | block | shared B | warps | stages | registers | spills | " \
           "occupancy | ok |\n|" + "---|" * 13
    lines = [head]
    for r in rows:
        occ = f"{100 * r.occupancy:.0f} %" if r.occupancy is not None else "-"
        lines.append(f"| {r.kernel} | {r.target} | {r.heads} | {r.head_dim} | {r.dtype} | {r.block} | {r.shared} | "
                     f"{r.warps} | {r.stages} | {r.registers if r.registers is not None else '-'} | "
                     f"{r.spills if r.spills is not None else '-'} | {occ} | {'yes' if r.ok else 'NO'} |")
    return "\n".join(lines)


def run_in_subprocess(quick: bool, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``python -m dsattn.gpu_static [--quick]`` in a fresh interpreter without ``TRITON_INTERPRET``
    (a process that chose Triton's interpreter cannot compile for a GPU)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cmd = [sys.executable, "-m", "dsattn.gpu_static"] + (["--quick"] if quick else [])
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def parse_table(text: str) -> list[dict]:
    """The rows of :func:`table`'s markdown as dicts of strings."""
    keys = ("kernel", "target", "heads", "head_dim", "dtype", "block", "shared", "warps", "stages", "registers",
            "spills", "occupancy", "ok")
    return [dict(zip(keys, (c.strip() for c in line.strip().strip("|").split("|"))))
            for line in text.splitlines() if line.startswith("| sparse_mla_fwd")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsattn.gpu_static")
    ap.add_argument("--quick", action="store_true", help="bf16, 64 heads, one target per vendor")
    ap.add_argument("--check", action="store_true", help="exit 1 on a spill or a shared-memory overflow")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: the interpreter replaces every kernel; unset it to compile", file=sys.stderr)
        return 2
    targets = [("cuda", 90), ("hip", "gfx942")] if args.quick else None
    rows = matrix(args.quick, targets)
    print(table(rows))
    return 1 if args.check and not all(r.ok for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
