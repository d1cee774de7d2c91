"""The plug-in's float32 versions of vLLM's bf16-only DeepSeek-V4 CPU kernels (``v4_fp32``) against those
kernels on bf16 inputs: the same math, so the outputs agree to bf16 rounding (the kernels round some
intermediates to bf16, the versions compute in float32 and round once), and the window cache bytes are the
same FP8 codes and scales. Fresh random inputs per run, real V4 sizes (head 512 = 448 + 64, 4 streams)."""
import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops  # noqa: E402,F401  (loads torch.ops._C)

from dsattn.integrations.vllm import v4_fp32  # noqa: E402
from dsattn.quant import flashmla as layouts  # noqa: E402
from vllm_helpers import needs_vllm_v4_kernels  # noqa: E402

pytestmark = needs_vllm_v4_kernels          # (each test compares against vLLM's V4 kernels)

HC, D = 4, 256


# the dtype our versions get the same values in: bf16 runs their PyTorch, float32 dsattn's compiled layer where
# it is loaded (the path a float32 model takes)
@pytest.fixture(params=[torch.bfloat16, torch.float32], ids=["bf16", "float32"])
def as_dtype(request):
    return request.param


@pytest.fixture
def g():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def _close_bf16(got, want, ulps=2):
    """Within ``ulps`` bf16 steps of the larger magnitude (plus a floor for values near zero)."""
    got, want = got.float(), want.float()
    step = torch.maximum(got.abs(), want.abs()) * 2.0 ** -7
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    bad = (got - want).abs() > ulps * step + 1e-3
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} differ: max {float((got - want).abs().max()):.3g}"


def _mhc_weights(g, T):
    x = _randn(g, T, HC, D).to(torch.bfloat16)
    fn = _randn(g, (2 + HC) * HC, HC * D, scale=0.02)
    return x, fn, _randn(g, 3, scale=0.5).abs() + 0.5, _randn(g, (2 + HC) * HC, scale=0.3)


def test_hc_pre_equals_vllms_kernel(g, as_dtype):
    x, fn, scale, base = _mhc_weights(g, 37)
    want = torch.ops._C.hc_pre_fused_cpu(x, fn, scale, base, HC, 20, 1e-6, 1e-6)
    got = v4_fp32.hc_pre(x.to(as_dtype), fn, scale, base, HC, 20, 1e-6, 1e-6)
    _close_bf16(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert a.shape == b.reshape(a.shape).shape
        torch.testing.assert_close(a, b.reshape(a.shape).float(), rtol=1e-4, atol=1e-5)


def test_hc_post_equals_vllms_kernel(g, as_dtype):
    T = 29
    x, res = _randn(g, T, D).to(torch.bfloat16), _randn(g, T, HC, D).to(torch.bfloat16)
    post, comb = torch.rand(T, HC, generator=g) * 2, torch.rand(T, HC, HC, generator=g)
    _close_bf16(v4_fp32.hc_post(x.to(as_dtype), res.to(as_dtype), post, comb),
                torch.ops._C.hc_post_fused_cpu(x, res, post, comb))


def test_hc_head_equals_vllms_kernel(g, as_dtype):
    T = 23
    x = _randn(g, T, HC, D).to(torch.bfloat16)
    fn, scale, base = _randn(g, HC, HC * D, scale=0.02), _randn(g, 1).abs() + 0.5, _randn(g, HC, scale=0.3)
    _close_bf16(v4_fp32.hc_head(x.to(as_dtype), fn, scale, base, 1e-6, 1e-6),
                torch.ops._C.hc_head_fused_cpu(x, fn, scale, base, 1e-6, 1e-6))


def _rope_table(g, positions=512, rope=64):
    theta = torch.rand(positions, rope // 2, generator=g) * 6.3
    return torch.cat([torch.cos(theta), torch.sin(theta)], -1)


def test_qnorm_rope_kv_insert_equals_vllms_kernel(g, as_dtype):
    """The padded query and the window cache: every stored FP8 code and scale equal, rope parts within a bf16
    step; slot -1 and the slots nobody writes keep their bytes."""
    T, H, padded, bs, nb = 19, 6, 8, 16, 5
    q = _randn(g, T, H, 512, scale=3.0).to(torch.bfloat16)
    kv = _randn(g, T, 512)
    kv[::4, 64:128] *= 1e-3                              # tiles of amax ~3e-3: vLLM's scale floor, not FlashMLA's
    kv = kv.to(torch.bfloat16)
    positions = torch.randint(0, 512, (T,), generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[3] = -1
    table = _rope_table(g)
    raw = torch.randint(0, 256, (nb, bs * 584), dtype=torch.uint8, generator=g)
    ours, theirs = raw.clone(), raw.clone()
    want = torch.ops._C.fused_qnorm_rope_kv_insert_cpu(q, kv, positions, theirs, slots, table, padded, 1e-6, bs)
    got = v4_fp32.qnorm_rope_kv_insert(q.to(as_dtype), kv.to(as_dtype), positions, ours, slots, table, padded,
                                       1e-6, bs)
    assert got.shape == want.shape == (T, padded, 512) and not got[:, H:].any() and not want[:, H:].any()
    _close_bf16(got, want)
    lay = layouts.V4
    body = lay.d_nope + 2 * lay.d_rope
    written = slots[slots >= 0]
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[written] = False
    blk, off = written // bs, written % bs
    for name, (start, width) in {"fp8 nope": (0, lay.d_nope), "scales": (bs * body, lay.scale_bytes)}.items():
        at = (off * (body if name == "fp8 nope" else lay.scale_bytes))[:, None] + start + torch.arange(width)
        assert torch.equal(ours[blk[:, None], at], theirs[blk[:, None], at]), name
    at = (off * body)[:, None] + lay.d_nope + torch.arange(2 * lay.d_rope)
    _close_bf16(ours[blk[:, None], at].contiguous().view(torch.bfloat16),
                theirs[blk[:, None], at].contiguous().view(torch.bfloat16))
    keep_blk, keep_off = untouched.nonzero()[:, 0] // bs, untouched.nonzero()[:, 0] % bs
    at = (keep_off * body)[:, None] + torch.arange(body)
    assert torch.equal(ours[keep_blk[:, None], at], raw[keep_blk[:, None], at])


def test_inverse_rope_equals_vllms_kernel(g, as_dtype):
    T, H = 17, 6
    o = _randn(g, T, H, 512).to(torch.bfloat16)
    positions = torch.randint(0, 512, (T,), generator=g)
    table = _rope_table(g)
    want = torch.ops._C.inverse_gptj_rope_o_proj_cpu(o, positions, table, 64)
    got = v4_fp32.gptj_rope(o.to(as_dtype), positions, table, inverse=True)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    back = v4_fp32.gptj_rope(got, positions, table)                    # the inverse undoes the rotation
    torch.testing.assert_close(back, o.float(), rtol=1e-5, atol=1e-5)


def test_float32_calls_go_to_the_versions_and_bf16_calls_to_vllm(monkeypatch):
    """The dispatchers: float32 arguments reach the float32 version, bf16 ones vLLM's kernel unchanged."""
    seen = []
    monkeypatch.setitem(v4_fp32.FLOAT32_VERSIONS, "hc_head_fused_cpu",
                        (lambda *a: seen.append("ours") or "ours", 0))
    call = v4_fp32._dispatcher("hc_head_fused_cpu", lambda *a: seen.append("vllm") or "vllm")
    assert call(torch.zeros(1, dtype=torch.float32)) == "ours"
    assert call(torch.zeros(1, dtype=torch.bfloat16)) == "vllm"
    assert seen == ["ours", "vllm"]
