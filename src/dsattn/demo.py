"""``dsattn demo``: a DeepSeek-V4-Flash-shaped CSA layer step, fast path against the golden.

One prefill of ``tokens`` tokens: 64 query heads of width 512, sliding window 128, ratio 4
with top-512 compressed keys picked by the lightning indexer (64 heads x 128), sinks, the
attention forward and backward, and the indexer's KL-loss gradient fed by the backward's
``cmp_softmax_l1_norm``.  Prints the agreement with the golden and both timings.
"""
from __future__ import annotations

import time

import torch

from . import ops, reference, testing


def _timed(fn, warmup: bool = False):
    """Seconds of one call; ``warmup`` runs it once first (first-call allocations excluded)."""
    if warmup:
        fn()
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def build_inputs(tokens: int = 384, heads: int = 64, dim: int = 512, ratio: int = 4, topk: int = 512,
                 dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    L, Kc = tokens, tokens // ratio
    return dict(
        q=rnd(1, L, heads, dim), kv=rnd(1, L, 1, dim), cmp_kv=rnd(1, Kc, 1, dim),
        sinks=rnd(heads, dt=torch.float32), dout=rnd(1, L, heads, dim, scale=0.1),
        idx_q=rnd(1, L, 64, 128), idx_k=rnd(1, Kc, 1, 128),
        idx_w=rnd(1, L, 64, dt=torch.float32, scale=128 ** -0.5 * 64 ** -0.5),
        resid=torch.tensor([L % ratio], dtype=torch.int32), ratio=ratio, topk=topk, scale=dim ** -0.5)


def run(tokens: int = 384, dtype=torch.bfloat16, console=None):
    from rich.console import Console
    from rich.table import Table
    console = console or Console()
    x = build_inputs(tokens, dtype=dtype)
    ikw = dict(mask_mode=3, cmp_ratio=x["ratio"], cmp_residual_k=x["resid"])
    akw = dict(ori_kv=x["kv"], cmp_kv=x["cmp_kv"], sinks=x["sinks"], cmp_residual_kv=x["resid"],
               softmax_scale=x["scale"], cmp_ratio=x["ratio"], ori_mask_mode=4, cmp_mask_mode=3,
               ori_win_left=127, ori_win_right=0)
    table = Table(title=f"DeepSeek-V4-Flash CSA step: {tokens} tokens, 64 heads x 512, window 128, "
                        f"ratio 4, top-{x['topk']}, {str(dtype).split('.')[-1]}")
    for col in ("stage", "output", "rule", "max abs err", "within tol", "result", "fast (s, warm)", "golden (s)",
                "speed-up"):
        table.add_column(col)
    ok = True

    def add(stage, names, fast, gold, tf, tg, results):
        nonlocal ok
        for n, r in zip(names, results):
            ok &= r.passed
            table.add_row(stage, n, r.rule, f"{r.max_abs:.2e}", f"{100 * r.fraction:.2f}%",
                          "[green]pass" if r.passed else "[red]FAIL", f"{tf:.3f}", f"{tg:.3f}", f"{tg / tf:.1f}x")
            stage, tf, tg = "", tf, tg

    (idx, val), tf = _timed(lambda: ops.lightning_indexer(x["idx_q"], x["idx_k"], x["idx_w"], x["topk"],
                                                          return_value=1, **ikw), True)
    (gidx, gval), tg = _timed(lambda: reference.lightning_indexer(x["idx_q"], x["idx_k"], x["idx_w"], x["topk"],
                                                                  return_value=1, **ikw))
    add("lightning_indexer", ["indices"], None, None, tf, tg,
        [testing.compare_indexer(idx, val, gidx, gval, gidx, gval)])
    (o, lse), tf = _timed(lambda: ops.sparse_flash_mla(x["q"], cmp_sparse_indices=gidx, return_softmax_lse=True, **akw),
                       True)
    (go, glse), tg = _timed(lambda: reference.sparse_flash_mla(x["q"], cmp_sparse_indices=gidx,
                                                               return_softmax_lse=True, **akw))
    add("sparse_flash_mla", ["attn_out", "softmax_lse"], None, None, tf, tg,
        [testing.compare(o, go), testing.compare(lse, glse)])
    grads, tf = _timed(lambda: ops.sparse_flash_mla_grad(x["q"], x["dout"], go, glse, cmp_sparse_indices=gidx, **akw),
                       True)
    ggrads, tg = _timed(lambda: reference.sparse_flash_mla_grad(x["q"], x["dout"], go, glse,
                                                                cmp_sparse_indices=gidx, **akw))
    add("sparse_flash_mla_grad", ["dq", "dori_kv", "dcmp_kv", "dsinks", "cmp_softmax_l1_norm"], None, None, tf, tg,
        [testing.compare(a, e) for i, (a, e) in enumerate(zip(grads, ggrads)) if i != 4])
    p = ggrads[5]
    kl, tf = _timed(lambda: ops.sparse_lightning_indexer_kl_loss_grad(
        x["idx_q"], x["idx_k"], x["idx_w"], gidx, p, layout_q="BSND", layout_k="BSND", **ikw), True)
    gkl, tg = _timed(lambda: reference.sparse_lightning_indexer_kl_loss_grad(
        x["idx_q"], x["idx_k"], x["idx_w"], gidx, p, layout_q="BSND", layout_k="BSND", **ikw))
    add("indexer_kl_loss_grad", ["dq", "dk", "dw", "softmax_out"], None, None, tf, tg,
        [testing.compare(a, e) for a, e in zip(kl, gkl)])
    console.print(table)
    sel = int((gidx >= 0).sum())
    console.print(f"selected compressed keys: {sel} over {tokens} queries "
                  f"(at most {tokens // 4} visible per query); every output "
                  + ("[green]agrees with the golden[/green]" if ok else "[red]DISAGREES with the golden[/red]"))
    return ok
