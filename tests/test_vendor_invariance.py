"""The compiled layer's invariance promises hold whatever the vendor libraries under it choose.

MKL and oneDNN pick their kernels by the CPU's vendor and model, by the shapes and by the ISA they are capped at,
so a promise resting on them holds on the machine it was developed on and breaks on another (an AMD Zen 4 under
the generic cap gave rows of rows_matmul that depended on M, through MKL's sgemm).  Each case runs
tests/invariance_worker.py in a fresh process (the libraries read these variables once, when they start) with
the libraries pushed to another of their choices: MKL's conditional-numerical-reproducibility code path
(MKL_CBWR), its instruction cap (MKL_ENABLE_INSTRUCTIONS), oneDNN's (ONEDNN_MAX_CPU_ISA); the worker covers
thread counts 1 and 2 and M from 1 to 600.  Run under each DSATTN_CPU_ISA cap by ``make test``'s kernel part.
The promises are those of dsattn's own GEMM paths; AMX and oneDNN's bf16 path promise none
(test_batch_invariance.py says which path is which).
"""
import os
import subprocess
import sys

import pytest

from dsattn import native

# MKL and oneDNN moved one at a time (the other as the cap set it) and together.  "mkl-avx2" under the generic cap
# (oneDNN capped at SSE4.1, so ATen's fp32 brgemm fell back to MKL's sgemm) is what an AMD Zen 4 ran: MKL takes
# its AVX2 code path on AMD CPUs whatever MKL_ENABLE_INSTRUCTIONS asks; on an Intel CPU these settings force it.
SETTINGS = {
    "inherited": {},
    "mkl-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "mkl-sse4_2": {"MKL_CBWR": "SSE4_2", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "mkl-avx2": {"MKL_CBWR": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl-avx512": {"MKL_CBWR": "AVX512", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "onednn-sse41": {"ONEDNN_MAX_CPU_ISA": "SSE41"},
    "onednn-sse41-mkl-avx2": {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
}
WORKER = os.path.join(os.path.dirname(__file__), "invariance_worker.py")


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_invariance_whatever_the_vendor_libraries_choose(setting, native_module):
    if native.kernels() is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    env = dict(os.environ, **SETTINGS[setting])
    proc = subprocess.run([sys.executable, WORKER, "--families", "mla,indexer,compressor", "--seeds", "3",
                           "--seed", str(sum(map(ord, setting)))], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{setting} {SETTINGS[setting]}:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
