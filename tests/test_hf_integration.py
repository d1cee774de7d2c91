"""transformers' DeepSeek-V4 on dsattn (issue 14): tiny random configs built locally (no download), the
dsattn-enabled model against the model's own eager attention."""
import importlib
import re
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DynamicCache  # noqa: E402

from dsattn.integrations import transformers as dsattn_hf  # noqa: E402
from hf_common import (assert_generate_matches_eager, assert_refused, block_diagonal_mask, both,  # noqa: E402
                       causal_mask_4d, first_layer_mask, padded, patch_transformers_version)

HCA, CSA, SWA = "heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"


def tiny(layer_types, *, window=16, topk=8, hca_ratio=16, seed=0, dtype=torch.float32):
    """Every attention feature at toy width.  32 indexer heads: with few heads many scores are exactly 0
    (every ReLU 0), and torch.topk breaks such ties in no specified order while dsattn takes the lower
    index (10 §1.5), so a tie would be a legitimate difference, not a bug."""
    cfg = DeepseekV4Config(
        vocab_size=97, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(layer_types),
        num_attention_heads=4, head_dim=32, q_lora_rank=48, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, sliding_window=window, o_groups=2, o_lora_rank=24, index_n_heads=32, index_head_dim=16,
        index_topk=topk, hc_mult=2, layer_types=list(layer_types),
        compress_rates={CSA: 4, HCA: hca_ratio}, max_position_embeddings=4096, attn_implementation="eager")
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():                       # the init zeroes these: a zero sink / bias tests nothing
        for name, p in model.named_parameters():
            if name.endswith("sinks") or name.endswith("position_bias"):
                p.normal_()
    return model


def _ids(batch, length, seed=1):
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(ids):
    def run(model):
        with torch.no_grad():
            return model(ids, use_cache=False).logits
    return run


@pytest.mark.parametrize("layers,window,topk", [
    ((SWA,), 16, 8),              # the window alone
    ((HCA,), 16, 8),              # 18 HCA entries, window smaller than the prompt
    ((CSA,), 16, 8),              # 75 compressed entries, top-8
    ((CSA,), 16, 512),            # top-k larger than the entries
    ((SWA, HCA, CSA), 512, 8),    # window larger than the prompt
], ids=["SWA", "HCA", "CSA-top8", "CSA-top512", "mixed-wide-window"])
def test_single_forward_matches_eager_fp32(layers, window, topk):
    model = tiny(layers, window=window, topk=topk)
    want, got = both(model, _logits(_ids(2, 300)))
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()


def test_bf16_forward_is_as_close_to_fp32_as_eager_bf16():
    """In bf16 the two paths round at different points (eager: softmax in bf16 over the window and every
    compressed entry; dsattn: the spec's fp32 statistics, P rounded before P·V), so after several layers
    neither equals the other to the op-level bf16 rule.  The fair check: against the same model in fp32,
    dsattn's bf16 logits are no further off than eager's bf16 logits (max and mean error, 25 % margin)."""
    ids = _ids(1, 300)
    truth = _logits(ids)(tiny((HCA, CSA)))
    want, got = both(tiny((HCA, CSA), dtype=torch.bfloat16), _logits(ids))
    err_eager, err_dsattn = (want.float() - truth).abs(), (got.float() - truth).abs()
    assert err_dsattn.max() <= 1.25 * err_eager.max(), (err_dsattn.max(), err_eager.max())
    assert err_dsattn.mean() <= 1.25 * err_eager.mean(), (err_dsattn.mean(), err_eager.mean())


def test_generate_with_cache_matches_eager():
    assert_generate_matches_eager(tiny((SWA, HCA, CSA)), _ids(1, 70), 32)


