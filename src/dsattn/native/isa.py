"""The CPU class the compiled layer runs as, and ``DSATTN_CPU_ISA``, the cap that makes any machine run a
smaller class's code.

The classes, in order: ``generic`` (no vector ISA of ours: the code other architectures build), ``avx2``
(AVX2 + FMA: Haswell .. Comet Lake, Zen 1-3), ``avx512`` (AVX-512 F/BW/VL/DQ/CD without BF16: Skylake-SP,
Cascade Lake, Ice Lake), ``avx512_bf16`` (+ vdpbf16ps: Cooper Lake, Zen 4 / 5), ``amx`` (+ AMX tiles:
Sapphire Rapids on).  ``DSATTN_CPU_ISA=<class>`` caps the compiled kernels at that class (every runtime
ISA test of ``native/`` goes through ``isa.h``), read once per process, as oneDNN's
``ONEDNN_MAX_CPU_ISA`` and ATen's ``ATEN_CPU_CAPABILITY`` are.  A value that names no class, or a class
above the CPU's own, is a ``ValueError`` naming the variable and the CPU's class.

The cap limits dsattn's own code.  To run a whole process as a smaller machine (PyTorch's matmuls,
oneDNN's and MKL's kernels too) set the libraries' own variables before torch starts:
:func:`environment` gives them all, ``python -m dsattn.native --below -- CMD`` runs ``CMD`` once
under each class below the CPU's own (what ``make test`` does with the kernel tests).
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys

CLASSES = ("generic", "avx2", "avx512", "avx512_bf16", "amx")
VARIABLE = "DSATTN_CPU_ISA"

# what each class is called by the libraries under dsattn: oneDNN, ATen's vectorised kernels, MKL
_ONEDNN = {"generic": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16",
           "amx": "AVX512_CORE_AMX"}
_ATEN = {"generic": "default", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512", "amx": "avx512"}
_MKL = {"generic": "SSE4_2", "avx2": "AVX2", "avx512": "AVX512", "avx512_bf16": "AVX512", "amx": "AVX512"}

_cache: dict = {}


def cpu_class() -> str:
    """The CPU's own class (PyTorch's cpuinfo, which reads the CPU, not ``ATEN_CPU_CAPABILITY``)."""
    if "own" not in _cache:
        _cache["own"] = _detect()
    return _cache["own"]


def _detect() -> str:
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386"):
        return "generic"
    import torch

    def has(name: str) -> bool:
        ask = getattr(torch.cpu, name)
        return bool(getattr(ask, "_dsattn_real", ask)())     # (the CPU's answer, not a capped class's)
    if not has("_is_avx2_supported"):
        return "generic"
    if not has("_is_avx512_supported"):
        return "avx2"
    if not has("_is_avx512_bf16_supported"):
        return "avx512"
    return "amx" if has("_is_amx_tile_supported") else "avx512_bf16"


def requested() -> str | None:
    """``DSATTN_CPU_ISA`` as a class name, or None where it is unset or empty; ValueError where it names no
    class or a class above the CPU's own."""
    value = os.environ.get(VARIABLE, "").strip().lower()
    if not value:
        return None
    own = cpu_class()
    if value not in CLASSES:
        raise ValueError(f"{VARIABLE}={value!r}: expected one of {', '.join(CLASSES)} (this CPU's class is {own!r})")
    if CLASSES.index(value) > CLASSES.index(own):
        raise ValueError(f"{VARIABLE}={value!r} is above this CPU's class {own!r}: a cap can only lower the class "
                         f"(one of {', '.join(CLASSES[:CLASSES.index(own) + 1])})")
    return value


def cpu_isa() -> str:
    """The class dsattn's code runs as: the CPU's own, capped by ``DSATTN_CPU_ISA`` (checked)."""
    return requested() or cpu_class()


