"""dsattn.sparse_mla.rows: query rows over the key rows they list (FlashMLA's API runs on it), each
implementation (compiled CPU kernel, Triton under the interpreter, PyTorch) against float64 math:
several sources (a flat one, a strided paged one), -1 at any slot, a row without a key, sinks of
+inf / -inf / finite, the LSE with or without the sink, the row maxima.  Rows no list reads are NaN."""
import pytest
import torch

from dsattn import native, testing
from dsattn.sparse_mla import rows

INF = float("inf")


def math_reference(q, sources, tables, scale, sinks, sink_in_lse):
    """float64: out (with the sink), lse (with or without it; 0 without a key), max (-inf without)."""
    keys, valid = [], []
    for src, t in zip(sources, tables):
        flat = src.reshape(-1, src.size(-1)).double()
        keys.append(flat[t.clamp(min=0)])
        valid.append(t >= 0)
    k, v = torch.cat(keys, 1), torch.cat(valid, 1)
    k = torch.where(v[..., None], k, torch.zeros((), dtype=torch.float64))
    s = (scale * torch.einsum("rhd,rwd->rhw", q.double(), k)).masked_fill(~v[:, None], -INF)
    lse = torch.logsumexp(s, -1)
    mx = s.amax(-1)
    total = lse if sinks is None else torch.logaddexp(lse, sinks.double())
    p = torch.exp(s - torch.where(torch.isfinite(total), total, torch.full_like(total, INF))[..., None])
    out = torch.einsum("rhw,rwd->rhd", p, k)
    has = v.any(1)[:, None]
    out = torch.where(has[..., None], out, torch.zeros((), dtype=torch.float64))
    lse = torch.where(has, total if sink_in_lse else lse, torch.zeros((), dtype=torch.float64))
    return out, lse, mx


