"""The installed artifact (``make test`` installs the wheel it builds, not the source tree): its compiled layer
loads in a fresh interpreter with no compiler reachable and the first op returns in seconds; a wheel on a torch
it was not built for says so once, naming both versions, and the PyTorch path runs."""
import json
import os
import subprocess
import sys
import time

import pytest

from dsattn import native

INFO = native.prebuilt_info()
needs_wheel = pytest.mark.skipif(INFO is None, reason="dsattn is not installed from a wheel holding its compiled "
                                                       "layer (make test builds and installs one)")

FIRST_OP = """
import json, sys, time, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as said:
    import torch
    from dsattn import cases, native
    {patch}
    c = cases.mla_case("BSND", 4, torch.bfloat16, seed=3)
    out = torch.ops.dsattn.sparse_flash_mla(c.q, **c.kwargs)[0]
    seconds = time.time() - float(sys.argv[1])
with native.suspended():
    want = torch.ops.dsattn.sparse_flash_mla(c.q, **c.kwargs)[0]
print("RESULT " + json.dumps(dict(seconds=seconds, status=native.status(), module=native.load() is not None,
      close=bool(torch.allclose(out.float(), want.float(), atol=2e-2, rtol=2e-2)), finite=bool(out.isfinite().all()),
      warnings=[str(w.message) for w in said if issubclass(w.category, RuntimeWarning)])))
"""


def no_compiler_env(tmp_path) -> dict:
    """PATH without cc / c++ / g++, CXX=/bin/false, and an empty build cache: only the wheel can serve."""
    bare = tmp_path / "bin"
    bare.mkdir()
    return dict(os.environ, PATH=str(bare), CXX="/bin/false", CC="/bin/false",
                TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"), DSATTN_NATIVE="1")


def first_op(tmp_path, patch: str = "") -> dict:
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", FIRST_OP.format(patch=patch), str(start)], capture_output=True,
                          text=True, env=no_compiler_env(tmp_path), timeout=300, cwd=str(tmp_path))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@needs_wheel
def test_wheel_layer_loads_without_a_compiler_and_the_first_op_returns_in_seconds(tmp_path):
    r = first_op(tmp_path)
    assert r["module"] and "the wheel's module" in r["status"], r
    assert r["close"] and r["finite"] and not r["warnings"], r
    assert r["seconds"] < 10, f"first op {r['seconds']:.1f} s after the interpreter started"


@needs_wheel
def test_wheel_for_another_torch_says_so_once_and_runs_the_pytorch_path(tmp_path):
    r = first_op(tmp_path, patch="info = native.prebuilt_info(); "
                                 "native.prebuilt_info = lambda: dict(info, torch='2.99.0+cpu')")
    assert not r["module"] and r["close"] and r["finite"], r
    assert len(r["warnings"]) == 1, r["warnings"]
    said = r["warnings"][0]
    import torch
    assert "2.99.0+cpu" in said and torch.__version__ in said and "no C++ compiler" in said, said
    assert "2.99.0+cpu" in r["status"] and r["status"].startswith("native: unavailable"), r["status"]


@needs_wheel
def test_wheel_records_its_torch_and_requires_that_minor():
    import importlib.metadata

    import torch
    assert INFO["torch"] == torch.__version__
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    requires = importlib.metadata.requires("dsattn")
    assert f"torch=={major}.{minor}.*" in requires and not any(r.startswith("matplotlib") and "extra" not in r
                                                                for r in requires), requires


def test_edited_sources_are_not_served_by_an_installed_module(monkeypatch):
    """A module built from other sources (an edited checkout) is not loaded: the first-use build takes over."""
    monkeypatch.setattr(native, "prebuilt_info", lambda: dict(torch=__import__("torch").__version__,
                                                              sources_key="0" * 16))
    monkeypatch.setattr(native, "_state", {})
    assert native._load_prebuilt() is None
    assert "sources differ" in native._state["prebuilt"]