def bf16_units() -> bool:
    """Whether the class multiplies bf16 natively (AVX512-BF16 or AMX).  Without, PyTorch's bf16 matmul is a
    scalar loop (about 1.4 GFLOP/s a core on a Zen 2) and every bf16 GEMM has to be widened to fp32."""
    return CLASSES.index(cpu_isa()) >= CLASSES.index("avx512_bf16")


def below(own: str | None = None) -> list[str]:
    """The classes below the CPU's own, highest first."""
    own = own or cpu_class()
    return list(reversed(CLASSES[:CLASSES.index(own)]))


def environment(cls: str) -> dict[str, str]:
    """The variables that make a fresh process run as class ``cls``: dsattn's cap and the libraries' own
    (read when each library starts, so they must be set before torch is imported)."""
    if cls not in CLASSES:
        raise ValueError(f"environment: expected one of {', '.join(CLASSES)}, got {cls!r}")
    return {VARIABLE: cls, "ONEDNN_MAX_CPU_ISA": _ONEDNN[cls], "ATEN_CPU_CAPABILITY": _ATEN[cls],
            "MKL_ENABLE_INSTRUCTIONS": _MKL[cls]}


def cap_onednn() -> None:
    """Where ``DSATTN_CPU_ISA`` caps the class and ``ONEDNN_MAX_CPU_ISA`` is unset, cap oneDNN to the same
    class (the ukernel the compiled GEMMs run on is oneDNN's).  oneDNN reads the variable when it first
    runs, so this holds where dsattn is imported before the process's first oneDNN call."""
    try:
        cls = requested()
    except ValueError:                  # (said where the compiled layer loads: native.load)
        return
    if cls is not None and cls != cpu_class():
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN[cls])


def describe() -> str:
    """One line for ``dsattn bench --which``."""
    cls, own = cpu_isa(), cpu_class()
    capped = f" (capped by {VARIABLE}; the CPU's own class is {own})" if cls != own else ""
    units = "bf16 GEMMs native" if bf16_units() else "no bf16 units: every GEMM widened to fp32"
    return f"CPU class: {cls}{capped}; {units}"


def run_below(command: list[str], own: str | None = None, only: list[str] | None = None) -> int:
    """Run ``command`` once under each class below the CPU's own (fresh processes, :func:`environment`), or
    each of ``only`` that is below it, every class whatever the others gave; prints each class's exit status
    at the end and returns the first non-zero one, else 0."""
    classes = [c for c in below(own) if only is None or c in only]
    if not classes:
        print(f"dsattn.native: this CPU's class is {own or cpu_class()!r}: no class below it"
              + (f" among {', '.join(only)}" if only is not None else "") + " to run", flush=True)
    codes = []
    for cls in classes:
        env = dict(os.environ, **environment(cls))
        print(f"== {VARIABLE}={cls} (oneDNN {env['ONEDNN_MAX_CPU_ISA']}, ATen {env['ATEN_CPU_CAPABILITY']}): "
              f"{' '.join(command)}", flush=True)
        codes.append(subprocess.run(command, env=env).returncode)
    if classes:
        print("== " + ", ".join(f"{VARIABLE}={cls}: " + ("passed" if code == 0 else f"exit status {code}")
                                for cls, code in zip(classes, codes)), flush=True)
    return next((code for code in codes if code != 0), 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--below"] and "--" in argv:
        options = argv[1:argv.index("--")]
        only = None
        if options[:1] == ["--only"] and len(options) == 2:
            only = options[1].split(",")
            unknown = [c for c in only if c not in CLASSES]
            if unknown:
                print(f"--only: unknown classes {unknown}: expected {', '.join(CLASSES)}", file=sys.stderr)
                return 2
        elif options:
            print("usage: python -m dsattn.native --below [--only CLASS,...] -- COMMAND ...", file=sys.stderr)
            return 2
        return run_below(argv[argv.index("--") + 1:], only=only)
    if not argv:
        print(describe())
        return 0
    print("usage: python -m dsattn.native [--below [--only CLASS,...] -- COMMAND ...]", file=sys.stderr)
    return 2
