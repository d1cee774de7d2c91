"""Building and loading a compiled module so that no process is ever left waiting on another.

- **One directory per build input.**  The module's name, and so its directory under
  ``TORCH_EXTENSIONS_DIR``, carries a hash of what the build depends on: the sources and headers,
  the flags, the torch and Python versions and the compiler's version line.  Two dsattn versions (two
  venvs, a checkout and a wheel) each keep their own module and never rebuild each other's.
- **A lock that dies with its holder.**  Builders take ``fcntl.flock`` on ``<name>.lock`` beside
  the directory; the kernel drops it when the holding process exits, however it exits (Ctrl-C, a
  timeout's SIGKILL to the process group), so the next process takes over at once.  A process that
  finds the lock held waits with a message naming the holder's PID.
- **Built aside, renamed into place.**  The build runs in ``<name>.tmp-<pid>`` (a child interpreter
  with no stdin and a time limit); only a finished module, with its completion mark written last,
  is renamed to ``<name>``.  A directory without the mark is never imported.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time

BUILD_TIMEOUT_S = 900
_MARK = "dsattn.complete"


def _compiler_line() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        return (out.stdout.strip().splitlines() or [cxx])[0]
    except (OSError, subprocess.SubprocessError):
        return cxx


def build_key(sources: list[str], headers: list[str], cflags: list[str], ldflags: list[str]) -> str:
    """A hash of everything the build depends on (16 hex digits)."""
    import torch
    from .sources import files_digest
    return files_digest(list(sources) + list(headers),
                        json.dumps([torch.__version__, sys.version, _compiler_line(), cflags, ldflags]).encode())


def extensions_root() -> str:
    """Where modules are built: ``TORCH_EXTENSIONS_DIR`` (else torch's default) / a folder per Python and torch
    flavour, as torch.utils.cpp_extension lays it out."""
    import torch
    from torch.utils import cpp_extension
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    flavour = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    path = os.path.join(root, f"py{sys.version_info.major}{sys.version_info.minor}_{flavour}")
    os.makedirs(path, exist_ok=True)
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Lock:
    """An exclusive ``flock`` on ``path``, released by the kernel if this process dies."""

    def __init__(self, path: str, what: str, timeout_s: float, say=None):
        self.path, self.what, self.timeout_s = path, what, timeout_s
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.file = None

    def __enter__(self):
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "?"
            self.say(f"dsattn: waiting for process {holder}, which is building {self.what} ({self.path})...")
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        self.file.close()
                        raise RuntimeError(f"process {holder} has been building {self.what} for over "
                                           f"{self.timeout_s:.0f} s ({self.path})") from None
                    time.sleep(0.2)
        self.file.seek(0)
        self.file.truncate()
        self.file.write(str(os.getpid()))
        self.file.flush()
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def _import(name: str, directory: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(directory, f"{name}.so"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _complete(directory: str, key: str) -> bool:
    try:
        with open(os.path.join(directory, _MARK)) as f:
            return f.read() == key
    except OSError:
        return False


def _compile_in_child(name: str, sources, cflags, ldflags, directory: str, timeout_s: float) -> None:
    """Compile in a fresh interpreter with no stdin and a time limit: the compiler and ninja must not
    share this process's stdio (a pytest-xdist worker's stdin is its control channel)."""
    args = dict(name=name, sources=list(sources), extra_cflags=list(cflags), extra_ldflags=list(ldflags),
                build_directory=directory, verbose=False)
    code = "import json, sys; from torch.utils.cpp_extension import load; load(**json.loads(sys.argv[1]))"
    try:
        subprocess.run([sys.executable, "-c", code, json.dumps(args)], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=timeout_s, check=True)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the build took over {timeout_s:.0f} s") from None
    except subprocess.CalledProcessError as exc:
        lines = [x.strip() for x in ((exc.stderr or "") + "\n" + (exc.stdout or "")).splitlines() if x.strip()]
        # the compiler's own words where there are some ("x.cpp:12: error: ...", "c++: not found"), else the last line
        said = [x for x in lines if re.search(r"error:|not found|No such file|cannot execute", x)
                and not x.startswith(("Traceback", "File ", "raise ", "subprocess."))]
        raise RuntimeError((said or lines or [f"build exited {exc.returncode}"])[0 if said else -1][:400]) from None


def build_and_load(prefix: str, sources: list[str], headers: list[str] = (), cflags: list[str] = (),
                   ldflags: list[str] = (), *, announce: str = "", timeout_s: float = BUILD_TIMEOUT_S, say=None):
    """The module ``<prefix>_<key>`` built from ``sources`` (imported if already built), and its name.

    ``announce``: a line printed to stderr before a build starts.  Raises RuntimeError if the build
    fails or another live builder holds the lock for longer than ``timeout_s`` plus a minute."""
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    key = build_key(sources, headers, list(cflags), list(ldflags))
    name = f"{prefix}_{key}"
    root = extensions_root()
    final = os.path.join(root, name)
    if _complete(final, key):
        return _import(name, final), name
    with _Lock(os.path.join(root, f"{name}.lock"), f"the compiled module {name}", timeout_s + 60, say):
        if not _complete(final, key):             # (another process may have finished it while we waited)
            for entry in os.listdir(root):        # builds whose process is gone
                if entry.startswith(f"{name}.tmp-"):
                    pid = entry.rsplit("-", 1)[-1]
                    if not (pid.isdigit() and _pid_alive(int(pid))):
                        shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
            if announce:
                say(announce)
            tmp = os.path.join(root, f"{name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            try:
                _compile_in_child(name, sources, cflags, ldflags, tmp, timeout_s)
                with open(os.path.join(tmp, _MARK), "w") as f:
                    f.write(key)
                shutil.rmtree(final, ignore_errors=True)   # (an unfinished directory of an older scheme)
                os.rename(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return _import(name, final), name
