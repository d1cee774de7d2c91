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


def prompts(lengths=(40, 57, 23, 71), vocab_size: int = 512, seed: int = 1) -> list[list[int]]:
    """Token-id prompts of the given lengths (fresh random words, no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(len(SPECIALS), vocab_size, (n,), generator=g).tolist() for n in lengths]
