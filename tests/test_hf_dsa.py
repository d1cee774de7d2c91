"""transformers' DSA models (DeepSeek-V3.2, GLM-5.x) on dsattn: tiny random configs at the real latent (512 + 64
rope) and indexer (64 / 32 heads of 128) widths, built locally (no download), fresh per test, the dsattn-enabled
model against the model's own eager attention."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.glm_moe_dsa")
from transformers import (DeepseekV32Config, DeepseekV32ForCausalLM, DynamicCache, GlmMoeDsaConfig,  # noqa: E402
                          GlmMoeDsaForCausalLM)

from dsattn.integrations import transformers as dsattn_hf  # noqa: E402
from hf_common import (assert_generate_matches_eager, assert_refused, block_diagonal_mask, both,  # noqa: E402
                       causal_mask_4d, first_layer_mask, padded, patch_transformers_version)

VOCAB = 97


def _common(layers, topk):
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                num_hidden_layers=layers, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                topk_group=1, kv_lora_rank=512, q_lora_rank=48, qk_rope_head_dim=64, index_topk=topk,
                index_head_dim=128, max_position_embeddings=4096, first_k_dense_replace=1,
                attn_implementation="eager")


def v32(layers=2, topk=32, seed=0, dtype=torch.float32):
    """V3.2's attention widths but for the head count: latent 512 + rope 64, nope 128, v 128, indexer 64 x 128."""
    cfg = DeepseekV32Config(**_common(layers, topk), num_attention_heads=4, num_key_value_heads=4,
                            qk_nope_head_dim=128, v_head_dim=128, index_n_heads=64)
    torch.manual_seed(seed)
    return DeepseekV32ForCausalLM(cfg).to(dtype).eval()


def glm5(indexer_types=("full", "shared", "full", "shared"), topk=32, seed=0, dtype=torch.float32):
    """GLM-5's: nope 192, v 256, indexer 32 x 128 with interleaved rope, IndexShare layers."""
    cfg = GlmMoeDsaConfig(**_common(len(indexer_types), topk), num_attention_heads=4, num_key_value_heads=4,
                          qk_nope_head_dim=192, v_head_dim=256, index_n_heads=32, indexer_types=list(indexer_types))
    torch.manual_seed(seed)
    return GlmMoeDsaForCausalLM(cfg).to(dtype).eval()


