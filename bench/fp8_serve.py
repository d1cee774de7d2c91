"""Served decode of one DeepSeek-V3.2-shaped model in three formats, vLLM + dsattn: the released FP8 format (e4m3
weights, fp32 scales per 128 x 128 block: ``fp8_block_linear`` and dsattn's FP8 experts), the same model dequantised
to bf16 (what a user without FP8 kernels converts it to offline) and to float32.  Each run in a fresh process (vLLM
in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the same prompts, greedy: prefill seconds, decode tokens/s (all
requests) and the weight bytes a decode step streams.  (Random weights: the greedy tokens of the three formats are
near ties from the first steps on, so they are not compared here; the tests compare the formats' outputs.)

The model: 4 layers at hidden 2048 (16 heads, the real latent 512 + 64 and indexer 32 x 128), 32 routed experts of
512 (top 8) and a shared one: ~0.45 B parameters, random weights written here (nothing is downloaded).

    .venv-vllm/bin/python bench/fp8_serve.py [--cpu-isa avx512_bf16] [--batch 1,4] [--tokens 32]
"""
from __future__ import annotations

import argparse
import json
import os
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


def worker(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=2048, enforce_eager=True,
              kv_cache_memory_bytes=512 << 20, skip_tokenizer_init=True)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
    many = SamplingParams(max_tokens=1 + spec["tokens"], temperature=0, ignore_eos=True, detokenize=False)
    llm.generate(prompts, one, use_tqdm=False)                     # (warm-up)
    t = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    out = llm.generate(prompts, many, use_tqdm=False)
    total = time.perf_counter() - t
    decode = max(total - prefill, 1e-9)
    assert all(len(o.outputs[0].token_ids) == 1 + spec["tokens"] for o in out)
    return dict(prefill_s=prefill, decode_tok_s=len(prompts) * spec["tokens"] / decode)


def run(model: Path, dtype: str, prompts, tokens: int, env: dict) -> dict:
    spec = dict(model=str(model), dtype=dtype, prompts=prompts, tokens=tokens)
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **env), timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": ([ln for ln in proc.stderr.splitlines() if "Error" in ln] or ["failed"])[-1]}
    return json.loads(lines[-1][len("RESULT "):])


def weight_bytes(model: Path) -> dict:
    """Bytes a decode step streams per token at most: every dense weight plus top-k of the routed experts."""
    import safetensors.torch
    w = safetensors.torch.load_file(str(model / "model.safetensors"))
    routed = sum(t.numel() * t.element_size() for n, t in w.items() if ".mlp.experts." in n)
    other = sum(t.numel() * t.element_size() for n, t in w.items() if ".mlp.experts." not in n and "embed" not in n)
    share = WIDTHS["num_experts_per_tok"] / WIDTHS["n_routed_experts"]
    return dict(total_gb=(routed + other) / 1e9, per_token_gb=(other + routed * share) / 1e9)


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
          f"{torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        fp8, dequantised = tiny.write_dsa_fp8(Path(tmp), "DeepseekV32ForCausalLM", **WIDTHS)
        sizes = {"fp8": weight_bytes(fp8), "float32": weight_bytes(dequantised)}
        sizes["bfloat16"] = {k: v / 2 for k, v in sizes["float32"].items()}
        print(f"weights: FP8 {sizes['fp8']['total_gb']:.2f} GB, bf16 {sizes['bfloat16']['total_gb']:.2f} GB, "
              f"float32 {sizes['float32']['total_gb']:.2f} GB (a decode token streams at most "
              f"{sizes['fp8']['per_token_gb']:.2f} / {sizes['bfloat16']['per_token_gb']:.2f} / "
              f"{sizes['float32']['per_token_gb']:.2f} GB)\n")
        print("| batch | format | prefill s | decode tokens/s | vs FP8 |")
        print("|---|---|---|---|---|")
        for batch in (int(b) for b in args.batch.split(",")):
            prompts = tiny.prompts([PROMPT_LEN - 16 * i for i in range(batch)], WIDTHS["vocab_size"], seed=5)
            rows = {}
            for name, model, dtype in (("FP8 (shipped), bf16 activations", fp8, "bfloat16"),
                                       ("bf16 (dequantised)", dequantised, "bfloat16"),
                                       ("float32 (dequantised)", dequantised, "float32")):
                rows[name] = r = run(model, dtype, prompts, args.tokens, env)
                if "error" in r:
                    print(f"| {batch} | {name} | failed: {r['error']} | | |", flush=True)
                    continue
                base = next(iter(rows.values()))
                ratio = r["decode_tok_s"] / base["decode_tok_s"] if "error" not in base else float("nan")
                print(f"| {batch} | {name} | {r['prefill_s']:.2f} | {r['decode_tok_s']:.2f} | {ratio:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
