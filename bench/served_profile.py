"""Where a served step goes: vLLM + dsattn on one prompt, a prefill chunk and decode steps profiled and split
into vLLM's own work, the plug-in's and dsattn's kernels.

    .venv-vllm/bin/python bench/served_profile.py --model v32 --ctx 8192 [--chunk 2048] [--steps 8]
    .venv-vllm/bin/python bench/served_profile.py --model v4 --ctx 8192 --cpu-isa avx2 --dtype float32

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that torch's profiler sees the
whole step.  vLLM's step phases are wrapped in ``record_function`` ranges: the scheduler (schedule + update
from output), input preparation (``_prepare_inputs``), the attention metadata builders (``_build_attention_metadata``:
the plug-in's metadata is built there), the model forward and the sampler.  Inside the forward every op's self time is
put in one of: dsattn's kernels (``dsattn::``), vLLM's kernels (``_C::`` and friends), GEMMs (``aten::mm`` /
``addmm`` / ``bmm`` / ``linear``: projections, MoE experts, the LM head), other ATen ops (elementwise, copies,
norms, gathers); the forward's time outside every op is Python (the model's and the plug-in's code around
the ops).  Per phase: milliseconds of the median step and shares of the step.

Models: ``v32`` is issue 42's tiny DeepSeek-V3.2 with the real attention widths (``bench/llamacpp.py``'s
checkpoint: 128 heads, latent 512 + rope 64, indexer 64 x 128, top-2048); ``v4`` is ``bench/llamacpp.py``'s V4
(V4-Flash's attention, a CSA + an HCA layer, 64 FP4 routed experts held in float32).  Random weights, nothing
downloaded.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))

PHASES = ("schedule", "prepare_inputs", "metadata", "forward", "sample", "update")
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "aten::_weight_int8pack_mm")


def category(op: str) -> str:
    if op.startswith("dsattn::"):
        return "dsattn kernels"
    if op.startswith("plug-in::"):
        return "plug-in (cache writes, slots, V4 model ops)"
    if op in GEMMS:
        return "GEMMs (projections, MoE, head)"
    if op.startswith("aten::") or op.startswith("prim::"):
        return "other ATen ops"
    return "vLLM kernels"


def wrap(obj, name: str, label: str) -> None:
    import torch
    fn = getattr(obj, name, None)
    if fn is None:
        return

    def wrapped(*a, **k):
        with torch.profiler.record_function(label):
            return fn(*a, **k)
    setattr(obj, name, wrapped)


def model_dir(kind: str, path: Path) -> tuple[Path, int]:
    sys.path.insert(0, _HERE)
    if kind == "v32":
        import llamacpp
        return llamacpp.write_v32(path), llamacpp.V32_WIDTHS["vocab_size"]
    import llamacpp
    dense, _ = llamacpp.write_v4(path)           # the V4 model llamacpp.py serves (FP4 experts held in float32)
    return dense, json.loads((dense / "config.json").read_text())["vocab_size"]


def profile(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams
    path, vocab = model_dir(args.model, Path(tempfile.mkdtemp(prefix="dsattn-profile-")))
    prompt = torch.randint(3, vocab, (args.ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(model=str(path), load_format="auto", skip_tokenizer_init=True,
              dtype=args.dtype, enforce_eager=True, max_model_len=args.ctx + args.steps + 16,
              max_num_batched_tokens=args.chunk, enable_chunked_prefill=True, max_num_seqs=1,
              enable_prefix_caching=False,
              kv_cache_memory_bytes=(args.ctx // 4 + args.ctx // 64 + 8192) * 1200 + (256 << 20))
    engine = llm.llm_engine
    core = engine.engine_core.engine_core               # the in-process EngineCore
    runner = core.model_executor.driver_worker.worker.model_runner
    wrap(core.scheduler, "schedule", "schedule")
    wrap(core.scheduler, "update_from_output", "update")
    wrap(runner, "_prepare_inputs", "prepare_inputs")
    wrap(runner, "_build_attention_metadata", "metadata")       # the attention backends' builders (the plug-in's)
    wrap(runner, "_model_forward", "forward")
    wrap(runner, "sample_tokens", "sample")
    # the plug-in's pieces that call dsattn's kernels or write caches outside a torch op of their own
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention
    from dsattn.integrations.vllm import dsa
    wrap(dsa.DsattnSparseMLAImpl, "forward_mqa", "dsattn::sparse MLA (forward_mqa)")
    wrap(dsa.DsattnSparseMLAImpl, "do_kv_cache_update", "plug-in::MLA cache write")
    wrap(DeepseekV4CPUAttention, "forward_mqa", "dsattn::V4 attention (forward_mqa)")
    # the plug-in's float32 V4 model ops (compiled, or their PyTorch under DSATTN_NATIVE=0), each a range of its own
    from vllm import _custom_ops
    from dsattn.integrations.vllm import v4_fp32
    for name in v4_fp32.FLOAT32_VERSIONS:
        wrap(_custom_ops, name, f"plug-in::V4 {name.removesuffix('_cpu')}")
    wrap(v4_fp32, "gptj_rope", "plug-in::V4 GPT-J RoPE (the attention output's inverse)")
    engine.add_request("0", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=args.steps + 2, temperature=0, ignore_eos=True, detokenize=False))
    kinds = {"prefill": [], "decode": []}
    produced = 0
    while engine.has_unfinished_requests():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            outs = engine.step()
            wall = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        kind = "prefill" if produced == 0 else "decode"
        produced = max(produced, n)
        kinds[kind].append(split(prof, wall))
    return {k: median_split(v) for k, v in kinds.items() if v}


def split(prof, wall: float) -> dict:
    events = prof.events()
    res = defaultdict(float)
    res["step"] = wall * 1e3
    for e in events:
        if e.name in PHASES:
            res[e.name] += e.cpu_time_total / 1e3
    # each op the forward calls directly, whole (what it calls inside counts as its own); vLLM's wrapper ops
    # (``vllm::``: the attention layer's whole body) are opened, their own time outside ops being Python
    def top_level(e) -> bool:
        parent = e.cpu_parent
        while parent is not None and parent.name.startswith("vllm::"):
            parent = parent.cpu_parent
        return parent is not None and parent.name == "forward" and not e.name.startswith("vllm::")
    for e in events:
        if e.name not in PHASES and top_level(e):
            res[category(e.name)] += e.cpu_time_total / 1e3
            res["op " + e.name] += e.cpu_time_total / 1e3
    inside = sum(v for k, v in res.items() if k not in PHASES and k != "step" and not k.startswith("op "))
    res["Python in the forward (model + plug-in)"] = res["forward"] - inside
    res["outside the phases (engine loop)"] = res["step"] - sum(res[p] for p in PHASES)
    return dict(res)


def median_split(rows: list[dict]) -> dict:
    keys = sorted({k for r in rows for k in r})
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys} | {"n": len(rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("v32", "v4"), default="v32")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens a step)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps profiled")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    ap.add_argument("--cpu-isa", default="", help="run as this CPU class (in a fresh process)")
    ap.add_argument("--top", type=int, default=12, help="the forward's largest ops listed")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = ap.parse_args(argv)
    if args.cpu_isa and os.environ.get("DSATTN_CPU_ISA") != args.cpu_isa:
        import subprocess
        from dsattn.native import isa
        os.environ["DSATTN_CPU_ISA"] = args.cpu_isa
        isa.requested()
        env = dict(os.environ, **isa.environment(args.cpu_isa))
        return subprocess.call([sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])], env=env)
    res = profile(args)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{args.model} at {args.ctx} tokens, {args.dtype}, chunk {args.chunk}, CPU class "
          f"{os.environ.get('DSATTN_CPU_ISA') or 'own'}: median step, ms (share of the step)")
    names = ["step", *PHASES, "outside the phases (engine loop)", "dsattn kernels",
             "plug-in (cache writes, slots, V4 model ops)",
             "vLLM kernels", "GEMMs (projections, MoE, head)", "other ATen ops",
             "Python in the forward (model + plug-in)"]
    print("| part | " + " | ".join(f"{k} (median of {v['n']})" for k, v in res.items()) + " |")
    print("|---|" + "---|" * len(res))
    for name in names:
        cells = [f"{v.get(name, 0.0):.1f} ({100 * v.get(name, 0.0) / v['step']:.0f} %)" for v in res.values()]
        indent = "&nbsp;&nbsp;" if name in names[len(PHASES) + 2:] else ""
        print(f"| {indent}{name} | " + " | ".join(cells) + " |")
    ops = sorted({k for v in res.values() for k in v if k.startswith("op ")},
                 key=lambda k: -max(v.get(k, 0.0) for v in res.values()))
    print("\nThe forward's largest ops, whole (what each calls inside included):\n")
    print("| op | " + " | ".join(res) + " |")
    print("|---|" + "---|" * len(res))
    for k in ops[:args.top]:
        print(f"| `{k[3:]}` | " + " | ".join(f"{v.get(k, 0.0):.1f} ms" for v in res.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