def glm5_flash(layer_types=("linear_attention", "indexed_attention", "indexed_attention", "linear_attention"),
               indexer_types=("full", "full", "shared", "full"), topk=48, kpool=16, seed=0, dtype=torch.float32):
    """GLM-5.3-Flash's sparse layers (no rope, latent 512, nope 256, v 256, indexer 32 x 128 over pools of 16
    tokens, the open tail always kept) between KDA linear-attention layers (left to transformers)."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=512, q_lora_rank=48, qk_nope_head_dim=256,
                v_head_dim=256, index_topk=topk, index_head_dim=128, index_n_heads=32, index_kpool=kpool,
                layer_types=list(layer_types), indexer_types=list(indexer_types), linear_head_dim=16,
                linear_num_heads=4, hc_mult=2, max_position_embeddings=4096, pad_token_id=0)
    cfg = Glm5NextConfig(text_config=text, vision_config=dict(depth=1, hidden_size=32, num_heads=2,
                                                              intermediate_size=32, out_hidden_size=64))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(cfg).to(dtype).eval()
    with torch.no_grad():                # (the init gives every token of a pool the same gate: a test of nothing)
        for name, p in model.named_parameters():
            if "index_kpool" in name:
                p.normal_()
    return model


FAMILIES = {"v3.2": v32, "glm-5": glm5, "glm-5.3-flash": glm5_flash}


def _ids(batch, length, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(ids, **kw):
    def run(model):
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False, **kw).logits
    return run


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("topk,length", [(32, 150), (512, 90)], ids=["top32-of-150", "top512-of-90"])
def test_forward_matches_eager_fp32(family, topk, length):
    """Selection at the boundary (top-32 of 150 keys; GLM-5.3-Flash: 2 of 9 pools and the tail) and every key."""
    want, got = both(FAMILIES[family](topk=topk), _logits(_ids(2, length)))
    assert (got - want).abs().max() <= 1e-5, (got - want).abs().max()


def test_kpool_list_is_pools_then_the_open_tail():
    """GLM-5.3-Flash's list: whole pools of 16 whose last token the query sees, then its own incomplete pool."""
    from dsattn.integrations import transformers_dsa
    model = glm5_flash(topk=32)
    attn = model.model.language_model.layers[1].self_attn
    h = torch.randn(1, 70, 64)
    q_resid = attn.q_a_layernorm(attn.q_a_proj(h))
    idx = transformers_dsa.kpool_topk(attn.indexer, h, q_resid, None, None)[0, :, 0]
    assert idx.shape == (70, 32 + 15)
    for p in (0, 14, 15, 16, 40, 63, 69):
        got = idx[p][idx[p] >= 0].tolist()
        pools = (p + 1) // 16
        tail = list(range(pools * 16, p + 1))
        assert got[len(got) - len(tail):] == tail, p
        chosen = sorted({t // 16 for t in got[:len(got) - len(tail)]})
        assert len(chosen) == min(pools, 2) and all(c < pools for c in chosen), p
        assert sorted(got[:len(got) - len(tail)]) == [c * 16 + j for c in chosen for j in range(16)], p


def test_query_chunks_equal_one_call(monkeypatch):
    """Queries in several sparse_flash_mla calls (each with its own visible bound) equal one call."""
    from dsattn.integrations import transformers_dsa
    model = dsattn_hf.enable(v32(topk=16))
    ids = _ids(2, 100)
    one = _logits(ids)(model)
    monkeypatch.setattr(transformers_dsa, "QUERY_CHUNK", 17)
    assert torch.allclose(_logits(ids)(model), one, rtol=1e-5, atol=1e-6)


def test_index_share_layers_run_no_indexer(monkeypatch):
    from dsattn.integrations import transformers_dsa
    calls = []
    real = transformers_dsa.indexer_topk
    monkeypatch.setattr(transformers_dsa, "indexer_topk", lambda m, *a: calls.append(m.layer_idx) or real(m, *a))
    model = dsattn_hf.enable(glm5(("full", "shared", "shared", "full", "shared")))
    assert model.model.layers[1].self_attn.indexer is None
    _logits(_ids(1, 60))(model)
    assert calls == [0, 3]


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_cache_matches_eager(family):
    assert_generate_matches_eager(FAMILIES[family](topk=32), _ids(1, 60), 24)


def test_chunked_prefill_equals_one_shot():
    model = dsattn_hf.enable(glm5(topk=16))
    ids = _ids(2, 70)
    with torch.no_grad():
        one = model(ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        chunks = [model(ids[:, i:i + 25], cache=cache, use_cache=True).logits for i in range(0, 70, 25)]
    assert (torch.cat(chunks, 1) - one).abs().max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_training_gradients_match_eager(family):
    """Every attention parameter with a gradient in the eager model (the projections, norms, ``kv_b_proj``
    absorbed into the query and the output) gets the same one through sparse_flash_mla's backward; the indexer
    only selects, in both."""
    model = FAMILIES[family](topk=32).train()
    ids = _ids(2, 80)

    def grads(m):
        m.zero_grad()
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None and "self_attn" in n}
    want, got = both(model, grads)
    assert set(got) == set(want) and any("kv_b_proj" in n for n in want)
    for name, g in want.items():
        assert torch.allclose(got[name], g, rtol=1e-4, atol=1e-4 * g.abs().max().item()), name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_gives_each_row_its_prompt_alone(family, side):
    model = dsattn_hf.enable(FAMILIES[family](topk=16))
    prompts = [_ids(1, n, seed=10 + i)[0] for i, n in enumerate([50, 31, 7])]   # (GLM-5.3-Flash: 16 = one pool)
    ids, mask = padded(prompts, side)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        for i, p in enumerate(prompts):
            alone = model(input_ids=p[None], use_cache=False).logits[0]
            assert torch.allclose(out[i, mask[i].bool()], alone, rtol=1e-5, atol=1e-5), i


def test_bf16_is_as_close_to_fp32_as_eager_bf16():
    ids = _ids(1, 120)
    truth = _logits(ids)(glm5(topk=32))
    want, got = both(glm5(topk=32, dtype=torch.bfloat16), _logits(ids))
    err_eager, err_dsattn = (want.float() - truth).abs(), (got.float() - truth).abs()
    assert err_dsattn.max() <= 1.25 * err_eager.max(), (err_dsattn.max(), err_eager.max())
    assert err_dsattn.mean() <= 1.25 * err_eager.mean(), (err_dsattn.mean(), err_eager.mean())


def test_configs_it_cannot_serve_raise_before_any_weight_is_touched():
    model = glm5(("shared", "full"))
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"^config\.indexer_types: the first layer is 'shared'"):
        dsattn_hf.enable(model)
    assert model.config._attn_implementation == "eager"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match=r"^indexer_kl_loss: True is served for DeepSeek-V4 only"):
        dsattn_hf.enable(v32(), indexer_kl_loss=True)
    with pytest.raises(ValueError, match=r"^model: Linear has no attention module dsattn serves"):
        dsattn_hf.enable(torch.nn.Linear(2, 2))
    flash = glm5_flash(("indexed_attention", "linear_attention", "indexed_attention"), ("full", "full", "shared"))
    with pytest.raises(ValueError, match=r"^config\.indexer_types: layer 2 is 'shared' but layer 1 is not a full"):
        dsattn_hf.enable(flash)


