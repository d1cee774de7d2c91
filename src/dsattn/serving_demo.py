"""``dsattn demo``: a serving simulation of DeepSeek-V4 attention on the library's operators.

A few dozen ragged requests go through chunked prefill (a token budget per step) and then
decode steps, through a stack of the three layer types (SWA, CSA, HCA) over paged caches,
with one plan per layer type per step built from CPU mirrors.  At the end every request's
final hidden states are checked against a dense float64 reference of the same layers, and a
summary reports throughput, cache bytes per token, planner balance and the time share of
each operator.
"""
from __future__ import annotations

import time

import torch

from .model import PRESETS, DeepseekV4Attention
from .model.layer import PagedBatch, kv_row_bytes
from .model.reference import reference_layer
from .planner import report
from .planner.params import plan_params
from .planner.table import decode

RATIOS = (0, 4, 128)


def _schedule(lengths, budget, decode_steps):
    """Chunked prefill under a per-step token budget, then ``decode_steps`` single tokens each."""
    left = list(lengths)
    steps = []
    while any(left):
        step, room = {}, budget
        for b, n in enumerate(left):
            take = min(n, room)
            if take:
                step[b] = take
                left[b] -= take
                room -= take
        steps.append(("prefill", step))
    steps += [("decode", {b: 1 for b in range(len(lengths))}) for _ in range(decode_steps)]
    return steps


