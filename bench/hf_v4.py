"""transformers' DeepSeek-V4, eager attention vs dsattn, on a wide-but-shallow model (issue 14).

    python bench/hf_v4.py [--lengths 4096 16384 32768] [--paths eager dsattn] [--decode-steps 8] [--limit-gb 20]
                          [--no-record]
    python bench/hf_v4.py --smoke            # tiny model: the end-to-end comparison with eager in seconds

V4-Flash attention dimensions (hidden 4096, 64 heads of 512, q rank 1024, 8 output groups of 1024,
indexer 64 x 128 top-512, window 128, CSA ratio 4, HCA ratio 128), one HCA and one CSA layer, a small
vocabulary and small experts, bf16.  Each (path, prompt length) prefill runs in a fresh process under
an address-space limit: wall time and peak resident memory.  The eager model's attention holds
``[heads, S, S + S / ratio]`` score tensors (several copies) and grows with S^2; dsattn's memory grows
linearly.  Decode tokens / s at the longest context: the dsattn prefill fills the model's cache, then
decode steps run with dsattn and, on the same cache, with the eager attention.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

HCA, CSA = "heavily_compressed_attention", "compressed_sparse_attention"


def config(smoke: bool):
    from transformers import DeepseekV4Config
    if smoke:
        dims = dict(vocab_size=97, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
                    q_lora_rank=48, o_groups=2, o_lora_rank=24, index_n_heads=32, index_head_dim=16, index_topk=8,
                    sliding_window=16, hc_mult=2, compress_rates={CSA: 4, HCA: 16})
    else:
        dims = dict(vocab_size=1024, hidden_size=4096, moe_intermediate_size=256, num_attention_heads=64, head_dim=512,
                    q_lora_rank=1024, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128,
                    index_topk=512, sliding_window=128, compress_rates={CSA: 4, HCA: 128})
    return DeepseekV4Config(num_hidden_layers=2, layer_types=[HCA, CSA], n_routed_experts=4, num_experts_per_tok=2,
                            n_shared_experts=1, max_position_embeddings=1 << 20, attn_implementation="eager", **dims)


def build(smoke: bool):
    from transformers import DeepseekV4ForCausalLM
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(config(smoke)).to(torch.float32 if smoke else torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks") or name.endswith("position_bias"):
                p.normal_()
    return model


def rss_gb() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss it does not carry the parent's RSS across exec)."""
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM:"))
    return int(hwm.split()[1]) / 2**20


def child(path: str, length: int, decode_steps: int) -> dict:
    """One prefill in this process (and the decode steps for ``decode_steps > 0``)."""
    from dsattn.integrations import transformers as dsattn_hf
    model = build(False)
    if path == "dsattn":
        dsattn_hf.enable(model)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    base = rss_gb()
    res = dict(path=path, length=length, base_gb=base)
    try:
        with torch.no_grad():
            t = time.perf_counter()
            out = model(ids, use_cache=decode_steps > 0)
            res["prefill_s"] = time.perf_counter() - t
            if decode_steps:
                cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
                for name, on in (("dsattn", True), ("eager", False)):
                    (dsattn_hf.enable if on else dsattn_hf.disable)(model)
                    t = time.perf_counter()
                    for _ in range(decode_steps):       # both runs extend the same cache: eager continues it
                        tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                    res[f"decode_{name}_tok_s"] = decode_steps / (time.perf_counter() - t)
    except (RuntimeError, MemoryError) as e:
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][-160:]}"
    res["peak_gb"] = rss_gb()
    return res


def eager_attention_gb(length: int) -> float:
    """The eager CSA layer's score tensors: scores, scores + mask, with the sink column, softmax
    ([64 heads, S, S + S / 4] bf16 each) and the two masks -- a lower bound of its peak."""
    S = length
    return (4 * 64 * S * (S + S // 4) * 2 + 2 * S * (S + S // 4) * 2) / 2**30


def run_child(path, length, decode_steps, limit_gb):
    def limit():
        if limit_gb:
            cap = int(limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    cmd = [sys.executable, __file__, "--child", path, str(length), str(decode_steps)]
    p = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit)
    line = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if not line:
        return dict(path=path, length=length, error=f"process exit {p.returncode}: {p.stderr.strip()[-200:]}")
    return json.loads(line[-1])


def smoke() -> int:
    """The tiny model end to end: eager vs dsattn logits and greedy tokens."""
    from dsattn.integrations import transformers as dsattn_hf
    model = build(True)
    ids = torch.randint(0, 97, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        gen_eager = model.generate(ids[:, :64], max_new_tokens=16, do_sample=False)
        dsattn_hf.enable(model)
        ours = model(ids, use_cache=False).logits
        gen_ours = model.generate(ids[:, :64], max_new_tokens=16, do_sample=False)
    diff = (ours - eager).abs().max().item()
    same = torch.equal(gen_ours, gen_eager)
    print(f"tiny DeepSeek-V4 (HCA + CSA, fp32), 300-token forward: max |dsattn - eager| logits = {diff:.2e}; "
          f"16 greedy tokens identical: {same}")
    return 0 if diff < 1e-4 and same else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/hf_v4.py")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--limit-gb", type=float, default=20.0, help="address-space limit of each process")
    ap.add_argument("--paths", nargs="+", choices=("eager", "dsattn"), default=["eager", "dsattn"])
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), int(args.child[2]))))
        return 0
    if args.smoke:
        return smoke()
    lines = ["| prompt | path | prefill s | peak RSS GB (model alone) | eager attention scores, computed GB | note |",
             "|---|---|---|---|---|---|"]
    decode = None
    for length in args.lengths:
        for path in args.paths:
            steps = args.decode_steps if (path == "dsattn" and length == max(args.lengths)) else 0
            r = run_child(path, length, steps, args.limit_gb)
            note = r.get("error", "")
            if "error" in r and path == "eager":
                note = f"out of memory under the {args.limit_gb:.0f} GB limit ({note})"
            lines.append(f"| {length} | {path} | {r.get('prefill_s', float('nan')):.1f} | "
                         f"{r.get('peak_gb', float('nan')):.1f} ({r.get('base_gb', float('nan')):.1f}) | "
                         f"{eager_attention_gb(length):.1f} | {note} |")
            print(lines[-1], flush=True)
            if steps:
                decode = r
    table = "\n".join(lines)
    if decode and "decode_dsattn_tok_s" in decode:
        table += (f"\n\nDecode at {decode['length']} tokens of context (cache filled by the dsattn prefill): dsattn "
                  f"{decode['decode_dsattn_tok_s']:.2f} tok/s, eager on the same cache "
                  f"{decode['decode_eager_tok_s']:.2f} tok/s.")
    print(table)
    if not args.no_record:
        from dsattn.benchmarks.runner import record, results_path
        cmd = "python bench/hf_v4.py " + " ".join(argv if argv is not None else sys.argv[1:])
        record(f"## `{cmd}`\n\ntransformers DeepSeek-V4 (V4-Flash attention dims, HCA + CSA layers, bf16), "
               f"eager attention vs dsattn, one prefill per fresh process under a {args.limit_gb:.0f} GB "
               f"address-space limit ({os.cpu_count()} CPUs).\n\n{table}\n", results_path())
    return 0


if __name__ == "__main__":
    sys.exit(main())
