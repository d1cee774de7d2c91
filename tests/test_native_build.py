"""The compiled layer's build never leaves a process waiting (dsattn/native/build.py).

The tests build a small pybind11 module through the same code the kernel layer uses (the real one
takes a minute): a build killed mid-way (its whole process group, SIGKILL) is taken over at once by
the next process, a half-built directory is never imported, and two source variants live side by
side in one TORCH_EXTENSIONS_DIR without rebuilding each other."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dsattn.native import build

pytestmark = pytest.mark.skipif(not __import__("dsattn.native", fromlist=["x"]).compiler_available(),
                                reason="no C++ compiler")

SOURCE = textwrap.dedent("""
    #include <pybind11/pybind11.h>
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return %d; }); }
""")

LOADER = textwrap.dedent("""
    import sys, time
    from dsattn.native import build
    t = time.monotonic()
    module, name = build.build_and_load("dsattn_buildtest", [sys.argv[1]], announce="building")
    print(module.answer(), name, f"{time.monotonic() - t:.1f}")
""")


def _source(tmp_path, answer: int, name="mod.cpp") -> str:
    path = tmp_path / name
    path.write_text(SOURCE % answer)
    return str(path)


def _env(ext_dir) -> dict:
    return dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir))


def _load_in_fresh_process(src, ext_dir, timeout=300):
    out = subprocess.run([sys.executable, "-c", LOADER, src], env=_env(ext_dir), capture_output=True, text=True,
                         timeout=timeout, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-2000:]
    answer, name, seconds = out.stdout.split()
    return int(answer), name, float(seconds), out.stderr


def test_a_killed_build_is_taken_over_at_once(tmp_path):
    src, ext = _source(tmp_path, 41), tmp_path / "ext"
    proc = subprocess.Popen([sys.executable, "-c", LOADER, src], env=_env(ext), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:            # until the compiler is at work in the temporary directory
        building = [p for p in ext.rglob("*.tmp-*") if any(p.iterdir())] if ext.exists() else []
        if building:
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the build never started")
    os.killpg(proc.pid, signal.SIGKILL)           # what a timeout or Ctrl-C does to the whole group
    proc.wait()
    assert not any(p.name.startswith("dsattn_buildtest") and ".tmp-" not in p.name and p.is_dir()
                   for p in ext.rglob("*")), "a killed build left a directory under the module's name"
    t = time.monotonic()
    answer, name, seconds, err = _load_in_fresh_process(src, ext)
    assert answer == 41 and "waiting" not in err, err
    assert time.monotonic() - t < 240
    # and the next process imports it without building
    answer, name2, seconds, err = _load_in_fresh_process(src, ext)
    assert (answer, name2) == (41, name) and "building" not in err and seconds < 5, (err, seconds)


def test_source_variants_live_side_by_side(tmp_path):
    ext = tmp_path / "ext"
    a, b = _source(tmp_path, 1, "a.cpp"), _source(tmp_path, 2, "b.cpp")
    first_a = _load_in_fresh_process(a, ext)
    first_b = _load_in_fresh_process(b, ext)
    assert (first_a[0], first_b[0]) == (1, 2) and first_a[1] != first_b[1]
    for src, want, name in ((a, 1, first_a[1]), (b, 2, first_b[1])):
        answer, got, seconds, err = _load_in_fresh_process(src, ext)
        assert (answer, got) == (want, name) and "building" not in err, err


def test_a_live_builder_is_waited_for_with_a_message(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    root = build.extensions_root()
    lock = os.path.join(root, "x.lock")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        f = open({lock!r}, "a+"); fcntl.flock(f, fcntl.LOCK_EX); f.write(str(os.getpid())); f.flush()
        print("held", flush=True); time.sleep(1.5)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    said = []
    t = time.monotonic()
    with build._Lock(lock, "x", timeout_s=30, say=said.append):
        waited = time.monotonic() - t
    holder.wait()
    assert said and f"waiting for process {holder.pid}" in said[0], said
    assert 0.5 < waited < 10, waited


def test_a_builder_holding_the_lock_too_long_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    lock = os.path.join(build.extensions_root(), "y.lock")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, time
        f = open({lock!r}, "a+"); fcntl.flock(f, fcntl.LOCK_EX); print("held", flush=True); time.sleep(30)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match="for over 1 s"):
            with build._Lock(lock, "y", timeout_s=1, say=lambda m: None):
                pass
    finally:
        holder.kill()
        holder.wait()


def test_a_directory_without_its_completion_mark_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    src = _source(tmp_path, 7)
    answer, name, _, _ = _load_in_fresh_process(src, tmp_path / "ext")
    final = os.path.join(build.extensions_root(), name)
    os.remove(os.path.join(final, "dsattn.complete"))           # as if the rename had raced a crash
    with open(os.path.join(final, f"{name}.so"), "wb") as f:     # and the module were half written
        f.write(b"\0" * 16)
    answer, again, _, err = _load_in_fresh_process(src, tmp_path / "ext")
    assert (answer, again) == (7, name) and "building" in err


def test_dsattn_build_builds_or_finds_the_layer_and_says_where(monkeypatch, capsys, native_module):
    from dsattn.cli import main
    if native_module is None:
        pytest.skip("no compiled layer here")
    assert main(["build"]) == 0
    out = capsys.readouterr().out
    assert "native: loaded" in out and native_module.__file__ in out
    monkeypatch.setenv("DSATTN_NATIVE", "0")
    assert main(["build"]) == 2
    assert capsys.readouterr().err.startswith("dsattn build: error: DSATTN_NATIVE=0")


def test_a_build_error_is_the_compilers_own_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    src = tmp_path / "broken.cpp"
    src.write_text("#include <pybind11/pybind11.h>\nint broken( {\n")
    with pytest.raises(RuntimeError, match=r"broken\.cpp:\d+:\d+: error:"):
        build.build_and_load("dsattn_buildtest", [str(src)], say=lambda m: None)
    assert not [p for p in (tmp_path / "ext").rglob("*.tmp-*")], "a failed build left its temporary directory"
