"""transformers' eager DeepSeek-V4 with the roundings vLLM's caches apply, as a float32 reference.

vLLM keeps DeepSeek-V4's keys in FP8 whatever the model dtype: the window and compressed rows in FlashMLA's
584-byte layout (each row rounded to bf16, its 448 nope values to e4m3 in tiles of 64 with power-of-two
scales, the 64 RoPE values kept in bf16), the indexer's keys as e4m3 with one power-of-two scale per token
(the row rounded to bf16 first), and the indexer's query as e4m3 with one power-of-two scale per token and
head (its RoPE half rounded to bf16 first).  transformers keeps them exact.  :func:`vllm_roundings` applies
the same roundings inside transformers' model at those four points, so that a float32 vLLM run and this
reference differ only by summation order (and the e4m3 subnormals vLLM's compressor kernels may flush).
"""
from __future__ import annotations

import contextlib

import torch

from dsattn.integrations.vllm import v4_fp32

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0


def cache_rows(x: torch.Tensor) -> torch.Tensor:
    """Window / compressed rows ``[..., 512]`` as vLLM's V4 cache holds them (float32 values)."""
    rows = x.reshape(-1, x.size(-1))
    return v4_fp32.dequantize_v4_rows(*v4_fp32.quantize_v4_rows(rows)).reshape(x.shape).to(x.dtype)


def _fp8_pow2(x: torch.Tensor) -> torch.Tensor:
    """e4m3 with one power-of-two scale per row of the last dim, ``2^ceil(log2(max(amax, 1e-4) / 448))``."""
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True).clamp_min(1e-4) / FP8_MAX)))
    return (x / scale).to(FP8).float() * scale


def indexer_keys(k: torch.Tensor) -> torch.Tensor:
    return _fp8_pow2(k.to(torch.bfloat16).float()).to(k.dtype)


def indexer_query(q: torch.Tensor, rope_dim: int = 64) -> torch.Tensor:
    q = q.float().clone()
    q[..., -rope_dim:] = q[..., -rope_dim:].to(torch.bfloat16).float()
    return _fp8_pow2(q)


@contextlib.contextmanager
def vllm_roundings():
    """Within: transformers' DeepSeek-V4 rounds its window cache, compressed entries and indexer operands
    as vLLM's caches do."""
    from transformers import cache_utils
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    patched = []

    def patch(owner, name, make):
        original = getattr(owner, name)
        patched.append((owner, name, original))
        setattr(owner, name, make(original))

    def rounded_update(update):
        def call(self, key_states, value_states, layer_idx, *args, **kwargs):
            rounded = cache_rows(key_states)               # V4's window keys are its values
            return update(self, rounded, rounded if value_states is key_states else cache_rows(value_states),
                          layer_idx, *args, **kwargs)
        return call

    def rounded_compressor(forward):
        def call(self, *args, **kwargs):
            compressed, bias = forward(self, *args, **kwargs)
            return cache_rows(compressed), bias
        return call

    def rounded_scorer(forward):
        def call(self, q, compressed_kv, hidden_states):
            return forward(self, indexer_query(q), indexer_keys(compressed_kv), hidden_states)
        return call

    patch(cache_utils.Cache, "update", rounded_update)
    patch(m.DeepseekV4HCACompressor, "forward", rounded_compressor)
    patch(m.DeepseekV4CSACompressor, "forward", rounded_compressor)
    patch(m.DeepseekV4IndexerScorer, "forward", rounded_scorer)
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