KV_CACHE = {"model": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def cache_bytes_per_token(cfg, kv_dtype, index_dtype=torch.bfloat16) -> float:
    """KV bytes one token adds to the stack of the three layer types: a window row per layer, a
    compressed row per ``r`` tokens, an indexer key row per 4 tokens (CSA)."""
    row = kv_row_bytes(cfg, kv_dtype)
    total = 0.0
    for r in RATIOS:
        total += row + (row / r if r else 0.0)
        if r == 4:
            total += cfg.index_dim * index_dtype.itemsize / 4
    return total


def run(requests: int = 32, decode_steps: int = 24, preset: str = "small", dtype=torch.float32, budget: int = 512,
        seed: int = 0, console=None, check: bool = True, kv_cache: str = "model") -> bool:
    """``kv_cache``: ``"model"`` (caches in the layer dtype), ``"int8"`` or ``"fp8"`` (packed rows)."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table
    console = console or Console()
    cfg = PRESETS[preset]
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(8, 160 if preset == "small" else 600, (requests,), generator=g).tolist()
    totals = [p + decode_steps for p in prompt]
    tokens = [torch.randn(t, cfg.hidden, generator=g).to(dtype) for t in totals]
    if kv_cache not in KV_CACHE:
        raise ValueError(f"kv_cache: value {kv_cache!r} is not one of {list(KV_CACHE)}")
    layers = [DeepseekV4Attention(cfg, r, seed=seed + k, dtype=dtype, kv_cache_dtype=KV_CACHE[kv_cache])
              for k, r in enumerate(RATIOS)]
    max_pages = max(-(-t // cfg.page_size) for t in totals) + 1
    num_pages = requests * max_pages + 2
    pb = PagedBatch(cfg, num_pages, max_pages, release_old_pages=True)
    caches = [layer.new_caches(num_pages) for layer in layers]
    hidden_out = {b: [] for b in range(requests)}
    inputs = {b: [[] for _ in layers] for b in range(requests)}    # per layer input rows (reference chain)
    tops = {b: [] for b in range(requests)}
    done = [0] * requests
    timing = {"prefill": [0.0, 0], "decode": [0.0, 0]}
    balance = []
    sched = _schedule(prompt, budget, decode_steps)
    ops_time: dict = {}
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(f"serving {requests} requests ({preset}, {str(dtype).split('.')[-1]}, "
                            f"KV cache {kv_cache})", total=len(sched))
        for mode, step_spec in sched:
            reqs = list(step_spec)
            news = [step_spec[b] for b in reqs]
            t0 = time.perf_counter()
            step = pb.step(reqs, news, cfg.heads, RATIOS)
            h = torch.cat([tokens[b][done[b]:done[b] + n] for b, n in zip(reqs, news)])
            for k, layer in enumerate(layers):
                o = 0
                for b, n in zip(reqs, news):
                    inputs[b][k].append(h[o:o + n])
                    o += n
                h = h + layer.forward(h, step, caches[k], timer=ops_time)
                if layer.ratio == 4:
                    o = 0
                    for b, n in zip(reqs, news):
                        tops[b].append(layer.last_topk[o:o + n, 0])
                        o += n
            timing[mode][0] += time.perf_counter() - t0
            timing[mode][1] += sum(news)
            o = 0
            for b, n in zip(reqs, news):
                hidden_out[b].append(h[o:o + n])
                done[b] += n
                o += n
            # the balance of the CSA plan this step actually used (read back from its table)
            pp = plan_params(cfg.heads, 1, cfg.head_dim, cu_seqlens_q=step.cu_seqlens_q_cpu,
                             seqused_kv=step.seqused_kv_cpu, layout_q="TND", cmp_ratio=4,
                             cmp_topk=cfg.index_topk, ori_win_left=cfg.window - 1)
            balance.append(report.balance(report.core_loads(pp, decode(step.plans[4])), pp.aic))
            bar.advance(task)
    # packed caches: the reference is unquantised, so the bound is the quantiser's error (int8 steps of
    # 1/254 of a tile's max, e4m3 steps of 2^-4 relative), carried through the three layers
    tol = {"model": 1e-4 if dtype == torch.float32 else 3e-2, "int8": 2e-2, "fp8": 8e-2}[kv_cache]
    worst = 0.0
    if check:
        for b in range(requests):
            x = tokens[b].double()
            top = torch.cat(tops[b]) if tops[b] else None
            for k, layer in enumerate(layers):
                x = x + reference_layer(layer, x, top if layer.ratio == 4 else None)
            got = torch.cat(hidden_out[b]).double()
            worst = max(worst, float(((got - x).abs() / (x.abs().max() + 1e-30)).max()))
    total_ops = sum(ops_time.values()) or 1
    table = Table(title=f"dsattn demo: {requests} requests, {len(sched)} steps ({len(sched) - decode_steps} chunked "
                        f"prefill, {decode_steps} decode), layers SWA + CSA + HCA, preset {preset}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for mode in ("prefill", "decode"):
        secs, n = timing[mode]
        table.add_row(f"{mode} throughput", f"{n / secs:,.0f} tokens/s ({n} tokens, {secs:.2f} s)" if secs else "-")
    bf16_row, packed_row = kv_row_bytes(cfg, torch.bfloat16), kv_row_bytes(cfg, torch.int8)
    nope = cfg.head_dim - cfg.rope_dim
    table.add_row("KV row bytes (window / compressed)",
                  f"bf16 {bf16_row} B, int8 packed {packed_row} B ({nope} nope in tiles of {cfg.kv_quant_tile} "
                  f"+ {cfg.rope_dim} bf16 rope + fp32 scales); this run: {layers[0].kv_row_bytes} B")
    bf16_tok, packed_tok = cache_bytes_per_token(cfg, torch.bfloat16), cache_bytes_per_token(cfg, torch.int8)
    table.add_row("KV cache bytes per token (SWA + CSA + HCA layers)",
                  f"bf16 {bf16_tok:,.0f} B, int8 packed {packed_tok:,.0f} B ({bf16_tok / packed_tok:.2f}x tokens "
                  f"per byte)")
    held = sum(p >= 0 for pages in pb.raw_pages.values() for p in pages)
    kept = sum(-(-n // cfg.page_size) for n in pb.lengths.values())
    table.add_row("raw pages held at the end (window KV + compressor state)",
                  f"{held} of {kept} ({kept - held} released: older than the window and the open groups)")
    table.add_row("planner balance (CSA plan, 24 cores; max / ideal)",
                  f"mean {sum(balance) / len(balance):.3f}, worst {max(balance):.3f}")
    for name, us in sorted(ops_time.items(), key=lambda kv: -kv[1]):
        table.add_row(f"time share: {name}", f"{100 * us / total_ops:.1f} % ({us:.2f} s)")
    if check:
        table.add_row("final hidden states vs dense float64 reference (max error / max |ref|)",
                      f"{worst:.2e} (bound {tol:g}{'' if kv_cache == 'model' else ': unquantised reference'})")
    console.print(table)
    ok = (not check) or worst <= tol
    console.print("[green]every request's final hidden states match the dense float64 reference[/green]" if ok
                  else f"[red]hidden states differ from the reference by {worst:.2e} > {tol}[/red]")
    return ok
