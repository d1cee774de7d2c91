"""DSATTN_CPU_ISA: the cap that makes any machine run a smaller CPU class's code (dsattn.native.isa)."""
import os
import subprocess
import sys

import pytest

from dsattn import native
from dsattn.native import isa


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, **env))


def test_classes_and_environment():
    assert isa.CLASSES == ("generic", "avx2", "avx512", "avx512_bf16", "amx")
    assert isa.cpu_class() in isa.CLASSES
    assert isa.below("avx512_bf16") == ["avx512", "avx2", "generic"] and isa.below("generic") == []
    env = isa.environment("avx2")
    assert env == {"DSATTN_CPU_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                   "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    with pytest.raises(ValueError, match="environment: expected one of"):
        isa.environment("avx3")


def test_unknown_value_is_a_value_error_naming_the_variable_and_the_class(monkeypatch):
    monkeypatch.setenv("DSATTN_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match=rf"DSATTN_CPU_ISA='avx3': expected one of .*this CPU's class is "
                                         rf"'{isa.cpu_class()}'"):
        isa.cpu_isa()


def test_cap_above_the_cpu_is_a_value_error(monkeypatch):
    monkeypatch.setitem(isa._cache, "own", "avx2")            # as an AVX2 machine sees it
    monkeypatch.setenv("DSATTN_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="DSATTN_CPU_ISA='avx512' is above this CPU's class 'avx2'"):
        isa.requested()
    monkeypatch.setenv("DSATTN_CPU_ISA", "AVX2 ")              # (case and spaces as oneDNN's variable allows)
    assert isa.cpu_isa() == "avx2" and not isa.bf16_units()
    monkeypatch.setenv("DSATTN_CPU_ISA", "")
    assert isa.cpu_isa() == "avx2"


def test_the_compiled_layer_refuses_a_bad_cap_by_name():
    proc = _run("from dsattn import native; native.load()", DSATTN_CPU_ISA="sse9")
    assert proc.returncode != 0
    assert "ValueError: DSATTN_CPU_ISA='sse9': expected one of" in proc.stderr


@pytest.mark.parametrize("cls", ["generic", "avx2", "avx512", "avx512_bf16"])
def test_the_compiled_layer_runs_as_the_capped_class(cls):
    if isa.CLASSES.index(cls) > isa.CLASSES.index(isa.cpu_class()):
        pytest.skip(f"this CPU's class is {isa.cpu_class()}")
    if native.kernels() is None:
        pytest.skip(native.status())
    proc = _run("from dsattn import native; m = native.kernels(); "
                "print(m.cpu_isa(), m.cpu_isa_own(), m.attention_gemm('bfloat16'), m.attention_gemm('float16'), "
                "m.cpu_has_avx512bf16())", DSATTN_CPU_ISA=cls)
    assert proc.returncode == 0, proc.stderr
    got, own, bf16, fp16, has_bf16 = proc.stdout.split()[-5:]
    assert got == cls and own == isa.cpu_class()
    if cls in ("generic", "avx2", "avx512"):               # no 16-bit products below AVX512-BF16
        assert (bf16, fp16, has_bf16) == ("fp32", "fp32", "False")
    else:
        assert bf16 in ("avx512bf16", "onednn") and fp16 == "fp32" and has_bf16 == "True"


def test_the_compiled_layer_reads_the_cap_as_the_checks_do():
    """Case and surrounding spaces do not count, on either side: the layer runs the class the check accepted."""
    if isa.CLASSES.index(isa.cpu_class()) < isa.CLASSES.index("avx2"):
        pytest.skip(f"this CPU's class is {isa.cpu_class()}")
    if native.kernels() is None:
        pytest.skip(native.status())
    proc = _run("from dsattn import native; print('as', native.kernels().cpu_isa())", DSATTN_CPU_ISA=" AVX2 ")
    assert proc.returncode == 0, proc.stderr
    assert "as avx2" in proc.stdout, proc.stdout


def test_run_below_runs_each_lower_class():
    proc = _run("import sys; from dsattn.native import isa; "
                "sys.exit(isa.run_below([sys.executable, '-c', 'import os; print(\"as\", os.environ[\"DSATTN_CPU_ISA\"])'], "
                "own='avx512'))")
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("as ")] == ["as avx2", "as generic"]


def test_run_below_runs_every_class_after_a_failing_one():
    # a red class must not hide the ones after it: each runs, each result is reported, the first failure is returned
    proc = _run("import sys; from dsattn.native import isa; "
                "sys.exit(isa.run_below([sys.executable, '-c', 'import os, sys; c = os.environ[\"DSATTN_CPU_ISA\"]; "
                "print(\"as\", c); sys.exit(3 if c == \"avx512\" else 0)'], own='avx512_bf16'))")
    assert proc.returncode == 3, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("as ")] == ["as avx512", "as avx2", "as generic"]
    assert "DSATTN_CPU_ISA=avx512: exit status 3, DSATTN_CPU_ISA=avx2: passed, DSATTN_CPU_ISA=generic: passed" in proc.stdout


def test_make_test_parts_run_after_a_failing_part():
    import os
    import subprocess
    parts = os.path.join(os.path.dirname(__file__), "..", ".ci", "parts")
    proc = subprocess.run(["bash", parts, "first", "exit 4", "second", "echo second ran"], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "second ran" in proc.stdout
    lines = proc.stdout.splitlines()
    summary = lines[lines.index("== parts of the run:") + 1:]
    assert "FAILED (exit 4)" in summary[0] and summary[0].split()[0] == "first"
    assert "passed" in summary[1] and summary[1].split()[0] == "second"
