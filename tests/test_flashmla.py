"""dsattn.flashmla (FlashMLA's Python API over dsattn's operators) and FlashMLA's FP8 cache layouts.

Expected values come from FlashMLA's definitions written out here in float64 (gather the listed
tokens, -1 and slots past topk_length masked, logsumexp, the sink scaling the output only, +inf LSE
for a query without keys), and from dsattn's golden for the equivalent dsattn call.  Tolerances:
FlashMLA's (bf16 out abs 1e-3 / rel 2.01/128 on every element for decode, abs 8e-4 / rel 3.01/128
for prefill; LSE abs 1e-6 / rel 2.01/65536), fp32 at 1e-5.  Cache rows no index reads are NaN (bf16) or 0xFF bytes (FP8).
"""
import pytest
import torch

from dsattn import flashmla, reference, testing
from dsattn.quant import dequant_kv_rows
from dsattn.quant import flashmla as F

BF16 = torch.bfloat16


def _seed():
    return int(torch.randint(0, 2**31 - 1, ()).item())


# ----------------------------------------------------------------------------- layouts
def _formula(x: torch.Tensor, layout) -> torch.Tensor:
    """FlashMLA's quantise-dequantise of one token's nope part, tile by tile, in plain float64 /
    float32 steps: s = 2^ceil(log2(max(amax/448, 1e-4))), fp8(x / s) * s."""
    out = torch.empty(x.shape, dtype=torch.float32)
    for t in range(layout.num_tiles):
        tile = x[..., t * layout.tile:(t + 1) * layout.tile].float()
        amax = tile.abs().amax(-1, keepdim=True) / 448.0
        s = torch.pow(2.0, torch.ceil(torch.log2(torch.clamp(amax, min=1e-4))))
        out[..., t * layout.tile:(t + 1) * layout.tile] = (tile / s).to(torch.float8_e4m3fn).float() * s
    return out


def _tokens(layout, nb=3, bs=5, g=None):
    k = torch.randn(nb, bs, 1, layout.d, generator=g) * 3
    k[0, 0, 0, :layout.tile] = 0                                  # an all-zero tile
    k[0, 1, 0, layout.tile:2 * layout.tile] *= 1e-7               # a tile below the 1e-4 floor
    k[1, 2, 0, :layout.d_nope] *= 50                              # large magnitudes
    return k.to(BF16)


@pytest.mark.parametrize("layout", [F.V32, F.V4], ids=["V3.2", "V4"])
def test_layout_matches_flashmla_formula_and_round_trips(layout):
    g = torch.Generator().manual_seed(_seed())
    k = _tokens(layout, g=g)
    cache = F.quantize_cache(k, layout)
    assert cache.shape == (3, 5, 1, layout.row_bytes) and cache.dtype == torch.float8_e4m3fn
    deq = F.dequantize_cache(cache)
    want = torch.cat([_formula(k[..., :layout.d_nope], layout).to(BF16), k[..., layout.d_nope:]], -1)
    assert torch.equal(deq.view(torch.int16), want.view(torch.int16))          # bit for bit, every tile
    # byte placement
    u8 = cache.view(torch.uint8)
    if layout is F.V32:
        scales = u8[..., 512:528].contiguous().view(torch.float32)
        assert torch.equal(u8[..., 528:].contiguous().view(BF16), k[..., 512:])
    else:
        raw = cache.view(torch.uint8)[1].reshape(-1)                         # block 1: bodies, then scales
        body = raw[:5 * 576].view(5, 576)
        assert torch.equal(body[:, 448:].contiguous().view(BF16), k[1, :, 0, 448:])
        scales = raw[5 * 576:].view(5, 8)[:, :7].contiguous().view(torch.float8_e8m0fnu).float()
        assert bool((raw[5 * 576:].view(5, 8)[:, 7] == 0).all())
    assert bool((torch.frexp(scales)[0] == 0.5).all())                        # powers of two
    # lossless to dsattn's packed rows and back
    rows = F.to_packed_rows(cache)
    assert torch.equal(F.from_packed_rows(rows, layout).view(torch.uint8), cache.view(torch.uint8))
    k_rows, _ = dequant_kv_rows(rows, layout.d_rope, BF16, BF16, layout.tile)
    assert torch.equal(k_rows.view(torch.int16), deq.view(torch.int16))


