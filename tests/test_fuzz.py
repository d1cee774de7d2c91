"""Seeded property-based fuzzing of every operator family against its golden (dsattn.cases.fuzz).

Each test draws a fresh base seed and checks ``CHUNK`` consecutive configurations; every KV /
state / cache row that no valid row may read is NaN (0xFF bytes for packed rows).  A failure
prints one line per failing configuration: the ``dsattn verify --fuzz 1 --family F --seed S``
command that reproduces it.  ``DSATTN_FUZZ_SEED`` pins the base seed; ``-m slow`` runs ten times
as many configurations.
"""
import os
import random

import pytest
import torch

from dsattn import testing
from dsattn.cases import fuzz

# family -> configurations in the default suite (3,000 in all; the issue asks >= 1,500), in chunks of CHUNK
BUDGET = {"mla": 1000, "sharedkv": 500, "packed": 300, "indexer": 400, "kl": 250, "qsfa": 250, "compressor": 300,
          "weights": 200}
CHUNK = 50


def _base_seed(family: str, chunk: int) -> int:
    pinned = os.environ.get("DSATTN_FUZZ_SEED")
    if pinned is not None:
        return int(pinned) + 1_000_003 * chunk
    return random.SystemRandom().randrange(2**31 - 10**6)


def _run(family: str, chunk: int, n: int):
    torch.set_num_threads(1)
    base = _base_seed(family, chunk)
    rep = fuzz.check_seeds(family, range(base, base + n))
    assert rep.configs == n and rep.compared >= n
    assert not rep.failures, f"{len(rep.failures)} failing configurations of {family} " \
                             f"(seeds {base}..{base + n - 1}):\n" + "\n".join(rep.failures[:20])


@pytest.mark.parametrize("family,chunk", [(f, c) for f, n in BUDGET.items() for c in range(n // CHUNK)])
def test_fuzz(family, chunk):
    _run(family, chunk, CHUNK)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(BUDGET))
def test_fuzz_large(family):
    _run(family, 0, 10 * BUDGET[family])


def test_budget_is_at_least_1500_configurations():
    assert sum(n // CHUNK * CHUNK for n in BUDGET.values()) >= 1500


def test_the_suite_catches_a_stray_read(monkeypatch):
    """The suite can fail: a kernel whose key range reaches one row past each row's window or
    causal end reads rows that no valid query may read (NaN) or the wrong key."""
    import dsattn.sparse_mla.banded as banded
    import dsattn.sparse_mla.problem as problem
    rule = problem.ori_range_t

    def one_too_far(p, S2o, om, wl, wr):
        lo, hi = rule(p, S2o, om, wl, wr)
        return lo, hi + 1

    monkeypatch.setattr(problem, "ori_range_t", one_too_far)
    monkeypatch.setattr(banded, "ori_range_t", one_too_far)
    rep = fuzz.check_seeds("mla", range(40))
    assert len(rep.failures) >= 10


def test_pooled_share_is_judged_on_a_pool_of_enough_elements():
    """A share rule over fewer than POOL_BELOW pooled elements is noise (4 outliers in 776 is 99.48 %);
    over a pool that large it is judged."""
    small = fuzz.FuzzReport("sharedkv", pool=testing.StatisticsPool({("bf16-cross-order", 0.995): [772.0, 776]}))
    assert not fuzz.check_pooled(small).failures
    big = fuzz.FuzzReport("sharedkv", pool=testing.StatisticsPool(
        {("bf16-cross-order", 0.995): [testing.POOL_BELOW * 0.99, testing.POOL_BELOW]}))
    assert fuzz.check_pooled(big).failures


def _bf16_pair(n, seed, outliers=0, shift=0.0):
    """A bf16 golden and a copy with ``outliers`` elements moved outside the inner bound (inside the outer
    one) and every element moved by ``shift``."""
    g = torch.Generator().manual_seed(seed)
    want = (torch.randn(n, generator=g) + 2.0).to(torch.bfloat16)
    got = want.float() + shift
    got[:outliers] *= 1.05
    return got.to(torch.bfloat16), want


def test_draws_pool_the_statistics_of_small_tensors():
    """One outlier in a 512-element bf16 tensor fails the 99.9 % share on its own; pooled over further draws
    it holds once the share does (two draws), one outlier in each draw fails once the pool holds
    POOL_BELOW elements (four draws), a draw that passes is the only one, and a bound every element must
    meet fails at once, naming its seed."""
    seen = []

    def check(outliers, shift=0.0):
        def one(seed):
            seen.append(seed)
            got, want = _bf16_pair(512, seed, outliers(seed), shift)
            return [("out", testing.compare(got, want))]
        return one

    assert not testing.compare(*_bf16_pair(512, 0, 1))
    assert testing.check_draws(check(lambda s: int(s == 10)), range(10, 20)) == [] and seen == [10, 11]
    seen.clear()
    assert testing.check_draws(check(lambda s: 0), range(10, 20)) == [] and seen == [10]
    seen.clear()
    failed = testing.check_draws(check(lambda s: 1), range(10, 20))
    assert seen == [10, 11, 12, 13] and failed == ["pooled bf16-cross-order share 99.8047% < 99.9% over 2048 elements"]
    seen.clear()
    failed = testing.check_draws(check(lambda s: 0, shift=0.5), range(10, 20))
    assert seen == [10] and failed[0].startswith("seed 10: out: bf16-cross-order: FAIL")