def make_call(g, dtype):
    R, H, D = 7, 5, 40
    q = (torch.randn(R, H, D, generator=g) / 3).to(dtype)
    flat = (torch.randn(30, D, generator=g) / 3).to(dtype)
    wide = (torch.randn(4, 9, 1, D + 8, generator=g) / 3).to(dtype)
    paged = wide[:, 1:7, :, :D]                                  # [4, 6, 1, D], rows not one after another
    t1 = torch.randint(0, 30, (R, 12), generator=g)
    t2 = torch.randint(0, 24, (R, 5), generator=g)
    t1[torch.rand(t1.shape, generator=g) < 0.3] = -1              # -1 at any slot
    t2[torch.rand(t2.shape, generator=g) < 0.3] = -1
    t1[3], t2[3] = -1, -1                                         # a row without a key
    for src, t in ((flat, t1), (paged, t2)):                      # rows no list reads: NaN
        unread = torch.ones(src.numel() // D, dtype=torch.bool)
        unread[t[t >= 0]] = False
        view = src.reshape(-1, D) if src.is_contiguous() else None
        if view is not None:
            view[unread] = float("nan")
        else:
            idx = unread.nonzero()[:, 0]
            src[idx // 6, idx % 6] = float("nan")
    sinks = torch.tensor([INF, -INF, 0.7, -0.3, 2.0])
    return q, [flat, paged], [t1, t2], sinks


IMPLS = {"compiled": rows.Compiled, "triton": rows.Triton, "torch": rows.Torch}


@pytest.mark.parametrize("sink_in_lse", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_rows_against_math(impl, dtype, sink_in_lse, gen, monkeypatch):
    if impl == "compiled" and native.kernels() is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    if impl == "triton":
        monkeypatch.setenv("DSATTN_BACKEND", "triton")
    q, sources, tables, sinks = make_call(gen, dtype)
    assert not IMPLS[impl].reasons(q, sources, False), IMPLS[impl].reasons(q, sources, False)
    monkeypatch.setattr(rows, "choose", lambda *_: IMPLS[impl])
    out, lse, mx, _ = rows.attend_rows(q, sources, tables, scale=0.3, sinks=sinks, sink_in_lse=sink_in_lse,
                                    want_max=True)
    want, want_lse, want_mx = math_reference(q, sources, tables, 0.3, sinks, sink_in_lse)
    assert out.dtype == dtype and not out.isnan().any() and not lse.isnan().any()
    if dtype == torch.float32:
        assert testing.fp32_math_close(out, want)
    else:              # P rounded to the query dtype before P·V: FlashMLA's decode bound
        assert testing.flashmla_close(out, want.to(dtype).double(), abs_tol=1e-3, rel_tol=2.01 / 128, max_cos_diff=None)
    assert testing.fp32_math_close(lse, want_lse) and testing.nonfinite_match(lse, want_lse)
    assert testing.fp32_math_close(mx, want_mx) and testing.nonfinite_match(mx, want_mx)
    assert torch.equal(out[3], torch.zeros_like(out[3])) and bool((mx[3] == -INF).all())
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))                       # the +inf sink


def test_dispatch_order_and_reasons():
    q = torch.randn(2, 3, 8, dtype=torch.float64)
    names = [n for n, why in rows.explain(q, [torch.randn(4, 8, dtype=torch.float64)]) if not why]
    assert names == ["torch"]                                                 # float64: only the PyTorch path
    q = torch.randn(2, 3, 8).bfloat16()
    expected = "compiled" if native.kernels() is not None else "torch"
    assert rows.choose(q, [torch.randn(4, 8).bfloat16()]).name == expected
    from dsattn import which
    line = [x for x in which.describe().splitlines() if x.startswith("FlashMLA's API")]
    assert line and line[0].split(": ", 1)[1].startswith(expected)               # dsattn bench --which
    out, lse, mx, _ = rows.attend_rows(q[:0], [torch.randn(4, 8).bfloat16()], [torch.zeros(0, 2, dtype=torch.int64)],
                                    scale=1.0)
    assert out.shape == (0, 3, 8) and lse.shape == (0, 3) and mx is None


def packed_source(fmt: str, g, D: int):
    """(packed tokens, their decoded keys [tokens, D] bf16 (the golden's decode), poison(unread))."""
    from dsattn.quant import dequant_kv_rows, quantize_kv_rows
    from dsattn.quant import flashmla as F
    from dsattn.quant.tokens import PackedTokens
    k = (torch.randn(6, 5, 1, D, generator=g) / 3).bfloat16()
    if fmt.startswith("rows"):
        payload = torch.int8 if fmt == "rows-int8" else torch.float8_e4m3fn
        packed = quantize_kv_rows(k.view(30, D), 64, payload, 64)
        decoded = dequant_kv_rows(packed, 64, torch.bfloat16, torch.bfloat16, 64)[0]
        N = D - 64

        def poison(unread):
            u8 = packed.view(torch.uint8)
            u8[unread, N + 128:] = 0xFF                              # its fp32 scales: NaN
            if payload != torch.int8:
                u8[unread, :N] = 0xFF                                 # its fp8 payload: NaN
        return PackedTokens.from_rows(packed, 64, 64, torch.bfloat16), decoded, poison
    layout = F.V32 if fmt == "V3.2" else F.V4
    cache = F.quantize_cache(k, layout)
    decoded = F.dequantize_cache(cache).view(30, D)

    def poison(unread):
        u8 = cache.view(torch.uint8)
        if layout is F.V32:
            u8.view(30, -1)[unread] = 0xFF
        else:
            body = u8.reshape(6, -1)[:, :5 * 576].reshape(30, 576)
            body[unread, :448] = 0xFF
    return PackedTokens.from_flashmla(cache), decoded, poison


@pytest.mark.parametrize("fmt", ["rows-int8", "rows-fp8", "V3.2", "V4"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_packed_tokens_decoded_as_read(impl, fmt, gen, monkeypatch):
    """Packed tokens (dsattn's packed rows, FlashMLA's V3.2 and V4 layouts) beside a plain source: the
    kernels decode the listed tokens as the golden does (payload x tile scale in fp32, rounded once
    to the query dtype); unread tokens hold NaN bytes."""
    if impl == "compiled" and native.kernels() is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    if impl == "triton":
        monkeypatch.setenv("DSATTN_BACKEND", "triton")
    D = 576 if fmt == "V3.2" else 512
    src, decoded, poison = packed_source(fmt, gen, D)
    R, H = 5, 4
    q = (torch.randn(R, H, D, generator=gen) / 3).bfloat16()
    plain = (torch.randn(9, D, generator=gen) / 3).bfloat16()
    t1 = torch.randint(0, 30, (R, 10), generator=gen)
    t1[torch.rand(t1.shape, generator=gen) < 0.3] = -1
    t1[2] = -1
    t2 = torch.randint(0, 9, (R, 3), generator=gen)
    unread = torch.ones(30, dtype=torch.bool)
    unread[t1[t1 >= 0]] = False
    poison(unread)
    sinks = torch.tensor([INF, -INF, 0.7, -0.3])
    monkeypatch.setattr(rows, "choose", lambda *_: IMPLS[impl])
    out, lse, mx, _ = rows.attend_rows(q, [src, plain], [t1, t2], scale=0.1, sinks=sinks, sink_in_lse=False,
                                    want_max=True)
    want, want_lse, want_mx = math_reference(q, [decoded, plain], [t1, t2], 0.1, sinks, False)
    assert not out.isnan().any()
    # P is rounded to bf16 before P.V (the golden's rounding point) and the math reference is exact: an
    # output may differ by up to 2^-9 of sum_j p_j |v_j| / l <= 2^-9 max |v| (beside its own rounding),
    # which cancelling terms make several of its ulps
    read = torch.cat([decoded[t1[t1 >= 0]].float(), plain.float()])
    assert testing.flashmla_close(out, want.to(torch.bfloat16).double(), abs_tol=2.0**-8 * float(read.abs().max()),
                                  rel_tol=2.01 / 128, max_cos_diff=None)
    assert testing.fp32_math_close(lse, want_lse) and testing.fp32_math_close(mx, want_mx)
    # decoding as read gives the very keys the golden decodes: bit-identical to the same kernel over them
    same, same_lse, _, _ = rows.attend_rows(q, [decoded, plain], [t1, t2], scale=0.1, sinks=sinks, sink_in_lse=False)
    assert torch.equal(out, same) and torch.equal(lse, same_lse)


def test_packed_tokens_reject_a_short_buffer():
    """The compiled kernel never reads past a packed source: a format whose last token would end
    past the bytes is refused."""
    if native.kernels() is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    from dsattn.quant import quantize_kv_rows
    from dsattn.quant.tokens import PackedTokens
    import dataclasses
    packed = quantize_kv_rows(torch.randn(4, 512).bfloat16(), 64, torch.int8, 64)
    src = PackedTokens.from_rows(packed, 64, 64, torch.bfloat16)
    bad = dataclasses.replace(src, tokens=5)
    q = torch.randn(1, 2, 512).bfloat16()
    with pytest.raises(RuntimeError, match="reaches past"):
        rows.Compiled.run(q, [bad], [torch.zeros(1, 1, dtype=torch.int64)], None, 1.0, True,
                          torch.empty(1, 2, 512, dtype=torch.bfloat16), torch.empty(1, 2), None)


def test_fp8_decode_of_every_code():
    """The compiled decode of all 256 fp8 e4m3fn codes, by every version this CPU runs (scalar, AVX2,
    AVX-512), equals c10's conversion (NaN codes NaN, signed zeros kept)."""
    module = native.kernels()
    if module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    assert module.fp8_decode_matches()


@pytest.mark.parametrize("payload", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_packed_operator_decodes_in_the_kernel(payload, monkeypatch):
    """sparse_attn_sharedkv_packed hands its packed caches to the compiled kernel as they are (no
    dequantised copy of the gathered rows): the kernel receives byte sources and their formats."""
    module = native.kernels()
    if module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    from dsattn import cases, ops, reference
    seen = []
    real, real_step = module.sparse_attention_forward, module.sharedkv_paged

    def spy(*args, **kwargs):
        seen.append((kwargs.get("formats"), {s.dtype for s in args[1]}))
        return real(*args, **kwargs)

    def spy_step(*args):                       # the one-step path: the caches as they lie, their formats
        taken = real_step(*args)
        if taken:
            seen.append((args[-1], {args[2].dtype, args[3].dtype}))
        return taken
    monkeypatch.setattr(module, "sparse_attention_forward", spy)
    monkeypatch.setattr(module, "sharedkv_paged", spy_step)
    for layout_kv in ("PA_ND", "TND"):              # the one-step path, then the Python path
        seen.clear()
        c = cases.packed_sharedkv_case("TND", 4, torch.bfloat16, payload=payload, paged=layout_kv == "PA_ND",
                                       seed=int(torch.randint(0, 2**31 - 1, ())))
        out, _ = ops.sparse_attn_sharedkv_packed(c.q, **c.kwargs)
        want, _ = reference.sparse_attn_sharedkv_packed(c.q, **c.kwargs)
        dtypes = {torch.uint8} if layout_kv == "TND" else {c.kwargs["ori_kv"].dtype}
        assert seen and all(f and all(len(x) == 14 for x in f) and d == dtypes for f, d in seen), seen
        assert testing.compare(out, want)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_softmax_statistics(impl, gen, monkeypatch):
    """want_stats: each row's softmax shift m = max(scores, finite sinks) (0 where nothing is finite)
    and denominator l (sink included: +inf for a +inf sink), 0 and 0 for a row without a key; the
    outputs equal the call without statistics."""
    if impl == "compiled" and native.kernels() is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    if impl == "triton":
        monkeypatch.setenv("DSATTN_BACKEND", "triton")
    q, sources, tables, sinks = make_call(gen, torch.bfloat16)
    monkeypatch.setattr(rows, "choose", lambda *_: IMPLS[impl])
    out, lse, _, st = rows.attend_rows(q, sources, tables, scale=0.3, sinks=sinks, want_stats=True)
    plain, plain_lse, _, none = rows.attend_rows(q, sources, tables, scale=0.3, sinks=sinks)
    assert none is None and st.shape == (2, q.size(0), q.size(1))
    assert testing.compare(out, plain) and testing.fp32_math_close(lse, plain_lse)
    _, _, mx = math_reference(q, sources, tables, 0.3, sinks, True)
    finite = torch.where(torch.isfinite(sinks), sinks, torch.full_like(sinks, -INF)).double()
    m = torch.maximum(mx, finite[None])
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    has = torch.cat([t >= 0 for t in tables], 1).any(1)[:, None]
    want_m = torch.where(has, m, torch.zeros_like(m))
    assert testing.fp32_math_close(st[0], want_m)
    want_l = torch.where(has, torch.exp(plain_lse.double() - m), torch.zeros_like(m))   # lse = m + log l
    want_l[:, 0] = torch.where(has[:, 0], INF, 0.0)                                     # the +inf sink
    assert testing.nonfinite_match(st[1], want_l) and testing.fp32_math_close(st[1], want_l)


def test_attend_rows_errors():
    q = torch.randn(2, 3, 8).bfloat16()
    src = torch.randn(5, 8).bfloat16()
    idx = torch.zeros(2, 4, dtype=torch.int64)
    call = rows.attend_rows
    with pytest.raises(ValueError, match="^q: expected a \\[R, H, D\\]"):
        call(q[0], [src], [idx], scale=1.0)
    with pytest.raises(ValueError, match="^index: expected one table per source"):
        call(q, [src, src], [idx], scale=1.0)
    with pytest.raises(ValueError, match="^sources: source 0 holds keys of width 9"):
        call(q, [torch.randn(5, 9).bfloat16()], [idx], scale=1.0)
    with pytest.raises(TypeError, match="^index: table 0 must be an int64"):
        call(q, [src], [idx.int()], scale=1.0)
    with pytest.raises(ValueError, match="^index: table 0 must be an int64 \\[R=2, W\\]"):
        call(q, [src], [idx[:1]], scale=1.0)
    with pytest.raises(ValueError, match="^sinks: expected a float32 tensor of shape \\[H=3\\]"):
        call(q, [src], [idx], scale=1.0, sinks=torch.zeros(4))
    with pytest.raises(ValueError, match="^want_stats:"):
        call(q, [src], [idx], scale=1.0, want_stats=True, want_max=True)