def test_v32_cache_with_a_block_stride_and_token_reads():
    k = _tokens(F.V32)
    dense = F.quantize_cache(k, F.V32)
    padded = torch.zeros(3, 6, 1, 656, dtype=torch.float8_e4m3fn)
    padded[:, :5] = dense
    view = padded[:, :5]                                                      # FlashMLA's test allocation
    assert not view.is_contiguous()
    blk, off = torch.tensor([[2, 0], [1, 1]]), torch.tensor([[4, 0], [3, 2]])
    got = F.dequantize_tokens(view, F.V32, blk, off)
    assert torch.equal(got, F.dequantize_cache(dense)[blk, off, 0])


def test_layout_errors():
    with pytest.raises(ValueError, match="^rows: scales must be powers of two"):
        from dsattn.quant import quantize_kv_rows
        F.from_packed_rows(quantize_kv_rows(torch.randn(2, 3, 1, 576), 64, torch.float8_e4m3fn, 128), F.V32)
    with pytest.raises(ValueError, match="^k_cache: 600 bytes"):
        F.layout_of(torch.zeros(2, 4, 1, 600, dtype=torch.uint8))
    with pytest.raises(TypeError, match="^k_cache:"):
        F.quantize_cache(torch.randn(2, 4, 1, 576), F.V32)


# ----------------------------------------------------------------------------- FlashMLA's definitions, float64
def _ref_attention(q, keys, valid, scale, d_v, sink):
    """q [n, h, d], keys [n, W, d] (float64), valid [n, W] -> out [n, h, d_v], lse [n, h] (no sink,
    +inf without keys), max_logits [n, h]."""
    s = scale * torch.einsum("nhd,nwd->nhw", q.double(), keys.double())
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    mx = s.amax(-1) if s.size(-1) else torch.full(lse.shape, float("-inf"), dtype=torch.float64)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    p = torch.where(valid[:, None, :], p, torch.zeros_like(p))
    out = torch.einsum("nhw,nwd->nhd", p, keys.double()[..., :d_v])
    if sink is not None:
        out = out / (1 + torch.exp(sink.double() - lse))[..., None]
    empty = ~valid.any(-1)
    out[empty] = 0
    lse = torch.where(empty[:, None], torch.full((), float("inf"), dtype=torch.float64), lse)
    return out, lse, mx


