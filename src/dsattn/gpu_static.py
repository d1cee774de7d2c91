"""Ahead-of-time compilation of the Triton kernels for GPU targets, without a GPU (issue 13).

Every configuration the dispatcher can select (:func:`dsattn.sparse_mla.triton.launch_config`)
is compiled with ``triton.compile(ASTSource(...), target=GPUTarget(...))`` for NVIDIA sm_90, sm_80
and sm_120 (consumer Blackwell) and AMD gfx942 and gfx950; the table gives shared memory, warps, stages, registers and spills (from
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
           ("cuda", 120): (99 * 1024, 100 * 1024, 65536, 48),
           ("hip", "gfx942"): (64 * 1024, 64 * 1024, 512 * 64 * 4, 32),
           ("hip", "gfx950"): (160 * 1024, 160 * 1024, 512 * 64 * 4, 32)}
FWD_SIGNATURE = {"Q": "*{t}", "K": "*{k}", "A": "*i64", "SINK": "*fp32", "OUT": "*{t}",
                 "LSE": "*fp32", "SUM": "*fp32", "MP": "*fp32", "CP": "*i32", "LP": "*fp32", "ACCP": "*fp32",
                 "stride_qr": "i64", "stride_qh": "i64", "stride_or": "i64", "stride_oh": "i64", "stride_ar": "i64",
                 "H": "i32", "D": "i32", "W": "i32", "CHUNK": "i32", "NSPLIT": "i32", "N": "i32", "ROPE": "i32",
                 "scale": "fp32"}
MERGE_SIGNATURE = {"SINK": "*fp32", "OUT": "*{t}", "LSE": "*fp32", "SUM": "*fp32", "MP": "*fp32", "CP": "*i32", "LP": "*fp32",
                   "ACCP": "*fp32", "stride_or": "i64", "stride_oh": "i64", "H": "i32", "D": "i32", "NSPLIT": "i32"}
TYPES = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}
# kernel variants the dispatcher launches: name -> (kernel, phase, packed payload)
VARIANTS = {"mla_fwd": ("fwd", 0, None), "mla_split_max": ("fwd", 1, None), "mla_split_pv": ("fwd", 2, None),
            "mla_merge": ("merge", None, None), "mla_fwd_int8": ("fwd", 0, "i8"), "mla_fwd_fp8": ("fwd", 0, "u8"),
            "mla_split_pv_fp8": ("fwd", 2, "u8"), "mla_bwd": ("bwd", None, None),
            "qsfa_fwd_int8": ("qsfa", 0, "i8"), "qsfa_fwd_fp8": ("qsfa", 0, "u8"),
            "plan_walk": ("plan", None, None), "plan_walk_fp8": ("plan", None, "u8"), "fd_merge": ("fd", None, None)}
BWD_SIGNATURE = {"Q": "*{t}", "DO": "*{t}", "O": "*{t}", "LSE": "*fp32", "K": "*{t}", "A": "*i64", "G": "*i64",
                 "VALID": "*i8", "SINK": "*fp32", "DQ": "*{t}", "DKV": "*fp32", "DSINK": "*fp32", "PM": "*fp32",
                 **{f"stride_{x}": "i64" for x in ("qr", "qh", "dor", "doh", "or", "oh", "dqr", "dqh", "ar")},
                 "H": "i32", "D": "i32", "W": "i32", "scale": "fp32", "inv_h": "fp32"}
PLAN_SIGNATURE = {"TABLE": "*i32", "Q": "*{t}", "K": "*{k}", "A": "*i64", "ROW_LO": "*i32", "N_M": "*i32",
                  "REC_FIRST": "*i32", "REC_WIN_END": "*i32", "REC_S2_END": "*i32", "Q_START": "*i32", "SINK": "*fp32",
                  "OUT": "*{t}", "WS_M": "*fp32", "WS_L": "*fp32", "WS_ACC": "*fp32",
                  **{f"stride_{x}": "i64" for x in ("qr", "qh", "or", "oh", "ar")},
                  "G": "i32", "MB": "i32", "M_MAX": "i32", "D": "i32", "WO": "i32", "WC": "i32", "N": "i32",
                  "ROPE": "i32", "scale": "fp32"}
FD_SIGNATURE = {"TABLE": "*i32", "Q_START": "*i32", "SINK": "*fp32", "OUT": "*{t}", "WS_M": "*fp32", "WS_L": "*fp32",
                "WS_ACC": "*fp32", "stride_or": "i64", "stride_oh": "i64", "G": "i32", "MB": "i32", "D": "i32"}
INDEXER_SIGNATURE = {"Q": "*{t}", "K": "*{t}", "WT": "*fp32", "BATCH": "*i32", "NV": "*i32", "BASE": "*i64",
                     "BT": "*i32", "OUT": "*fp32", "stride_qr": "i64", "stride_qh": "i64", "stride_wr": "i64",
                     "stride_key": "i64", "stride_blk": "i64", "stride_bt": "i64", "stride_or": "i64", "H": "i32",
                     "D": "i32", "W": "i32", "BS": "i32"}
QUANT_INDEXER_SIGNATURE = {"Q": "*{t}", "QS": "*fp32", "KB": "*u8", "KS": "*fp32", "WT": "*fp32", "BATCH": "*i32",
                           "NV": "*i32", "BASE": "*i64", "BT": "*i32", "OUT": "*fp32",
                           **{f"stride_{x}": "i64" for x in ("qr", "qh", "qsr", "wr", "vblk", "vrow", "sblk", "srow",
                                                              "bt", "or")},
                           "H": "i32", "D": "i32", "W": "i32", "BS": "i32"}
# quant_lightning_indexer: vLLM's FP8 block cache (paged) and the Ascend int8 pool (paged, quantised query)
QUANT_INDEXER_VARIANTS = ("quant_indexer_fp8_paged", "quant_indexer_int8_paged")
INDEXER_VARIANTS = ("indexer_score", "indexer_score_paged") + QUANT_INDEXER_VARIANTS
SPLITS = 16            # the compiled split bound (SPLITS constexpr) of the split / merge variants


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
    """(variant, heads, head dim, dtype) the dispatcher sees: V4 (512) and V3.2 (576) at 16 / 64 / 128
    heads (the launch configuration depends on the head dim and dtype, the grid on the heads)."""
    dims = (512, 576)
    heads = (64,) if quick else (16, 64, 128)
    dtypes = ("bf16",) if quick else ("bf16", "fp16", "fp32")
    variants = (("mla_fwd", "mla_split_pv", "mla_merge", "mla_fwd_fp8", "mla_bwd", "qsfa_fwd_fp8", "plan_walk",
                 "fd_merge") if quick else tuple(VARIANTS))
    # the gradient kernel is dispatched for head dims without a tail only (512, not 576); QSFA's rows
    # are V3.2's 656 bytes (key 576 = 512 + rope 64, value 512) in half precision
    # the plan walk is V4's sharedkv decode: head dim 512
    mla = [(v, h, d, t) for v in variants for h in heads for d in dims for t in dtypes
           if not (v in ("mla_bwd", "plan_walk", "plan_walk_fp8", "fd_merge") and d != 512)
           and not (v.startswith("qsfa") and (d != 576 or t == "fp32"))]
    # the indexer: V4's 64 heads of dim 128 (V3.2: the same)
    return mla + [(v, 64, 128, t) for v in (INDEXER_VARIANTS[1:] if quick else INDEXER_VARIANTS) for t in dtypes]


def _ptxas_usage(ptx: str, arch: int):
    import triton
    # the wheel's plain ptxas is older than the PTX Triton 3.9 emits; ptxas-blackwell reads it (Triton's own flags)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        target = re.search(r"^\.target\s+(\w+)", ptx, re.M)     # sm_90a / sm_120a: the PTX names its own
        gpu = target.group(1) if target else f"sm_{arch}"
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


def _kernel_spec(variant: str, heads: int, head_dim: int, dtype: str, backend: str, arch):
    """(kernel, signature, constexprs, compile options, block label, packed payload) of one dispatcher
    configuration; the options (warps, stages, NVIDIA's ``maxnreg``) are the launch configuration's own."""
    import torch
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    if variant in INDEXER_VARIANTS:
        from .indexer.triton import indexer_score_kernel, launch_config as indexer_config, quant_indexer_score_kernel
        cfg = indexer_config(heads, head_dim, tdtype, backend)
        opts = _launch_options(cfg)
        consts = dict(PAGED=variant.endswith("paged"), DOT_FP32=dtype == "fp32", **cfg)
        kernel, signature = indexer_score_kernel, INDEXER_SIGNATURE
        if variant in QUANT_INDEXER_VARIANTS:
            fp8 = "fp8" in variant
            consts.update(HAS_QS=not fp8, FP8=(2 if backend == "cuda" and arch >= 89 else 1) if fp8 else 0)
            kernel, signature = quant_indexer_score_kernel, QUANT_INDEXER_SIGNATURE
        return (kernel, dict(signature), consts, opts,
                f"H{cfg['BLOCK_H']} N{cfg['BLOCK_N']} D{cfg['BLOCK_D']}", None)
    from .sparse_mla.triton import (launch_config, sparse_mla_bwd_kernel, sparse_mla_fwd_kernel,
                                    sparse_mla_merge_kernel)
    kind, phase, payload = VARIANTS[variant]
    cfg = launch_config(heads, head_dim, tdtype, backend, arch if backend == "cuda" else 0,
                        packed=payload is not None)
    opts = _launch_options(cfg)
    block = f"H{cfg['BLOCK_H']} N{cfg['BLOCK_N']} D{cfg['DA']}+{cfg['DB']}"
    if kind == "plan":
        consts = dict(TILE=64 if head_dim == 512 else 128, PACKED=payload is not None,
                      FP8=0 if payload != "u8" else (2 if backend == "cuda" and arch >= 89 else 1),
                      ROPE_BF16=dtype != "fp16", LANES=16, HAS_SINK=True, DOT_FP32=dtype == "fp32", BF16_BY_BITS=False,
                      **{k: cfg[k] for k in ("BLOCK_H", "BLOCK_N", "DA", "DB", "Q_RELOAD")})
        from .sharedkv.triton import plan_walk_kernel, walk_options
        return plan_walk_kernel, dict(PLAN_SIGNATURE), consts, walk_options(opts, payload is not None), block, payload
    if kind == "fd":
        from .sharedkv.triton import fd_merge_kernel
        consts = dict(HAS_SINK=True, BLOCK=16, BLOCK_D=128, MAX_SPLIT=64)
        return fd_merge_kernel, dict(FD_SIGNATURE), consts, dict(num_warps=4, num_stages=1), "P16 D128 S64", None
    if kind == "bwd":
        consts = dict(HAS_SINK=True, DOT_FP32=dtype == "fp32", BF16_BY_BITS=False,
                      **{k: cfg[k] for k in ("BLOCK_H", "BLOCK_N", "DA", "DB")})
        return sparse_mla_bwd_kernel, dict(BWD_SIGNATURE), consts, dict(opts, num_stages=1), block, None
    if kind == "merge":
        consts = dict(SPLITS=SPLITS, HAS_SINK=True, BLOCK_H=cfg["BLOCK_H"], DA=cfg["DA"], DB=cfg["DB"],
                      VALUE_TAIL=True, STATS=False)
        return sparse_mla_merge_kernel, dict(MERGE_SIGNATURE), consts, dict(num_warps=4, num_stages=1), block, None
    qsfa = kind == "qsfa"
    consts = dict(PHASE=phase, SPLITS=1 if phase == 0 else SPLITS, HAS_SINK=True, DOT_FP32=dtype == "fp32",
                  BF16_BY_BITS=False, PACKED=payload is not None,
                  FP8=0 if payload != "u8" else (2 if backend == "cuda" and arch >= 89 else 1),
                  ROPE_BF16=dtype != "fp16", TILE=64 if head_dim == 512 else 128, VALUE_TAIL=not qsfa, STATS=qsfa,
                  **cfg)
    return sparse_mla_fwd_kernel, dict(FWD_SIGNATURE), consts, opts, block, payload


def _launch_options(cfg: dict) -> dict:
    """Move the launch options out of a launch configuration (the rest are constexprs)."""
    return {k: cfg.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in cfg}


def compile_one(variant: str, heads: int, head_dim: int, dtype: str, target) -> Row:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend, arch = target
    fn, sig, consts, opts, block, payload = _kernel_spec(variant, heads, head_dim, dtype, backend, arch)
    sig = {k: v.format(t=TYPES[dtype], k=payload or TYPES[dtype]) for k, v in sig.items()}
    sig.update({k: "constexpr" for k in consts})
    compiled = triton.compile(ASTSource(fn, sig, consts),
                              target=GPUTarget(backend, arch, 32 if backend == "cuda" else 64),
                              options=opts)
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
    return Row(variant, f"{backend}:{arch}", heads, head_dim, dtype, block, md.shared, md.num_warps,
               md.num_stages, regs, spills, occ, ok)


def dispatched(variant: str, head_dim: int, dtype: str, target) -> bool:
    """Whether the dispatcher launches this variant on ``target`` (else that call keeps the PyTorch
    path, or for the plan walk the split-K kernel): the same rules the ops apply at run time
    (``sparse_mla.triton.kernel_covers`` / ``backward_supports``, ``sharedkv.triton.supports``)."""
    if variant in INDEXER_VARIANTS:
        return True
    import torch
    from .sparse_mla.triton import kernel_covers
    backend, arch = target
    arch = arch if backend == "cuda" else 0
    kind, _, payload = VARIANTS[variant]
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    if kind == "bwd":
        return tdtype != torch.float32
    if kind == "plan" and payload == "u8" and backend == "cuda" and arch < 89:
        return False                 # fp8 decoded from its bits: the split-K kernel runs instead
    return kernel_covers(tdtype, head_dim, payload is not None or kind == "qsfa", backend, arch)


def matrix(quick: bool, targets=None) -> tuple[list[Row], list[tuple]]:
    """The compiled rows, and the (variant, heads, head dim, dtype, target) the dispatcher does not
    launch (they run the PyTorch path)."""
    rows, skipped = [], []
    for target in targets or TARGETS:
        for v, h, d, t in configurations(quick):
            if dispatched(v, d, t, target):
                rows.append(compile_one(v, h, d, t, target))
            else:
                skipped.append((v, h, d, t, target))
    return rows, skipped


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
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| kernel ")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsattn.gpu_static")
    ap.add_argument("--quick", action="store_true", help="bf16, 64 heads, one target per vendor")
    ap.add_argument("--check", action="store_true", help="exit 1 on a spill or a shared-memory overflow")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: the interpreter replaces every kernel; unset it to compile", file=sys.stderr)
        return 2
    targets = [("cuda", 90), ("hip", "gfx942")] if args.quick else None
    rows, skipped = matrix(args.quick, targets)
    print(table(rows))
    if skipped:
        kinds = sorted({f"{v} {d} {t} on {b}:{a}" for v, _, d, t, (b, a) in skipped})
        print(f"\nNot launched by the dispatcher (the PyTorch path runs): {len(skipped)} configurations: "
              + "; ".join(kinds))
    return 1 if args.check and not all(r.ok for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
