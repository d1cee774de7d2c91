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
    out, lse, mx = rows.attend_rows(q, sources, tables, scale=0.3, sinks=sinks, sink_in_lse=sink_in_lse,
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
    out, lse, mx = rows.attend_rows(q[:0], [torch.randn(4, 8).bfloat16()], [torch.zeros(0, 2, dtype=torch.int64)],
                                    scale=1.0)
    assert out.shape == (0, 3, 8) and lse.shape == (0, 3) and mx is None