def _flat_keys(cache, idx, fp8):
    """Tokens at flat pool indices (any shape) from a bf16 or FP8 cache, float64; -1 -> zeros."""
    bs = cache.size(1)
    safe = idx.clamp(min=0).long()
    if fp8:
        rows = F.dequantize_tokens(cache, F.layout_of(cache), safe // bs, safe % bs, torch.float32)
    else:
        rows = cache[safe // bs, safe % bs, 0].float()
    return torch.where((idx >= 0)[..., None], rows, torch.zeros_like(rows)).double()


def _check(out, lse, want_out, want_lse, prefill=False):
    """FlashMLA's tolerances: decode compares the output rounded to bf16 (abs 1e-3, rel 2.01/128),
    prefill the fp32 output (abs 8e-4, rel 3.01/128); like FlashMLA's kernels, dsattn rounds P to
    bf16 before P·V."""
    if out.dtype == torch.float32:
        assert testing.fp32_math_close(out, want_out), testing.fp32_math_close(out, want_out)
    elif prefill:
        res = testing.flashmla_close(out, want_out, abs_tol=8e-4, rel_tol=3.01 / 128, max_cos_diff=None)
        assert res, res
    else:
        res = testing.flashmla_close(out, want_out.to(out.dtype).double(), abs_tol=1e-3, rel_tol=2.01 / 128,
                                     max_cos_diff=None)
        assert res, res
    lse_res = testing.flashmla_lse_close(lse, want_lse)
    assert lse_res, lse_res


def _pool(nb, bs, d, dtype, g, fp8_layout=None):
    k = (torch.randn(nb, bs, 1, d, generator=g) * 0.5).to(BF16 if fp8_layout else dtype)
    if fp8_layout is None:
        return k, k
    cache = F.quantize_cache(k, fp8_layout)
    return cache, F.dequantize_cache(cache)


def _poison(cache, used: torch.Tensor, fp8: bool):
    """Every pool token no index reads: NaN (bf16) or 0xFF bytes (FP8, V3.2 rows)."""
    nb, bs = cache.shape[:2]
    unread = torch.ones(nb * bs, dtype=torch.bool)
    unread[used[used >= 0].long()] = False
    unread = unread.view(nb, bs)
    if not fp8:
        cache[unread] = float("nan")
    elif F.layout_of(cache) is F.V32:
        cache.view(torch.uint8)[unread] = 0xFF


def _dsattn_golden(q, pool, idx, valid, scale, dv, sink):
    """dsattn's golden on the call dsattn.flashmla makes: each query row one TND batch over its own
    tokens (bf16, compacted: valid slots first), ori mask mode 0, length = its valid slots.  (The
    operators' compressed branch cannot stand in: a row with no ori key and a causal compressed mask
    is an invalid row, p < 0.)  The sink is applied as FlashMLA defines it."""
    b, s_q, h, d = q.shape
    R, K = b * s_q, idx.size(-1)
    v = valid.reshape(R, K)
    order = torch.sort((~v).to(torch.int8), dim=-1, stable=True).indices
    keys = _flat_keys(pool, torch.where(v, idx.reshape(R, K), -1), False)
    keys = torch.gather(keys, 1, order[..., None].expand(R, K, d)).to(q.dtype)
    out, lse = reference.sparse_flash_mla(
        q.reshape(R, h, d), ori_kv=keys.reshape(R * K, 1, d), cu_seqlens_q=torch.arange(R + 1, dtype=torch.int32),
        cu_seqlens_ori_kv=torch.arange(0, R * K + 1, K, dtype=torch.int32), seqused_ori_kv=v.sum(-1).to(torch.int32),
        softmax_scale=scale, ori_mask_mode=0, layout_q="TND", layout_kv="TND", return_softmax_lse=True)
    lse = torch.where(v.any(-1)[:, None], lse[0], torch.tensor(float("inf")))
    out = out.float()[..., :dv] / (1 + torch.exp(sink - lse))[..., None] if sink is not None else out[..., :dv]
    return out.to(q.dtype).view(b, s_q, h, dv), lse.view(b, s_q, h).transpose(1, 2)


@pytest.mark.parametrize("topk", [64, 2048])
@pytest.mark.parametrize("with_len", [False, True])
def test_v32_fp8_sparse_decode(topk, with_len):
    g = torch.Generator().manual_seed(_seed())
    b, s_q, h, d, dv, bs = 2, 2, 8, 576, 512, 64
    nb = -(-3 * topk // bs)
    cache, deq = _pool(nb, bs, d, BF16, g, F.V32)
    idx = torch.randint(0, nb * bs, (b, s_q, topk), generator=g, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1                          # -1 anywhere masks one slot
    idx[0, 1] = -1                                                              # a query with no key
    lengths = torch.tensor([topk // 3, topk], dtype=torch.int32) if with_len else None
    _poison(cache, idx, True)
    q = (torch.randn(b, s_q, h, d, generator=g) * 0.5).to(BF16)
    meta, _ = flashmla.get_mla_metadata()
    out, lse = flashmla.flash_mla_with_kvcache(q, cache, None, None, dv, meta, is_fp8_kvcache=True, indices=idx,
                                               topk_length=lengths)
    assert out.shape == (b, s_q, h, dv) and lse.shape == (b, h, s_q) and out.dtype == BF16
    valid = idx >= 0
    if lengths is not None:
        valid &= torch.arange(topk)[None, None] < lengths[:, None, None]
    keys = _flat_keys(cache, idx, True)
    want, want_lse, _ = _ref_attention(q.reshape(b * s_q, h, d), keys.reshape(b * s_q, topk, d),
                                       valid.reshape(b * s_q, topk), d ** -0.5, dv, None)
    _check(out, lse, want.view(b, s_q, h, dv), want_lse.view(b, s_q, h).transpose(1, 2))
    assert bool((lse[0, :, 1] == float("inf")).all()) and bool((out[0, 1] == 0).all())
    gold, gold_lse = _dsattn_golden(q, F.dequantize_cache(cache), idx, valid, d ** -0.5, dv, None)
    assert testing.compare(out, gold)                  # bf16 across rounding points: the cross-order rule
    assert testing.flashmla_lse_close(lse, gold_lse)
    # the meta is reusable for the same shapes, and refuses others
    flashmla.flash_mla_with_kvcache(q, cache, None, None, dv, meta, is_fp8_kvcache=True, indices=idx,
                                    topk_length=lengths)
    with pytest.raises(ValueError, match="^tile_scheduler_metadata:"):
        flashmla.flash_mla_with_kvcache(q[:, :1], cache, None, None, dv, meta, is_fp8_kvcache=True,
                                        indices=idx[:, :1], topk_length=lengths)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-V4"])
def test_v4_decode_window_plus_extra_topk_with_sinks(fp8):
    g = torch.Generator().manual_seed(_seed())
    b, s_q, h, d, bs = 3, 1, 16, 512, 16
    win, topk = 128, 96
    cache, _ = _pool(40, bs, d, BF16, g, F.V4 if fp8 else None)
    extra, _ = _pool(12, 64, d, BF16, g, F.V4 if fp8 else None)
    idx = torch.randint(0, 40 * bs, (b, s_q, win), generator=g, dtype=torch.int32)
    eidx = torch.randint(0, 12 * 64, (b, s_q, topk), generator=g, dtype=torch.int32)
    idx[1, :, 100:] = -1
    eidx[2, :, ::3] = -1
    lengths = torch.tensor([win, 50, 0], dtype=torch.int32)
    elengths = torch.tensor([topk, 0, 70], dtype=torch.int32)
    sink = torch.randn(h, generator=g)
    sink[0], sink[1] = float("inf"), float("-inf")
    if not fp8:
        _poison(cache, torch.where(torch.arange(win)[None, None] < lengths[:, None, None], idx, -1), False)
    q = (torch.randn(b, s_q, h, d, generator=g) * 0.5).to(BF16)
    meta, _ = flashmla.get_mla_metadata()
    out, lse = flashmla.flash_mla_with_kvcache(q, cache, None, None, d, meta, is_fp8_kvcache=fp8, indices=idx,
                                               attn_sink=sink, extra_k_cache=extra, extra_indices_in_kvcache=eidx,
                                               topk_length=lengths, extra_topk_length=elengths)
    valid = torch.cat([(idx >= 0) & (torch.arange(win)[None, None] < lengths[:, None, None]),
                       (eidx >= 0) & (torch.arange(topk)[None, None] < elengths[:, None, None])], -1)
    keys = torch.cat([_flat_keys(cache, idx, fp8), _flat_keys(extra, eidx, fp8)], 2)
    keys = torch.nan_to_num(keys) if not fp8 else keys
    want, want_lse, _ = _ref_attention(q.reshape(b, h, d), keys.reshape(b, -1, d), valid.reshape(b, -1),
                                       d ** -0.5, d, sink)
    _check(out, lse, want.view(b, s_q, h, d), want_lse.view(b, s_q, h).transpose(1, 2))
    assert bool((out[:, :, 0] == 0).all())                                      # +inf sink: output 0


@pytest.mark.parametrize("d_qk", [512, 576])
@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_sparse_prefill(d_qk, dtype):
    g = torch.Generator().manual_seed(_seed())
    s_q, s_kv, h, topk = 37, 300, 8, 64
    # FlashMLA's magnitudes (its test draws q and kv as randn / 10): its bounds hold for its kernels'
    # bf16 P there, and so for dsattn's (larger values are covered against dsattn's golden elsewhere)
    q = (torch.randn(s_q, h, d_qk, generator=g) / 10).to(dtype)
    kv = (torch.randn(s_kv, 1, d_qk, generator=g) / 10).to(dtype)
    idx = torch.randint(0, s_kv + 20, (s_q, 1, topk), generator=g, dtype=torch.int32)   # some >= s_kv: invalid
    idx[torch.rand(idx.shape, generator=g) < 0.1] = -1
    idx[3] = -1                                                                 # no valid index
    length = torch.randint(0, topk + 1, (s_q,), generator=g, dtype=torch.int32)
    sink = torch.randn(h, generator=g)
    valid = (idx[:, 0] >= 0) & (idx[:, 0] < s_kv) & (torch.arange(topk)[None] < length[:, None])
    read = torch.zeros(s_kv, dtype=torch.bool)
    read[idx[:, 0][valid].long()] = True
    kv[~read] = float("nan")
    out, mx, lse = flashmla.flash_mla_sparse_fwd(q, kv, idx, d_qk ** -0.5, d_v=512, attn_sink=sink, topk_length=length)
    assert out.shape == (s_q, h, 512) and mx.shape == lse.shape == (s_q, h) and out.dtype == dtype
    safe = torch.where(valid, idx[:, 0], torch.zeros_like(idx[:, 0])).long()
    keys = torch.where(valid[..., None], kv[safe, 0].double(), torch.zeros((), dtype=torch.float64))
    want, want_lse, want_mx = _ref_attention(q, keys, valid, d_qk ** -0.5, 512, sink)
    _check(out, lse, want, want_lse, prefill=True)
    assert testing.flashmla_lse_close(mx, want_mx)
    assert bool((lse[3] == float("inf")).all()) and bool((mx[3] == float("-inf")).all()) and bool((out[3] == 0).all())


@pytest.mark.parametrize("causal", [False, True])
def test_dense_decode_matches_the_dsattn_golden(causal):
    g = torch.Generator().manual_seed(_seed())
    b, s_q, h, d, dv, bs = 3, 2, 4, 576, 512, 16
    cache = torch.randn(12, bs, 1, d, generator=g).to(BF16)
    table = torch.randperm(12, generator=g)[:9].view(3, 3).to(torch.int32)
    seqlens = torch.tensor([40, 1, 0], dtype=torch.int32)
    q = torch.randn(b, s_q, h, d, generator=g).to(BF16)
    meta, _ = flashmla.get_mla_metadata(seqlens, s_q, 1)
    out, lse = flashmla.flash_mla_with_kvcache(q, cache, table, seqlens, dv, meta, causal=causal)
    gold, gold_lse = reference.sparse_flash_mla(q, ori_kv=cache, ori_block_table=table, seqused_ori_kv=seqlens,
                                                softmax_scale=d ** -0.5, ori_mask_mode=3 if causal else 0,
                                                layout_kv="PA_BBND", return_softmax_lse=True)
    assert testing.flashmla_close(out, gold[..., :dv], abs_tol=1e-3, rel_tol=2.01 / 128, max_cos_diff=None)
    n = seqlens[:, None] - (s_q - 1 - torch.arange(s_q))[None] if causal else seqlens[:, None].expand(b, s_q)
    want_lse = torch.where((n > 0)[..., None], gold_lse[:, 0], torch.tensor(float("inf")))
    assert testing.flashmla_lse_close(lse, want_lse.transpose(1, 2))
    # the FP8 V3.2 cache takes the same call (tokens dequantised as they are read)
    fp8 = F.quantize_cache(cache, F.V32)
    out8, lse8 = flashmla.flash_mla_with_kvcache(q, fp8, table, seqlens, dv, flashmla.get_mla_metadata()[0],
                                                 causal=causal, is_fp8_kvcache=True)
    gold8, gold8_lse = reference.sparse_flash_mla(q, ori_kv=F.dequantize_cache(fp8), ori_block_table=table,
                                                  seqused_ori_kv=seqlens, softmax_scale=d ** -0.5,
                                                  ori_mask_mode=3 if causal else 0, layout_kv="PA_BBND",
                                                  return_softmax_lse=True)
    assert testing.compare(out8, gold8[..., :dv])              # the same rounding points, another key order
    lse8_want = torch.where((n > 0)[..., None], gold8_lse[:, 0], torch.tensor(float("inf"))).transpose(1, 2)
    assert testing.flashmla_lse_close(lse8, lse8_want)


def test_api_errors():
    q = torch.randn(1, 1, 2, 576).to(BF16)
    cache = torch.randn(2, 4, 1, 576).to(BF16)
    idx = torch.zeros(1, 1, 3, dtype=torch.int32)
    meta = lambda: flashmla.get_mla_metadata()[0]  # noqa: E731
    call = flashmla.flash_mla_with_kvcache
    with pytest.raises(ValueError, match="^indices: value 8"):
        call(q, cache, None, None, 512, meta(), indices=idx + 8)
    with pytest.raises(ValueError, match="^num_splits:"):
        call(q, cache, None, None, 512, meta(), num_splits=torch.zeros(1), indices=idx)
    with pytest.raises(TypeError, match="^tile_scheduler_metadata:"):
        call(q, cache, None, None, 512, None, indices=idx)
    with pytest.raises(ValueError, match="^attn_sink:"):
        call(q, cache, torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 512, meta(),
             attn_sink=torch.zeros(2))
    with pytest.raises(ValueError, match="^causal:"):
        call(q, cache, None, None, 512, meta(), causal=True, indices=idx)
    with pytest.raises(ValueError, match="^head_dim_v:"):
        call(q, cache, None, None, 600, meta(), indices=idx)
    with pytest.raises(ValueError, match="^k_cache: 576 bytes"):
        call(q, cache.view(torch.int16).view(torch.uint8)[..., :576], None, None, 512, meta(), indices=idx,
             is_fp8_kvcache=True)
    with pytest.raises(ValueError, match="^topk_length:"):
        call(q, cache, None, None, 512, meta(), indices=idx, topk_length=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="^indices:"):
        flashmla.flash_mla_sparse_fwd(q[0], cache[0], idx.view(1, 3, 1), 0.1)        # [s_q, 1, topk] expected
    with pytest.raises(ValueError, match="^kv:"):
        flashmla.flash_mla_sparse_fwd(q[0], cache[0, :, 0], idx[0][:, None].expand(1, 1, 3), 0.1)


def test_fp8_cache_descriptors_follow_the_tensor_object():
    # the packed-token descriptor of an FP8 cache is kept per tensor object: a freed cache drops it, and
    # a cache passed with other strides (a view of other blocks) gets its own
    import gc

    from dsattn import flashmla as fm
    from dsattn.quant import flashmla as F
    kv = torch.randn(4, 64, 1, 512, dtype=torch.bfloat16)
    cache = F.quantize_cache(kv, F.V4)
    first = fm._packed_tokens(cache, "k_cache")
    assert fm._packed_tokens(cache, "k_cache") is first
    part = cache[1:3]
    assert fm._packed_tokens(part, "k_cache") is not first
    key = id(cache)
    del cache, part, first
    gc.collect()
    assert key not in fm._TOKENS


INF = float("inf")


def _decode_both_ways(monkeypatch, fmt, g):
    """One sparse decode call (main + extra cache, topk_length with a 0, sinks with +-inf, -1 slots, a
    query without any key) through the compiled step and through the Python path."""
    b, s_q, h, bs = 3, 2, 8, 16
    d = 576 if fmt == "V3.2" else 512
    layout = {"V3.2": F.V32, "V4": F.V4}.get(fmt)
    dtype = torch.float32 if fmt == "fp32" else BF16
    cache, _ = _pool(30, bs, d, dtype, g, layout)
    extra, _ = _pool(8, 64, d, dtype, g, layout)
    idx = torch.randint(0, 30 * bs, (b, s_q, 64), generator=g, dtype=torch.int32)
    eidx = torch.randint(0, 8 * 64, (b, s_q, 48), generator=g, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    idx[1, 0], eidx[1, 0] = -1, -1                                             # a query without a key
    sink = torch.randn(h, generator=g)
    sink[0], sink[1] = INF, -INF
    q = (torch.randn(b, s_q, h, d, generator=g) * 0.5).to(dtype)
    kw = dict(is_fp8_kvcache=layout is not None, indices=idx, attn_sink=sink, extra_k_cache=extra,
              extra_indices_in_kvcache=eidx, topk_length=torch.tensor([64, 30, 0], dtype=torch.int32),
              extra_topk_length=torch.tensor([48, 0, 20], dtype=torch.int32))
    meta, _ = flashmla.get_mla_metadata()
    step = flashmla.flash_mla_with_kvcache(q, cache, None, None, 512, meta, **kw)
    with monkeypatch.context() as m:
        m.setattr(flashmla, "_compiled_decode", lambda *a: None)
        python = flashmla.flash_mla_with_kvcache(q, cache, None, None, 512, meta, **kw)
    return step, python, (q, cache, meta, kw)


@pytest.mark.parametrize("fmt", ["bf16", "fp32", "V4", "V3.2"])
def test_compiled_decode_step_gives_the_python_paths_bits(fmt, monkeypatch):
    """flash_mla_with_kvcache's one-step compiled decode (dsattn/native/flashmla.cpp) and the Python path
    (checks, tables, attend_rows) give the same bits: outputs, LSE (+inf for a query without a key)."""
    from dsattn import native
    if native.kernels() is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    taken = []
    real = native.kernels().flashmla_sparse
    monkeypatch.setattr(native.kernels(), "flashmla_sparse", lambda *a: taken.append(real(*a)) or taken[-1])
    (out, lse), (want, want_lse), _ = _decode_both_ways(monkeypatch, fmt, torch.Generator().manual_seed(_seed()))
    assert taken == [True]
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)) and torch.equal(lse, want_lse)
    assert bool((lse[1, :, 0] == INF).all())


@pytest.mark.parametrize("what", ["index past the pool", "index -2", "negative length"])
def test_compiled_decode_step_declines_bad_lists(what, monkeypatch):
    """A list value the checks refuse: the step declines (nothing written) and the Python path raises."""
    from dsattn import native
    if native.kernels() is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    _, _, (q, cache, meta, kw) = _decode_both_ways(monkeypatch, "V4", torch.Generator().manual_seed(_seed()))
    kw = dict(kw)
    if what.startswith("index"):
        kw["indices"] = kw["indices"].clone()
        kw["indices"][0, 0, 3] = 10**6 if what == "index past the pool" else -2
        name = "indices"
    else:
        kw["topk_length"] = torch.tensor([64, -1, 0], dtype=torch.int32)
        name = "topk_length"
    taken = []
    real = native.kernels().flashmla_sparse
    monkeypatch.setattr(native.kernels(), "flashmla_sparse", lambda *a: taken.append(real(*a)) or taken[-1])
    with pytest.raises(ValueError, match=f"^{name}:"):
        flashmla.flash_mla_with_kvcache(q, cache, None, None, 512, meta, **kw)
    assert taken in ([False], [])
