"""quant_lightning_indexer over FP8 keys against lightning_indexer over the same keys in bf16, side by side.

    python bench/quant_indexer_ab.py [--rounds 7] [--layers-bytes 64]

V4's CSA indexer decode (64 heads x 128, top-512 of ctx / 4 compressed keys, 64-token paged blocks in a random
order): the FP8 keys in vLLM's block layout (per block the tokens' e4m3 values, then their fp32 scales), the bf16
keys their dequantised values.  On a noisy machine single timings of the two differ by more than the two kernels
do, so the two calls alternate, ``--rounds`` times 5 calls each, and the best round of each is kept.  Prints the
milliseconds, the FP8 / bf16 time and the top-512 sets the two share.

Two protocols over the same keys, both in every run: **resident** (every call reads one cache, which stays in
the CPU's caches from call to call where it fits: the kernels' compute) and **a decode step** (each call reads the
next of as many copies of the cache as a model has layers, copies of ``--layers-bytes`` MiB of bf16 keys in all, as a
decode step reads each layer's indexer cache once with the other layers' data in between: the keys come from
memory, where FP8 moves half the bytes).  The copies hold the same keys, so the results are the same.
"""
from __future__ import annotations

import argparse
import time

import torch

from dsattn import ops
from dsattn.quant import pack_index_blocks, quantize_index_keys


def best_of_alternating(fa, fb, rounds: int, calls: int = 5, layers: int = 1) -> tuple[float, float]:
    """``fa(layer)`` / ``fb(layer)``: best mean milliseconds per call of ``rounds`` rounds, each ``calls`` calls
    (at least one pass over the ``layers``) of one then the other."""
    calls = max(calls, layers)
    for layer in range(layers):
        fa(layer), fb(layer)
    ta, tb = [], []
    at = 0
    for _ in range(rounds):
        for f, into in ((fa, ta), (fb, tb)):
            t = time.perf_counter()
            for c in range(calls):
                f((at + c) % layers)
            into.append((time.perf_counter() - t) / calls)
        at += calls
    return min(ta) * 1e3, min(tb) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers-bytes", type=float, default=64.0,
                    help="MiB of bf16 keys over all layer copies of the decode-step protocol (default 64: twice "
                         "a 32 MiB L3)")
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    H, D, bs, topk = 64, 128, 64, 512
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| B | ctx | protocol | layers | bf16 lightning_indexer ms | FP8 quant_lightning_indexer ms | FP8 / bf16 | "
          "top-512 sets shared |")
    print("|---|---|---|---|---|---|---|---|")
    for B, ctx in ((1, 8192), (1, 65536), (8, 8192), (8, 65536), (32, 8192), (32, 65536)):
        Kc = ctx // 4
        per = -(-Kc // bs)
        nb = B * per
        values, scales = quantize_index_keys(torch.randn(nb, bs, D, generator=g), torch.float8_e4m3fn)
        cache = pack_index_blocks(values, scales)
        keys = (values.float() * scales[..., None]).bfloat16().view(nb, bs, 1, D)
        q = torch.randn(B, 1, H, D, generator=g).bfloat16()
        w = torch.rand(B, 1, H, generator=g)
        kw = dict(seqused_k=torch.full((B,), Kc, dtype=torch.int32), layout_k="PA_BBND",
                  block_table=torch.randperm(nb, generator=g).view(B, per).to(torch.int32))

        layers = max(1, int(-(-args.layers_bytes * 2**20 // keys.nbytes)))
        key_copies = [keys] + [keys.clone() for _ in range(layers - 1)]
        cache_copies = [cache] + [cache.clone() for _ in range(layers - 1)]

        def bf16(layer=0):
            return ops.lightning_indexer(q, key_copies[layer], w, topk, **kw)[0]

        def fp8(layer=0):
            return ops.quant_lightning_indexer(q, cache_copies[layer], w, None, None, topk, 0,
                                               key_scale_layout="block", **kw)[0]

        a, b = bf16().view(B, topk), fp8().view(B, topk)
        shared = sum(len(set(a[i].tolist()) & set(b[i].tolist())) for i in range(B)) / (B * topk)
        for protocol, n in (("resident", 1), ("decode step", layers)):
            tb, tf = best_of_alternating(bf16, fp8, args.rounds, layers=n)
            print(f"| {B} | {ctx // 1024}K | {protocol} | {n} | {tb:.2f} | {tf:.2f} | {tf / tb:.2f} | {shared:.1%} |",
                  flush=True)
        del key_copies, cache_copies
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
