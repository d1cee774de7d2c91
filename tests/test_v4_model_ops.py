"""dsattn's compiled DeepSeek-V4 model ops (``native/v4_model.cpp``: mHC pre / post / head, GPT-J RoPE, the query
norm + RoPE with the window row's FP8 store) against their PyTorch versions in the vLLM plug-in (``v4_fp32``),
which vLLM's own bf16 kernels check in ``tests/vllm_plugin/test_v4_fp32.py``.  Fresh random inputs per case, V4's
row widths (512 = 448 + 64 RoPE, 4 streams); the window cache starts as random bytes so that a stray or missing
write shows."""
import pytest
import torch

from dsattn import native
from dsattn.integrations.vllm import v4_fp32

HC = 4


@pytest.fixture
def module():
    m = native.load()
    if m is None:
        pytest.skip("the compiled layer is not loaded")
    return m


@pytest.fixture
def g():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def _mhc(g, T, D):
    x = torch.randn(T, HC, D, generator=g)
    fn = torch.randn((2 + HC) * HC, HC * D, generator=g) * 0.02
    return x, fn, torch.rand(3, generator=g) + 0.5, torch.randn((2 + HC) * HC, generator=g) * 0.3


def _close(got, want, rtol=2e-5, atol=2e-6):
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("T", [0, 1, 37])
def test_hc_pre(module, g, T):
    args = _mhc(g, T, 256) + (HC, 20, 1e-6, 1e-6)
    got, want = module.v4_hc_pre(*args), v4_fp32.hc_pre_torch(*args)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == torch.float32
        _close(a, b)
    if T:
        comb = got[2]                             # Sinkhorn: columns sum to 1 after the last normalisation
        _close(comb.sum(-2), torch.ones(T, HC), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T", [1, 29])
def test_hc_post(module, g, T):
    D = 384
    x, res = torch.randn(T, D, generator=g), torch.randn(T, HC, D, generator=g)
    post, comb = torch.rand(T, HC, generator=g) * 2, torch.rand(T, HC, HC, generator=g)
    _close(module.v4_hc_post(x, res, post, comb), v4_fp32.hc_post_torch(x, res, post, comb))


@pytest.mark.parametrize("T", [1, 21])
def test_hc_head(module, g, T):
    D = 256
    x = torch.randn(T, HC, D, generator=g)
    fn = torch.randn(HC, HC * D, generator=g) * 0.02
    scale, base = torch.rand(1, generator=g) + 0.5, torch.randn(HC, generator=g)
    _close(module.v4_hc_head(x, fn, scale, base, 1e-6, 1e-6), v4_fp32.hc_head_torch(x, fn, scale, base, 1e-6, 1e-6))


def _table(g, positions=4096, R=64):
    angle = torch.rand(positions, R // 2, generator=g) * 6.3
    return torch.cat([angle.cos(), angle.sin()], -1)


@pytest.mark.parametrize("inverse", [False, True])
def test_gptj_rope(module, g, inverse):
    table = _table(g)
    x = torch.randn(9, 8, 512, generator=g)
    pos = torch.randint(0, table.size(0), (9,), generator=g)
    got = module.v4_gptj_rope(x, pos, table, inverse)
    _close(got, v4_fp32.gptj_rope_torch(x, pos, table, inverse))
    assert torch.equal(got[..., :448], x[..., :448])
    _close(module.v4_gptj_rope(got, pos, table, not inverse), x, rtol=1e-5, atol=1e-5)


def _window_cache(g, num_blocks, block_size, pad):
    page = block_size * 584 + pad                 # vLLM's pages are padded past their rows
    return torch.randint(0, 256, (num_blocks, page), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("T,H,padded", [(1, 64, 64), (13, 24, 32)])
def test_qnorm_rope_kv_insert(module, g, T, H, padded):
    block_size, num_blocks = 16, 5
    table = _table(g)
    q = torch.randn(T, H, 512, generator=g) * 3
    kv = torch.randn(T, 512, generator=g)
    kv[:, :448] *= torch.logspace(-7, 2, T).unsqueeze(-1)          # tiles at the scale floor, flushed values
    pos = torch.randint(0, table.size(0), (T,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[::3] = -1                                                  # not stored
    cache = _window_cache(g, num_blocks, block_size, pad=96)
    want_cache = cache.clone()
    got = module.v4_qnorm_rope_kv_insert(q, kv, pos, cache, slots, table, padded, 1e-6, block_size, True)
    want = v4_fp32.qnorm_rope_kv_insert_torch(q, kv, pos, want_cache, slots, table, padded, 1e-6, block_size)
    assert got.shape == (T, padded, 512) and (got[:, H:] == 0).all()
    _close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache, want_cache), f"{int((cache != want_cache).sum())} cache bytes differ"


def test_float32_versions_pick_the_compiled_layer(module, g, monkeypatch):
    """The plug-in's entry points give the PyTorch result with the compiled layer loaded and without it."""
    args = _mhc(g, 3, 128) + (HC, 20, 1e-6, 1e-6)
    compiled = v4_fp32.hc_pre(*args)
    monkeypatch.setattr(native, "load", lambda: None)
    for a, b in zip(compiled, v4_fp32.hc_pre(*args)):
        _close(a, b)


def test_bad_input_is_named(module, g):
    x, fn, scale, base = _mhc(g, 2, 64)
    with pytest.raises(TypeError, match="x: expected float32"):
        module.v4_hc_pre(x.bfloat16(), fn, scale, base, HC, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="fn: expected"):
        module.v4_hc_pre(x, fn[:, :-1], scale, base, HC, 20, 1e-6, 1e-6)
    table = _table(g, positions=8)
    with pytest.raises(ValueError, match="positions: 9 outside the RoPE table"):
        module.v4_gptj_rope(torch.randn(1, 2, 512, generator=g), torch.tensor([9]), table, False)
    cache = _window_cache(g, 2, 16, pad=0)
    q, kv = torch.randn(1, 4, 512, generator=g), torch.randn(1, 512, generator=g)
    with pytest.raises(ValueError, match="slot_mapping: slot 32 outside"):
        module.v4_qnorm_rope_kv_insert(q, kv, torch.tensor([0]), cache, torch.tensor([32]), table, 4, 1e-6, 16, True)
    with pytest.raises(ValueError, match="q_head_padded"):
        module.v4_qnorm_rope_kv_insert(q, kv, torch.tensor([0]), cache, torch.tensor([0]), table, 2, 1e-6, 16, True)