def test_chunked_prefill_equals_one_shot():
    model = tiny((SWA, HCA, CSA))
    ids = _ids(2, 70)
    dsattn_hf.enable(model)
    with torch.no_grad():
        one = model(ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        chunks = [model(ids[:, i:i + 25], past_key_values=cache, use_cache=True).logits for i in range(0, 70, 25)]
    assert torch.allclose(torch.cat(chunks, 1), one, rtol=1e-4, atol=1e-5)


def test_eager_and_dsattn_alternate_on_one_cache():
    """The compressors' history comes from the model's own cache state (the incomplete window's raw
    projections, the ratio-4 overlap half): chunks prefilled by the eager model, continued by dsattn,
    then eager again, give the one-shot eager logits."""
    model = tiny((HCA, CSA), hca_ratio=8)
    ids = _ids(2, 75)
    with torch.no_grad():
        one = model(ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        chunks = []
        for i, (lo, hi) in enumerate([(0, 23), (23, 50), (50, 51), (51, 75)]):   # windows split across calls
            (dsattn_hf.enable if i % 2 else dsattn_hf.disable)(model)
            chunks.append(model(ids[:, lo:hi], past_key_values=cache, use_cache=True).logits)
    dsattn_hf.disable(model)
    assert torch.allclose(torch.cat(chunks, 1), one, rtol=1e-4, atol=1e-5)


def test_training_gradients_match_eager():
    """Every attention parameter that has a gradient in the eager model (projections, norms, sinks,
    compressors, output projections; the indexer's selection is not differentiable in either) gets the
    same one through sparse_flash_mla's backward."""
    model = tiny((HCA, CSA, CSA)).train()
    ids = _ids(2, 120)

    def grads(m):
        m.zero_grad()
        m(ids, labels=ids, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None and "self_attn" in n}
    want, got = both(model, grads)
    assert set(got) == set(want) and any("sinks" in n for n in want) and any("compressor" in n for n in want)
    for name, g in want.items():
        assert torch.allclose(got[name], g, rtol=1e-4, atol=1e-4 * g.abs().max().item()), name


def _prompts(lengths, seed=10):
    return [_ids(1, n, seed=seed + i)[0] for i, n in enumerate(lengths)]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_padded_batch_gives_each_row_its_prompt_alone(side, dtype):
    model = dsattn_hf.enable(tiny((SWA, HCA, CSA), dtype=dtype))
    prompts = _prompts([70, 41, 9, 55])
    ids, mask = padded(prompts, side)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=False).logits
        for i, p in enumerate(prompts):
            got = out[i, mask[i].bool()]
            alone = model(p[None], use_cache=False).logits[0]
            if dtype == torch.float32:
                assert torch.allclose(got, alone, rtol=1e-5, atol=1e-5), (i, (got - alone).abs().max())
            else:                                  # the bf16 rule (00 §11)
                assert torch.allclose(got.float(), alone.float(), rtol=1.6e-2, atol=1e-2), i


def test_greedy_generate_on_a_left_padded_batch_gives_each_prompt_its_own_tokens():
    model = dsattn_hf.enable(tiny((SWA, HCA, CSA)))
    prompts = _prompts([70, 41, 9, 55], seed=30)
    ids, mask = padded(prompts, "left")
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
        for i, p in enumerate(prompts):
            alone = model.generate(p[None], max_new_tokens=16, do_sample=False)[0, len(p):]
            row = batch[i, ids.size(1):]
            # a prompt alone stops at its end-of-sequence token; in the batch its row is padded after it
            assert torch.equal(row[:alone.numel()], alone), i
            assert bool((row[alone.numel():] == model.generation_config.eos_token_id).all()), i


def test_training_on_a_right_padded_batch_is_its_rows_trained_alone():
    """labels -100 on the padding: the batch loss is the token-weighted mean of the rows' own losses, and
    so are the gradients."""
    model = dsattn_hf.enable(tiny((HCA, CSA)).train())
    prompts = _prompts([40, 23, 31], seed=50)
    ids, mask = padded(prompts, "right")
    labels = ids.masked_fill(mask == 0, -100)
    model.zero_grad()
    loss = model(ids, attention_mask=mask, labels=labels, use_cache=False).loss
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    weights = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.float32)
    weights = weights / weights.sum()
    total = 0.0
    for w, p in zip(weights, prompts):
        row = model(p[None], labels=p[None], use_cache=False).loss * w
        row.backward()
        total += row.item()
    assert abs(loss.item() - total) <= 1e-5 * abs(total)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want) and any("compressor" in n for n in want)
    for name, g in want.items():
        assert torch.allclose(got[name], g, rtol=1e-4, atol=1e-5 * g.abs().max().item() + 1e-12), name


def test_a_padded_cache_serves_its_batch_only():
    model = dsattn_hf.enable(tiny((HCA,)))
    ids, mask = padded(_prompts([20, 12]), "left")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="^cache: it serves a padded batch of 2 rows, got a batch of 1"):
            model(ids[:1], attention_mask=mask[:1], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match=r"^attention_mask: expected \[batch=2, >= 20 tokens\]"):
            model(ids, attention_mask=mask[:, :5], use_cache=False)
        used = DynamicCache(config=model.config)
        model(ids[:, -4:], past_key_values=used, use_cache=True)
        with pytest.raises(ValueError, match="^cache: it holds an unpadded batch"):
            model(ids, attention_mask=mask, past_key_values=used, use_cache=True)


def test_wrong_models_raise_clear_errors():
    model = tiny((HCA,))
    dsattn_hf.enable(model)
    ids = _ids(2, 40)
    model(ids, attention_mask=torch.ones_like(ids))               # an all-ones mask runs as one batch
    with pytest.raises(ValueError, match="^model"):
        dsattn_hf.enable(torch.nn.Linear(2, 2))
    dsattn_hf.disable(model)
    attn = model.model.layers[0].self_attn
    assert not hasattr(attn, "_dsattn_original_forward") and not hasattr(model.model, "_dsattn_original_forward")