def test_disable_restores_the_model():
    model = v32()
    ids = _ids(1, 50)
    want = _logits(ids)(model)
    dsattn_hf.enable(model)
    dsattn_hf.disable(model)
    attn = model.model.layers[0].self_attn
    assert not hasattr(attn, "_dsattn_original_forward") and not hasattr(model.model, "_dsattn_original_forward")
    assert model.config._attn_implementation == "eager"
    assert torch.equal(_logits(ids)(model), want)


@pytest.mark.parametrize("family", FAMILIES)
def test_masks_dsattn_cannot_honour_raise_naming_their_shape(family):
    """Masks transformers would hand on (a 4-D one as-is) or drop (a 3-D one) and dsattn's attention would ignore --
    a packed-sequence (block-diagonal) mask, bool or additive, a 3-D mask, an attention bias, a 2-D additive mask,
    position ids restarting within a row -- are each a ValueError naming the shape, before any layer runs."""
    model = dsattn_hf.enable(FAMILIES[family](topk=16))
    one, two = _ids(1, 40), _ids(2, 40)
    packed = block_diagonal_mask([15, 25])
    accepts = r".*takes None, a 2-D padding mask \[batch, past \+ new tokens\] of 0 / 1, or the model's own 4-D causal"
    for mask in (packed, torch.zeros(packed.shape).masked_fill(~packed, torch.finfo(torch.float32).min)):
        assert_refused(model, r"^attention_mask: the 4-D mask of shape \(1, 1, 40, 40\) is not the model's own causal "
                       r"mask with key padding \(e\.g\. a block-diagonal packed-sequence mask\)" + accepts,
                       input_ids=one, attention_mask=mask, use_cache=False)
    assert_refused(model, r"^attention_mask: shape \(2, 40, 40\) \(3-D\) is not a mask dsattn can honour" + accepts,
                   input_ids=two, attention_mask=causal_mask_4d(torch.ones(2, 40))[:, 0], use_cache=False)
    bias = torch.zeros(1, 1, 40, 40).masked_fill(~causal_mask_4d(torch.ones(1, 40)), float("-inf"))
    bias[..., 0] -= 0.5
    assert_refused(model, r"^attention_mask: the 4-D mask of shape \(1, 1, 40, 40\) holds values other than 0 and "
                   r"-inf", input_ids=one, attention_mask=bias, use_cache=False)
    additive = torch.zeros(2, 40).masked_fill(torch.arange(40) < 5, float("-inf"))
    assert_refused(model, r"^attention_mask: the 2-D mask of shape \(2, 40\) holds values other than 0 and 1",
                   input_ids=two, attention_mask=additive, use_cache=False)
    restarts = torch.cat([torch.arange(15), torch.arange(25)])[None]
    assert_refused(model, r"^position_ids: they restart within a row \(packed sequences, shape \(1, 40\)\)" + accepts,
                   input_ids=one, position_ids=restarts, use_cache=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_models_own_4d_mask_runs_as_its_padding_mask(family):
    """The 4-D mask the eager model builds itself from a padding mask (causal AND key padding; eager's additive form
    and sdpa's bool form) is honoured: it runs as that 2-D mask.  So does a broadcast [1, 1, S, S] causal mask."""
    model = FAMILIES[family](topk=16)
    ids, mask = padded([_ids(1, n, seed=20 + i)[0] for i, n in enumerate([40, 23])], "left")
    if family == "glm-5.3-flash":           # (its eager model builds no 4-D mask: transformers' bool form by hand)
        own = causal_mask_4d(mask)
        forms = [own, torch.zeros(own.shape).masked_fill(~own, float("-inf"))]
    else:
        own = first_layer_mask(model, input_ids=ids, attention_mask=mask, use_cache=False)
        assert own.shape == (2, 1, 40, 40) and torch.equal(own == 0, causal_mask_4d(mask))
        forms = [own, own == 0]
    dsattn_hf.enable(model)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        for form in forms:
            assert torch.equal(model(input_ids=ids, attention_mask=form, use_cache=False).logits, want)
        full, causal = _ids(2, 40), causal_mask_4d(torch.ones(1, 40))
        assert torch.equal(model(input_ids=full, attention_mask=causal, use_cache=False).logits,
                           model(input_ids=full, use_cache=False).logits)


def test_a_4d_causal_mask_continues_a_cache():
    """With a cache, the model's own mask covers the cached keys too ([B, 1, S, past + S]); the mask of a fresh call
    is not it."""
    model = dsattn_hf.enable(v32(topk=16))
    ids = _ids(2, 50)
    causal = causal_mask_4d(torch.ones(2, 50))
    with torch.no_grad():
        one = model(input_ids=ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        chunks = [model(input_ids=ids[:, :30], attention_mask=causal[:, :, :30, :30], cache=cache,
                        use_cache=True).logits,
                  model(input_ids=ids[:, 30:], attention_mask=causal[:, :, 30:], cache=cache, use_cache=True).logits]
    assert (torch.cat(chunks, 1) - one).abs().max() <= 1e-5
    assert_refused(model, r"^attention_mask: the 4-D mask has shape \(2, 1, 10, 10\); the model's own mask for this "
                   r"call is \[2 or 1, 1, 10, 60\] \(50 cached tokens\)", input_ids=ids[:, :10],
                   attention_mask=causal[:, :, :10, :10], cache=cache, use_cache=True)


def test_an_old_transformers_is_named_not_taken_for_a_wrong_model(monkeypatch):
    """On transformers 5.16 (no GLM-5.3-Flash classes) enable says which version it needs, not "no attention
    module dsattn serves"."""
    model = glm5_flash()
    patch_transformers_version(monkeypatch, "5.16.2")
    with pytest.raises(ImportError, match=r"^dsattn's transformers integration needs transformers >= 5\.17 "
                                          r"\(installed: 5\.16\.2\)"):
        dsattn_hf.enable(model)
