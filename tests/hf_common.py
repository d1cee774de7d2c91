"""Helpers the transformers integration tests share (test_hf_integration.py: DeepSeek-V4; test_hf_dsa.py: the
DSA models)."""
import sys

import pytest
import torch

from dsattn.integrations import transformers as dsattn_hf


def both(model, fn):
    """``fn(model)`` with the model's eager attention, then with dsattn (disabled afterwards)."""
    want = fn(model)
    dsattn_hf.enable(model)
    try:
        got = fn(model)
    finally:
        dsattn_hf.disable(model)
    return want, got


def assert_generate_matches_eager(model, ids, new_tokens: int) -> None:
    """Greedy tokens identical, every step's logits within 1e-4 / 1e-5."""
    def gen(m):
        with torch.no_grad():
            return m.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
    want, got = both(model, gen)
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(want.logits, got.logits)):
        assert torch.allclose(b, a, rtol=1e-4, atol=1e-5), (step, (b - a).abs().max())


def padded(prompts, side: str, pad_id: int = 0):
    """A batch of prompts padded to the longest on ``side`` -> (ids, attention_mask)."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, p in enumerate(prompts):
        cols = slice(L - len(p), L) if side == "left" else slice(0, len(p))
        ids[i, cols], mask[i, cols] = p, 1
    return ids, mask


def first_layer_mask(model, **inputs):
    """The ``attention_mask`` the model's first decoder layer receives for ``model(**inputs)`` (with the eager
    attention: the 4-D mask the model itself builds)."""
    layer = next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))
    seen = []
    hook = layer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        hook.remove()
    return seen[0]


def assert_refused(model, match: str, **inputs) -> None:
    """``model(**inputs)`` raises a ValueError matching ``match`` before any decoder layer runs."""
    calls = []
    hooks = [m.register_forward_pre_hook(lambda *a: calls.append(1)) for m in model.modules()
             if type(m).__name__.endswith("DecoderLayer")]
    assert hooks
    try:
        with torch.no_grad(), pytest.raises(ValueError, match=match):
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    assert not calls, "a decoder layer ran before the mask was refused"


def causal_mask_4d(mask2d, window=None):
    """The causal (``window``: sliding-window causal) bool mask ``[B, 1, S, S]`` with the key padding of ``mask2d``
    (transformers' sdpa form of the mask a model builds from a 2-D padding mask, no cache)."""
    S = mask2d.shape[1]
    q, k = torch.arange(S)[:, None], torch.arange(S)[None, :]
    band = (k <= q) if window is None else (k <= q) & (k > q - window)
    return band[None, None] & mask2d.bool()[:, None, None, :]


def block_diagonal_mask(lengths):
    """A packed-sequence mask ``[1, 1, S, S]``: causal within each of the sequences of ``lengths``, packed in one
    row, and nothing across them."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return causal_mask_4d(torch.ones(1, len(seq))) & (seq[:, None] == seq[None, :])


def patch_transformers_version(monkeypatch, version: str) -> None:
    """Make the integration's version check see ``version``: the ``__version__`` of the module ``import
    transformers`` gives now (transformers' processing_utils re-executes its ``__init__``, which replaces
    ``sys.modules["transformers"]``, so a module object taken earlier may no longer be that one)."""
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
