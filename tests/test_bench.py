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
    """``--emulate-avx2`` re-runs the command in a fresh process capped at AVX2: its libraries' bf16
    GEMM falls to an AVX2 machine's crawl and the compiled kernels take their fp32 GEMMs."""
    from dsattn.native import isa
    proc = subprocess.run([sys.executable, "-m", "dsattn.cli", "bench", "--emulate-avx2", "--which"],
                          capture_output=True, text=True, timeout=600)
    if isa.CLASSES.index(isa.cpu_class()) < isa.CLASSES.index("avx2"):
        assert proc.returncode == 2 and "below 'avx2'" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    assert "CPU class: avx2 (capped by DSATTN_CPU_ISA" in proc.stdout or isa.cpu_class() == "avx2", proc.stdout
    if "CPU attention forward: compiled" in proc.stdout:
        assert "bf16 widened to fp32 GEMMs (CPU class avx2: no 16-bit products)" in proc.stdout


def test_ceilings_leave_out_the_bf16_gemm_without_bf16_units(monkeypatch):
    """Under a cap without bf16 units the bf16 GEMM is not timed (PyTorch's would be a scalar loop there),
    and the table says so instead of a ratio."""
    from dsattn.benchmarks.harness import measure_ceilings
    monkeypatch.setenv("DSATTN_CPU_ISA", "generic")
    said = []
    ceil = measure_ceilings(256, progress=said.append)
    assert ceil.bf16_gflops is None and ceil.fp32_gflops > 0 and ceil.cpu_class == "generic"
    assert said == ["ceilings: float32 GEMM 256 x 256"]
    assert "bf16 GEMM not timed" in runner.markdown(ceil, [], "dsattn bench") and "no bf16 units" in ceil.describe()
