"""Helpers of the vLLM plug-in tests: vLLM runs in fresh processes, transformers' reference, the
comparison rule."""
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dsattn.quant.flashmla import V32, dequantize_cache, quantize_cache
from dsattn.quant.index_keys import dequantize_index_keys, quantize_index_keys

HERE = Path(__file__).parent
MAX_TOKENS = 24


def vllm_v4_kernels_missing() -> str:
    """Why vLLM's own DeepSeek-V4 CPU kernels are not here ('' where they are): the kernel library vLLM loads for
    this CPU (or for DSATTN_CPU_ISA's class) lacks them; only its AVX512-BF16 library ``_C`` has them.  (A model
    still serves there: the plug-in supplies the ops, ``v4_ops``; the tests that compare against vLLM's kernels
    cannot run.)"""
    import torch
    from vllm import _custom_ops  # noqa: F401  (loads the platform's kernel library)
    from dsattn.integrations.vllm import v4_ops
    from dsattn.integrations.vllm.platform import V4_VLLM_ATTENTION_OPS
    missing = v4_ops.missing() + [n for n in V4_VLLM_ATTENTION_OPS if not hasattr(torch.ops._C, n)]
    return (f"vLLM's kernel library here lacks its own DeepSeek-V4 kernels ({', '.join(missing)}), which this test "
            "compares against") if missing else ""


# the marker of tests that call vLLM's own V4 kernels
needs_vllm_v4_kernels = pytest.mark.skipif(bool(vllm_v4_kernels_missing()), reason=vllm_v4_kernels_missing() or "-")


def run_llm(model, prompts, engine=None, late=None, max_tokens=MAX_TOKENS, env=None, timeout=600,
            prompt_logprobs=False, kernels=False):
    """vLLM's greedy outputs in a fresh process: [{tokens, logprobs, top5}] per prompt (and ``prompt_logprobs``:
    each prompt token's log-prob, teacher-forced, where asked); ``kernels``: ``(outputs, {"linear": [...],
    "experts": [...]})``, the classes that served the quantised linears and the MoE experts."""
    engine = dict(dict(max_model_len=256, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20),
                  **(engine or {}))
    spec = dict(model=str(model), engine=engine, prompts=prompts, max_tokens=max_tokens, late=late,
                prompt_logprobs=prompt_logprobs, kernels=kernels)
    proc = subprocess.run([sys.executable, str(HERE / "llm_run.py"), json.dumps(spec)], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, **(env or {})))
    if proc.returncode != 0:
        errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "Error" in ln or "error" in ln]
        raise AssertionError(f"vLLM run failed ({proc.returncode}):\n" + "\n".join(errors[-30:]))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"vLLM run printed no result:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    if not kernels:
        return out
    served = [ln for ln in proc.stdout.splitlines() if ln.startswith("KERNELS ")]
    assert served, f"vLLM run printed no kernels:\n{proc.stdout[-3000:]}"
    return out, json.loads(served[-1][len("KERNELS "):])


def compare(got, want, tol, min_match=0.75):
    """vLLM's ``check_logprobs_close`` rule: tokens equal with log-probs within ``tol``, until a step
    where they differ; there each side's token must be in the other's top-5 (a near tie) and the
    comparison of that prompt stops.  At least ``min_match`` of all tokens must have been compared."""
    matched = total = 0
    for i, (g, w) in enumerate(zip(got, want)):
        total += len(w["tokens"])
        for s, (a, b) in enumerate(zip(g["tokens"], w["tokens"])):
            if a != b:
                assert a in w["top5"][s] and b in g["top5"][s], (
                    f"prompt {i} step {s}: vLLM {a} vs reference {b} is not a near tie "
                    f"(reference top-5 {w['top5'][s]}, vLLM top-5 {g['top5'][s]})")
                break
            assert abs(g["logprobs"][s] - w["logprobs"][s]) <= tol, (
                f"prompt {i} step {s}: log-prob {g['logprobs'][s]} vs {w['logprobs'][s]} (tol {tol})")
            matched += 1
    assert matched >= min_match * total, f"only {matched} of {total} tokens agree before a near tie"
    return matched, total


def hf_greedy(model_dir, prompts, max_tokens, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                                 attn_implementation="eager").eval()
    res = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        toks = out.sequences[0, len(p):].tolist()
        lps = [torch.log_softmax(l[0].float(), -1) for l in out.logits]
        res.append(dict(tokens=toks, logprobs=[lp[t].item() for lp, t in zip(lps, toks)],
                        top5=[lp.topk(5).indices.tolist() for lp in lps]))
    return res


def hf_prompt_logprobs(model_dir, prompts, dtype=torch.float32):
    """transformers' teacher-forced log-prob of each prompt token after the first (what vLLM's ``prompt_logprobs``
    gives), and the top-5 of the next token after each whole prompt."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="eager").eval()
    res = []
    with torch.no_grad():
        for p in prompts:
            lps = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)
            res.append(dict(prompt_logprobs=lps[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0].tolist(),
                            top5=lps[-1].topk(5).indices.tolist()))
    return res


@contextmanager
def fp8_cache_rounding():
    """transformers' caches hold what vLLM's ``fp8_ds_mla`` caches hold: the latent rows FlashMLA's
    656-byte format keeps (FP8 tiles with power-of-two scales, the rope part in bf16) and the
    indexer keys in FP8 with one fp32 scale per token."""
    from transformers.cache_utils import DynamicIndexedLayer
    update, update_indexer = DynamicIndexedLayer.update, DynamicIndexedLayer.update_indexer

    def rounded_update(self, key_states, value_states, *args, **kwargs):
        # key: the normalised latent [B, 1, S, 512]; value: the roped k_pe [B, 1, S, 64]
        rows = torch.cat([key_states, value_states], -1).reshape(-1, 1, 1, 576).to(torch.bfloat16)
        back = dequantize_cache(quantize_cache(rows, V32), torch.float32).reshape(*key_states.shape[:-1], 576)
        return update(self, back[..., :512].to(key_states.dtype), back[..., 512:].to(value_states.dtype),
                      *args, **kwargs)

    def rounded_indexer(self, k):
        values, scales = quantize_index_keys(k.reshape(-1, k.size(-1)).float())
        return update_indexer(self, dequantize_index_keys(values, scales).to(k.dtype).view_as(k))

    DynamicIndexedLayer.update, DynamicIndexedLayer.update_indexer = rounded_update, rounded_indexer
    try:
        yield
    finally:
        DynamicIndexedLayer.update, DynamicIndexedLayer.update_indexer = update, update_indexer
