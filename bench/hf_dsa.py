"""transformers' DSA models on a long prompt: the model's own eager attention against
``dsattn.integrations.transformers.enable(model)``, peak RSS and time of one prefill forward (bf16, no cache),
for a two-layer model at the real attention widths of each family (DeepSeek-V3.2: 128 heads, indexer 64 x 128;
GLM-5: 64 heads, nope 192, v 256, indexer 32 x 128, the second layer IndexShare; GLM-5.3-Flash: 64 heads, no rope,
nope / v 256, KPool indexer 32 x 128 over pools of 16); top-2048 everywhere.  The MLPs and the vocabulary are
small (they do not touch attention).

Each (family, length, path) runs in its own process (peak RSS is the process's VmHWM).  Eager runs only where
its dense score tensors fit the memory budget; elsewhere the row says how much those tensors alone would need.
``--check N`` compares the last position's logits of eager and dsattn on an N-token prompt.

    .venv/bin/python bench/hf_dsa.py [--families v3.2,glm-5,glm-5.3-flash] [--lengths 8192,32768] [--check 4096]
                                     [--decode 16]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

FAMILIES = ("v3.2", "glm-5", "glm-5.3-flash")
BUDGET_GB = 20.0          # eager runs only where its dense tensors fit (the machine has 24 GiB)


def build(family: str, dtype=torch.bfloat16):
    small = dict(intermediate_size=256, moe_intermediate_size=64, n_shared_experts=1, n_routed_experts=4,
                 num_experts_per_tok=2, vocab_size=1024, max_position_embeddings=131072, first_k_dense_replace=2,
                 index_topk=2048, index_head_dim=128, attn_implementation="eager", pad_token_id=0)
    torch.manual_seed(0)
    if family == "v3.2":
        from transformers import DeepseekV32Config, DeepseekV32ForCausalLM
        cfg = DeepseekV32Config(num_hidden_layers=2, hidden_size=7168, num_attention_heads=128,
                                num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                                qk_nope_head_dim=128, v_head_dim=128, index_n_heads=64, **small)
        model = DeepseekV32ForCausalLM(cfg)
    elif family == "glm-5":
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
        cfg = GlmMoeDsaConfig(num_hidden_layers=2, hidden_size=6144, num_attention_heads=64, num_key_value_heads=64,
                              q_lora_rank=2048, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192,
                              v_head_dim=256, index_n_heads=32, indexer_types=["full", "shared"], **small)
        model = GlmMoeDsaForCausalLM(cfg)
    elif family == "glm-5.3-flash":
        from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
        text = dict(num_hidden_layers=2, hidden_size=4096, num_attention_heads=64, num_key_value_heads=64,
                    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=256, v_head_dim=256, index_n_heads=32,
                    index_kpool=16, layer_types=["indexed_attention"] * 2, indexer_types=["full", "full"], hc_mult=2,
                    **{k: v for k, v in small.items() if k not in ("attn_implementation", "first_k_dense_replace")})
        cfg = Glm5NextConfig(text_config=text, vision_config=dict(depth=1, hidden_size=32, num_heads=2,
                                                                  intermediate_size=32, out_hidden_size=4096))
        cfg._attn_implementation = "eager"
        model = Glm5NextForConditionalGeneration(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "index_kpool" in name:
                    p.normal_()
    else:
        raise ValueError(f"family: {family!r}; expected one of {', '.join(FAMILIES)}")
    return model.to(dtype).eval()


def eager_dense_gb(family: str, S: int, dtype=torch.bfloat16) -> float:
    """The eager model's [S, T] tensors of one layer, live together at its peak (GB): the indexer's fp32 scores
    per head ([H_i, S, T]) and their ReLU, or, after them, the attention's scores, their fp32 softmax and its copy
    in the model dtype ([H, S, T] each) with the additive mask; GLM-5.3-Flash scores pools (T / 16) but masks
    every key."""
    heads, index_heads = {"v3.2": (128, 64), "glm-5": (64, 32), "glm-5.3-flash": (64, 32)}[family]
    keys = S // 16 if family == "glm-5.3-flash" else S
    elt = torch.finfo(dtype).bits // 8
    indexer = index_heads * S * keys * 4 * 2
    attention = heads * S * S * (elt + 4 + (elt if elt != 4 else 0)) + S * S * elt
    return max(indexer, attention) / 1e9


def peak_rss_gb() -> float:
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith("VmHWM:")).split()[1]) / 2 ** 20


def child(family: str, S: int, path: str, out: str, dtype: str) -> None:
    model = build(family, getattr(torch, dtype))
    if path == "dsattn":
        from dsattn.integrations import transformers as dsattn_hf
        dsattn_hf.enable(model)
    ids = torch.randint(1, 1024, (1, S), generator=torch.Generator().manual_seed(1))
    t = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
    seconds = time.perf_counter() - t
    torch.save(logits, out)
    print(json.dumps({"seconds": seconds, "peak_gb": peak_rss_gb()}))


def decode_child(family: str, S: int, steps: int, out: str) -> None:
    """A prompt of S tokens prefilled with dsattn into the model's cache, then ``steps`` greedy decode steps twice
    from copies of that cache: with dsattn, and with the model's eager attention (its decode step is small in
    memory -- one query row -- but expands every cached latent through ``kv_b_proj`` and scores every key)."""
    import copy
    from transformers import DynamicCache
    from dsattn.integrations import transformers as dsattn_hf
    model = dsattn_hf.enable(build(family))
    ids = torch.randint(1, 1024, (1, S), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        first = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, True)
    result = {}
    for path in ("dsattn", "eager"):
        if path == "eager":
            dsattn_hf.disable(model)
        c, tok, times, tokens = copy.deepcopy(cache), first, [], []
        with torch.no_grad():
            for _ in range(steps):
                t = time.perf_counter()
                tok = model(input_ids=tok, cache=c, use_cache=True).logits[:, -1].argmax(-1, True)
                times.append(time.perf_counter() - t)
                tokens.append(int(tok))
        result[path] = {"ms": 1e3 * sorted(times)[len(times) // 2], "tokens": tokens}
    torch.save(result, out)
    print(json.dumps({"seconds": 0.0, "peak_gb": peak_rss_gb()}))


def run_child(family: str, S: int, path: str, out: str, dtype: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", family, str(S), path, out, dtype],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["killed"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--check", type=int, default=4096, help="prompt length of the eager / dsattn logits check")
    parser.add_argument("--decode", type=int, default=0, metavar="N",
                        help="also N greedy decode steps after each length's prompt: dsattn and eager per token")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        family, S, path, out, dtype = args.child
        if path.startswith("decode"):
            decode_child(family, int(S), int(path[len("decode"):]), out)
        else:
            child(family, int(S), path, out, dtype)
        return 0
    families = args.families.split(",")
    for f in families:
        if f not in FAMILIES:
            parser.error(f"--families: {f!r}; expected a subset of {', '.join(FAMILIES)}")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    print(f"python bench/hf_dsa.py --families {args.families} --lengths {args.lengths} --check {args.check}"
          f"{f' --decode {args.decode}' if args.decode else ''}  "
          f"({torch.get_num_threads()} threads, one prefill forward, no cache; the check's row in float32, the "
          f"others bf16)\n")
    print("| family | prompt | eager: time / peak RSS | dsattn enable: time / peak RSS | last-position logits |")
    print("|---|---|---|---|---|")
    tmp = f"/tmp/hf_dsa_{os.getpid()}"
    decodes = []
    for family in families:
        for S, dtype in ([(args.check, "float32")] if args.check else []) + [(n, "bfloat16") for n in lengths]:
            need = eager_dense_gb(family, S, getattr(torch, dtype))
            cell = {}
            for path in ("eager", "dsattn"):
                if path == "eager" and need > BUDGET_GB:
                    cell[path] = f"not run: its [S, T] tensors alone need {need:,.0f} GB"
                    continue
                r = run_child(family, S, path, f"{tmp}_{path}.pt", dtype)
                cell[path] = r.get("error") or f"{r['seconds']:.1f} s / {r['peak_gb']:.1f} GB"
            compare = "-"
            if all(os.path.exists(f"{tmp}_{p}.pt") for p in ("eager", "dsattn")) and "GB" in cell["eager"] \
                    and "not run" not in cell["eager"]:
                a, b = torch.load(f"{tmp}_eager.pt"), torch.load(f"{tmp}_dsattn.pt")
                err = (a - b).abs().max().item()
                compare = (f"max |diff| {err:.2e} of max |logit| {a.abs().max().item():.2f}; "
                           f"argmax {'equal' if a.argmax() == b.argmax() else 'differs'}")
            for p in ("eager", "dsattn"):
                if os.path.exists(f"{tmp}_{p}.pt"):
                    os.remove(f"{tmp}_{p}.pt")
            print(f"| {family} | {S:,} ({'fp32' if dtype == 'float32' else 'bf16'}) | {cell['eager']} | "
                  f"{cell['dsattn']} | {compare} |", flush=True)
            if args.decode and dtype == "bfloat16":
                decodes.append((family, S, run_child(family, S, f"decode{args.decode}", f"{tmp}_decode.pt", dtype)))
                if os.path.exists(f"{tmp}_decode.pt"):
                    decodes[-1] = decodes[-1][:2] + (torch.load(f"{tmp}_decode.pt"),)
                    os.remove(f"{tmp}_decode.pt")
    if decodes:
        print(f"\nDecode after the prompt (the prompt prefilled by dsattn into the model's cache; {args.decode} greedy "
              "steps from copies of it; median ms a token):\n")
        print("| family | context | eager: ms a token | dsattn enable: ms a token | greedy tokens |")
        print("|---|---|---|---|---|")
        for family, S, r in decodes:
            if "dsattn" not in r:
                print(f"| {family} | {S:,} | {r.get('error', '-')} | - | - |")
                continue
            same = r["dsattn"]["tokens"] == r["eager"]["tokens"]
            print(f"| {family} | {S:,} | {r['eager']['ms']:.0f} | {r['dsattn']['ms']:.1f} | "
                  f"{'equal' if same else 'differ'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