def test_no_dense_mask_and_from_pretrained_with_dsattn(tmp_path):
    """Enabled, the model builds no [S, S + past] sliding-window mask (the registered mask function returns
    None); a model saved and loaded with ``attn_implementation="dsattn"`` runs once enabled and says what is
    missing when it is not."""
    model = tiny((SWA, CSA))
    seen = []
    layer = model.model.layers[0]
    hook = layer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    ids = _ids(1, 40)
    want = _logits(ids)(model)
    dsattn_hf.enable(model)
    got = _logits(ids)(model)
    hook.remove()
    assert isinstance(seen[0], torch.Tensor) and seen[1] is None
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    dsattn_hf.disable(model)
    assert model.config._attn_implementation == "eager"
    model.save_pretrained(tmp_path)
    loaded = DeepseekV4ForCausalLM.from_pretrained(tmp_path, attn_implementation="dsattn").eval()
    with pytest.raises(RuntimeError, match="enable"):
        _logits(ids)(loaded)
    assert torch.allclose(_logits(ids)(dsattn_hf.enable(loaded)), want, rtol=1e-4, atol=1e-5)


def _eager_indexer_kl(model, ids, selected, weight):
    """Spec 10 §2.5's loss from the eager model itself: the teacher is the eager attention's probability
    of each selected compressed entry averaged over heads (its attention weights, normalised with the
    sink), the student the softmax of the model's own dense index scores at the selected slots;
    ``selected``: the top-k lists dsattn used, one per CSA layer in order."""
    scores, weights = [], []
    hooks = []
    for layer in model.model.layers:
        attn = layer.self_attn
        if getattr(attn.compressor, "indexer", None) is None:
            continue
        hooks.append(attn.compressor.indexer.scorer.register_forward_hook(lambda m, a, out: scores.append(out)))
        hooks.append(attn.register_forward_hook(lambda m, a, out: weights.append(out[1].detach())))
    model(ids, use_cache=False, output_attentions=True)
    for h in hooks:
        h.remove()
    B, S = ids.shape
    total = 0.0
    for idx, score, w in zip(selected, scores, weights):
        idx = idx[:, :, 0].long()                                    # [B, S, K]
        valid = idx >= 0
        safe = idx.clamp_min(0)
        student = torch.gather(score, 2, safe).masked_fill(~valid, float("-inf")).log_softmax(-1)
        teacher = torch.gather(w.mean(1), 2, S + safe) * valid       # columns: S window keys, then the entries
        total = total - (teacher * student.masked_fill(~valid, 0.0)).sum() * (weight / (B * S))
    return total


def test_indexer_kl_loss_is_spec_10_against_the_eager_model():
    """``enable(model, indexer_kl_loss=True)``: the returned loss is the LM loss plus the CSA layers'
    indexer KL terms, the term equals spec 10's loss computed from the eager model's own attention
    weights and dense index scores, and its gradient reaches exactly the indexer's parameters, equal
    to autograd through the eager model's indexer."""
    model = tiny((CSA, HCA, CSA)).train()
    ids = _ids(2, 120)
    weight = 0.7
    lm = model(ids, labels=ids, use_cache=False).loss
    selected = []
    real_topk = dsattn_hf._topk
    dsattn_hf.enable(model, indexer_kl_loss=True, indexer_kl_weight=weight)
    try:
        dsattn_hf._topk = lambda *a: selected.append(real_topk(*a)) or selected[-1]
        model.zero_grad()
        out = model(ids, labels=ids, use_cache=False)
        out.indexer_kl_loss.backward()
    finally:
        dsattn_hf._topk = real_topk
        dsattn_hf.disable(model)
    assert len(selected) == 2 and out.indexer_kl_loss > 0
    assert torch.allclose(out.loss, lm + out.indexer_kl_loss, rtol=1e-5)
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert got and all(".indexer." in n for n in got), sorted(got)
    model.zero_grad()
    want = _eager_indexer_kl(model, ids, selected, weight)
    assert torch.allclose(out.indexer_kl_loss, want, rtol=1e-4), (out.indexer_kl_loss, want)
    want.backward()
    for name, g in got.items():
        ref = dict(model.named_parameters())[name].grad
        assert torch.allclose(g, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()), name
    with torch.no_grad():                                    # inference: no KL work, no extra output
        assert "indexer_kl_loss" not in dsattn_hf.enable(model, indexer_kl_loss=True)(ids, use_cache=False)
    with pytest.raises(TypeError, match="^indexer_kl_weight"):
        dsattn_hf.enable(model, indexer_kl_loss=True, indexer_kl_weight="1")


