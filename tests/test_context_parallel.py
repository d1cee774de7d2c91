"""60-serving §7.2: key-sharded context parallelism over torch.distributed (gloo, 2 and 3
spawned processes, each run under a timeout so a failure never hangs CI) against the
single-process attention; the sink counted exactly once."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsattn import reference, testing
from dsattn.common.softmax import merge_attention_states
from dsattn.serving.context_parallel import shard_partial

sys.path.insert(0, str(Path(__file__).parent))
import cp_worker  # noqa: E402

SCEN = [(1, False), (4, True), (128, False)]


def single_process(ratio, sparse):
    q, ori, cmp, sinks, idx = cp_worker.problem(ratio, sparse)
    L, S1, D = cp_worker.L, cp_worker.S1, cp_worker.D
    kw = dict(ori_kv=ori, cu_seqlens_q=torch.tensor([0, S1], dtype=torch.int32),
              cu_seqlens_ori_kv=torch.tensor([0, L], dtype=torch.int32), sinks=sinks, softmax_scale=D ** -0.5,
              ori_mask_mode=4, ori_win_left=127, layout_q="TND", layout_kv="TND")
    if cmp is not None:
        kw.update(cmp_kv=cmp, cu_seqlens_cmp_kv=torch.tensor([0, L // ratio], dtype=torch.int32), cmp_ratio=ratio,
                  cmp_mask_mode=3, cmp_residual_kv=torch.tensor([L % ratio], dtype=torch.int32))
        if idx is not None:
            kw["cmp_sparse_indices"] = idx
    return reference.sparse_flash_mla(q, compute_dtype=torch.float64, **kw)[0]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("ratio,sparse", SCEN, ids=["SWA", "CSA", "HCA"])
def test_spawned_ranks_match_single_process(world, ratio, sparse, tmp_path):
    proc = subprocess.run([sys.executable, str(Path(cp_worker.__file__)), str(world), str(tmp_path), str(ratio),
                           "1" if sparse else "0"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    outs = [torch.load(tmp_path / f"out{r}.pt") for r in range(world)]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])                         # every rank holds the same result
    res = testing.fp32_math_close(outs[0], single_process(ratio, sparse))
    assert res, res


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
                         and torch.distributed.is_nccl_available()), reason="NCCL needs two GPUs")
@pytest.mark.parametrize("ratio,sparse", SCEN, ids=["SWA", "CSA", "HCA"])
def test_nccl_ranks_match_single_process(ratio, sparse, tmp_path):
    proc = subprocess.run([sys.executable, str(Path(cp_worker.__file__)), "2", str(tmp_path), str(ratio),
                           "1" if sparse else "0", "-1", "nccl"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    outs = [torch.load(tmp_path / f"out{r}.pt") for r in range(2)]
    assert torch.equal(outs[0], outs[1])
    res = testing.fp32_math_close(outs[0], single_process(ratio, sparse))
    assert res, res


def test_sink_counted_once_and_empty_shards():
    """Merging in-process: a sink passed to every partial would be counted once per partial; the
    helper passes none to the partials.  A shard with no visible key is an invalid partial."""
    ratio, sparse = 4, True
    q, ori, cmp, sinks, idx = cp_worker.problem(ratio, sparse)
    L, D = cp_worker.L, cp_worker.D
    parts = []
    for a, b in ((0, 100), (100, 640), (640, L)):
        parts.append(shard_partial(q, ori[a:b], a, L, cmp_shard=cmp[a // 4:b // 4], cmp_start=a // 4,
                                   cmp_sparse_indices=idx, softmax_scale=D ** -0.5, cmp_ratio=4))
    want = single_process(ratio, sparse)
    good, _ = merge_attention_states([p[0] for p in parts], [p[1] for p in parts], sinks=sinks,
                                     valid=[p[2] for p in parts])
    assert testing.fp32_math_close(good, want)
    # the first shard holds no window key; with no compressed key selected there it is empty
    no_keys = shard_partial(q, ori[:0], 0, L, softmax_scale=D ** -0.5)
    assert not no_keys[2].any()


def test_a_failing_rank_fails_the_run_with_its_error_within_the_timeout(tmp_path):
    """Rank 1 raises before the collectives; the others, blocked in all_gather, are stopped and the
    launcher reports rank 1's error (well within the 180 s guard)."""
    proc = subprocess.run([sys.executable, str(Path(cp_worker.__file__)), "3", str(tmp_path), "4", "1", "1"],
                          capture_output=True, text=True, timeout=180)
    tail = proc.stderr[-3000:]                   # shown if an assertion fails (a rare failure here was not kept)
    assert proc.returncode != 0, tail
    assert "sinks: dtype torch.float64 is not supported" in proc.stderr, tail
    assert "Process 1 terminated" in proc.stderr, tail
