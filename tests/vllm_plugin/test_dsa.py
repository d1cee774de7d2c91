"""DeepSeek-V3.2 / GLM-5 (DSA) served by vLLM on CPU through dsattn, against transformers' eager
model with the same weights (tiny checkpoints written here; nothing downloaded)."""
import os

import pytest
import torch

from dsattn.integrations.vllm import tiny
from vllm_helpers import MAX_TOKENS, compare, fp8_cache_rounding, hf_greedy, run_llm

PROMPTS = tiny.prompts((40, 57, 23, 71))


@pytest.fixture(scope="module", params=tiny.ARCHS)
def checkpoint(request, tmp_path_factory):
    return tiny.write_dsa(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return hf_greedy(checkpoint, PROMPTS, MAX_TOKENS)


def test_same_tokens_as_transformers(checkpoint, reference):
    """fp32, bf16-free: exact same greedy tokens, log-probs within 1e-4; index_topk 16 is well below
    every prompt, so the indexer's choice decides.  vLLM's default graph capture (no enforce_eager):
    the indexer is one opaque op in it."""
    got = run_llm(checkpoint, PROMPTS, engine=dict(enforce_eager=False))
    matched, total = compare(got, reference, tol=1e-4, min_match=0.95)
    assert matched == total


def test_chunked_prefill_and_late_request(checkpoint, reference):
    """Prompts longer than max_num_batched_tokens (chunked prefill, mixed with decodes), and one
    request arriving while the others decode: the same tokens."""
    got = run_llm(checkpoint, PROMPTS[:3], engine=dict(max_num_batched_tokens=32, enable_chunked_prefill=True),
                  late=dict(prompt=PROMPTS[3], after_steps=6))
    compare(got, reference, tol=1e-4, min_match=0.95)


def test_fp8_ds_mla_caches(checkpoint):
    """``fp8_ds_mla``: against transformers whose caches hold the same FP8 rounding.  Most log-probs
    agree to 1e-5; the tolerance 2e-2 covers a latent element that lands on the other side of an FP8
    rounding step (its two computations differ by ~1e-6, the step is 6 %).  Against the unrounded
    model this tiny model's log-probs move by up to ~0.5 (its weights are large and random), which
    is what the rounded reference separates from a wrong cache format."""
    got = run_llm(checkpoint, PROMPTS, engine=dict(kv_cache_dtype="fp8_ds_mla"))
    with fp8_cache_rounding():
        rounded = hf_greedy(checkpoint, PROMPTS, MAX_TOKENS)
    compare(got, rounded, tol=2e-2, min_match=0.9)


def test_bfloat16_model(checkpoint):
    """A bf16 model (bf16 cache rows, bf16 indexer keys) against transformers in bf16.  The two stacks
    round in different orders and this tiny model's large random weights amplify it: measured, the
    log-probs of equal tokens differ by up to ~0.3 and two of four prompts reach a near tie at once.
    So this checks the path end to end (every divergence a top-5 near tie), not bits."""
    got = run_llm(checkpoint, PROMPTS, engine=dict(dtype="bfloat16"))
    compare(got, hf_greedy(checkpoint, PROMPTS, MAX_TOKENS, torch.bfloat16), tol=0.5, min_match=0.3)


def test_tensor_parallel_2(checkpoint, reference):
    """Two CPU workers (heads split, the indexer replicated): the same greedy tokens as one."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("two CPU workers need two cores")
    if "Glm" in checkpoint.name:
        pytest.skip("one architecture is enough for the parallel path (CI time)")
    # one core per worker: vLLM binds each worker to a NUMA node by default and this machine has one
    got = run_llm(checkpoint, PROMPTS, engine=dict(tensor_parallel_size=2), env=dict(VLLM_CPU_OMP_THREADS_BIND="0|1"))
    compare(got, reference, tol=1e-4, min_match=0.95)