def test_masks_dsattn_cannot_honour_raise_naming_their_shape():
    """A packed-sequence (block-diagonal) mask, a plain causal mask longer than the window (not the model's own
    sliding-window mask), a 3-D mask, a prepared dict holding a mask and position ids restarting within a row
    would each be misread; each is a ValueError naming its shape before any layer runs."""
    model = dsattn_hf.enable(tiny((SWA, HCA, CSA)))                    # window 16
    one, two = _ids(1, 40), _ids(2, 40)
    accepts = r".*or the model's own 4-D sliding-window \(16\) causal mask with key padding"
    for mask in (block_diagonal_mask([15, 25]), causal_mask_4d(torch.ones(1, 40))):
        assert_refused(model, r"^attention_mask: the 4-D mask of shape \(1, 1, 40, 40\) is not the model's own causal "
                       r"mask with key padding" + accepts, input_ids=one, attention_mask=mask, use_cache=False)
    assert_refused(model, r"^attention_mask: shape \(2, 40, 40\) \(3-D\) is not a mask dsattn can honour" + accepts,
                   input_ids=two, attention_mask=causal_mask_4d(torch.ones(2, 40), window=16)[:, 0], use_cache=False)
    assert_refused(model, r"^attention_mask: a dict of prepared masks \{'sliding_attention': \(1, 1, 40, 40\)\}",
                   input_ids=one, attention_mask={"sliding_attention": block_diagonal_mask([15, 25])}, use_cache=False)
    restarts = torch.cat([torch.arange(15), torch.arange(25)])[None]
    assert_refused(model, r"^position_ids: they restart within a row \(packed sequences, shape \(1, 40\)\)" + accepts,
                   input_ids=one, position_ids=restarts, use_cache=False)


def test_the_models_own_4d_mask_is_honoured():
    """The model's own 4-D mask (sliding-window causal AND key padding, as create_sliding_window_causal_mask builds
    it, additive or bool) runs as its 2-D padding mask; with a cache past the window, the model's mask covers the
    last window - 1 cached keys, and continuing a cache with it equals the one-shot logits."""
    model = tiny((SWA, HCA, CSA))
    ids, mask = padded(_prompts([40, 23, 9]), "left")
    own = first_layer_mask(model, input_ids=ids, attention_mask=mask, use_cache=False)
    assert own.shape == (3, 1, 40, 40) and torch.equal(own == 0, causal_mask_4d(mask, window=16))
    long = _ids(2, 50)
    eager_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(long[:, :30], cache=eager_cache, use_cache=True)
    cached = first_layer_mask(model, input_ids=long[:, 30:], attention_mask=torch.ones(2, 50, dtype=torch.long),
                              cache=eager_cache, use_cache=True)
    assert cached.shape == (2, 1, 20, 35)                               # 15 cached keys in the window + 20 new
    dsattn_hf.enable(model)
    with torch.no_grad():
        want = model(ids, attention_mask=mask, use_cache=False).logits
        for form in (own, own == 0):
            assert torch.equal(model(ids, attention_mask=form, use_cache=False).logits, want)
        one = model(long, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        chunks = [model(long[:, :30], cache=cache, use_cache=True).logits,
                  model(long[:, 30:], attention_mask=cached, cache=cache, use_cache=True).logits]
    assert torch.allclose(torch.cat(chunks, 1), one, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("version,ok", [("5.10.0", False), ("5.16.2", False), ("5.17.0rc1", False),
                                        ("5.17.0", True), ("5.25.0", True), ("6.1.0", True)])
def test_the_transformers_version_floor(monkeypatch, version, ok):
    from dsattn.integrations import transformers_dsa
    patch_transformers_version(monkeypatch, version)
    if ok:
        transformers_dsa.check_transformers_version()
    else:
        with pytest.raises(ImportError, match=r"^dsattn's transformers integration needs transformers >= 5\.17 "
                                              rf"\(installed: {re.escape(version)}\)"):
            transformers_dsa.check_transformers_version()


def test_an_old_transformers_is_named_at_enable_and_at_import(monkeypatch):
    model = tiny((HCA,))
    patch_transformers_version(monkeypatch, "5.10.0")
    want = r"^dsattn's transformers integration needs transformers >= 5\.17 \(installed: 5\.10\.0\)"
    with pytest.raises(ImportError, match=want):
        dsattn_hf.enable(model)
    assert model.config._attn_implementation == "eager" and not hasattr(model.model, "_dsattn_original_forward")
    for name in ("dsattn.integrations.transformers", "dsattn.integrations.transformers_dsa"):
        monkeypatch.delitem(sys.modules, name)               # (restored after the test)
    with pytest.raises(ImportError, match=want):
        importlib.import_module("dsattn.integrations.transformers")
