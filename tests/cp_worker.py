"""Spawned by test_context_parallel.py:
``python cp_worker.py WORLD OUTDIR RATIO SPARSE [FAIL_RANK [BACKEND]]``.

Builds one long request (seeded, identical on every rank), gives rank k the k-th shard of the
raw and compressed caches (uneven cuts, one through the window), runs
``context_parallel_attention`` over gloo (CPU tensors) or nccl (rank k on cuda:k) and saves
each rank's merged output (on the CPU)."""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

L, S1, H, D = 700, 5, 4, 16


def problem(ratio, sparse):
    g = torch.Generator().manual_seed(1234 + ratio)
    q = torch.randn(S1, H, D, generator=g)
    ori = torch.randn(L, 1, D, generator=g)
    cmp = torch.randn(L // ratio, 1, D, generator=g) if ratio > 1 else None
    sinks = torch.randn(H, generator=g)
    idx = torch.randint(-1, L // ratio + 2, (S1, 1, 16), generator=g, dtype=torch.int32) if sparse else None
    return q, ori, cmp, sinks, idx


def cuts(world):
    """Uneven shard boundaries; for 2 and 3 ranks one boundary cuts through the window."""
    return {1: [0, L], 2: [0, 640, L], 3: [0, 260, 650, L]}[world]


def worker(rank, world, outdir, ratio, sparse, fail_rank=-1, backend="gloo"):
    import datetime
    dev = torch.device("cpu")
    if backend == "nccl":
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"file://{outdir}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from dsattn.serving import context_parallel_attention
    q, ori, cmp, sinks, idx = (None if t is None else t.to(dev) for t in problem(ratio, sparse))
    c = cuts(world)
    branch = dict(softmax_scale=D ** -0.5, cmp_ratio=ratio)
    if cmp is not None:
        cc = [x // ratio for x in c]
        branch.update(cmp_shard=cmp[cc[rank]:cc[rank + 1]], cmp_start=cc[rank], cmp_sparse_indices=idx)
    if rank == fail_rank:
        sinks = sinks.double()                   # a bad argument on one rank: TypeError naming sinks
    try:
        out = context_parallel_attention(q, ori[c[rank]:c[rank + 1]], c[rank], L, sinks=sinks, **branch)
    except RuntimeError:
        if 0 <= fail_rank != rank:
            # the failing rank's exit closed this rank's connection: wait (the launcher stops this process
            # when it sees the failing rank's error), so that the launcher reports the failing rank's
            # error, not this consequence of it (which it did about once in four runs)
            time.sleep(60)
        raise
    torch.save(out.cpu(), os.path.join(outdir, f"out{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    world, outdir, ratio, sparse = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    fail_rank = int(sys.argv[5]) if len(sys.argv) > 5 else -1
    backend = sys.argv[6] if len(sys.argv) > 6 else "gloo"
    mp.spawn(worker, args=(world, outdir, ratio, sparse, fail_rank, backend), nprocs=world, join=True)
