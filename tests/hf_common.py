"""Helpers the transformers integration tests share (test_hf_integration.py: DeepSeek-V4; test_hf_dsa.py: the
DSA models)."""
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
