"""CI runs the benchmarks' smoke version only: tiny shapes, every family, the fast path checked
against the golden; the full run is `dsattn bench`."""
import subprocess
import sys
from pathlib import Path

from dsattn.benchmarks import runner

ROOT = Path(__file__).resolve().parents[1]


def test_every_family_smoke_matches_golden():
    ceil, results = runner.run(smoke=True)
    assert ceil.bf16_gflops > 0 and ceil.fp32_gflops > 0 and ceil.copy_gbs > 0
    assert {r.family for r in results} == set(runner.FAMILIES)
    checks = {k: v for r in results for k, v in r.extra.items() if k.startswith("matches")}
    assert checks and all(checks.values()), checks
    text = runner.markdown(ceil, results, "dsattn bench --smoke")
    assert "Command: `dsattn bench --smoke`" in text and "| attention |" in text
    decode = [r for r in results if r.family == "attention" and "decode" in r.workload and r.variant == runner.BASE]
    assert decode and all(r.bytes > 0 and r.roofline(ceil) is not None for r in decode)
    assert " % (memory) |" in text or " % (compute) |" in text


def test_bench_script_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kv_quant.py"), "--smoke", "--no-record"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "QSFA decode" in proc.stdout


def test_emulated_avx2_bench_runs_the_fp32_path():
    """``--emulate-avx2`` re-runs the command in a fresh process limited to AVX2: its libraries' bf16
    GEMM falls to an AVX2 machine's crawl and the compiled kernels take their fp32 GEMMs."""
    proc = subprocess.run([sys.executable, "-m", "dsattn.cli", "bench", "--emulate-avx2", "--which"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    if "CPU attention forward: compiled" in proc.stdout:
        assert "bf16 widened to fp32 GEMMs (forced: DSATTN_NATIVE_GEMM=fp32)" in proc.stdout
