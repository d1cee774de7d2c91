"""Backward: gradcheck of the façade, the gradient operator against autograd through the golden
forward, and the summaries (dsinks, cmp_softmax_l1_norm) against direct formulas."""
import pytest
import torch
from conftest import i32, randn

import dsattn
from dsattn import cases, ops, reference


@pytest.mark.parametrize("scenario", ["SWA", "CSA", "HCA"])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_facade_gradcheck_float64(gen, scenario, layout):
    H, D, S = 2, 8, 11
    q = randn(gen, 1, S, H, D, dtype=torch.float64).requires_grad_()
    ori = randn(gen, 1, S, 1, D, dtype=torch.float64).requires_grad_()
    sinks = randn(gen, H, dtype=torch.float64).requires_grad_()
    kw = dict(softmax_scale=0.4, ori_win_left=3, layout=layout)
    cmp = None
    if scenario != "SWA":
        r = 4 if scenario == "CSA" else 2                     # small ratio keeps the shapes tiny
        cmp = randn(gen, 1, S // r, 1, D, dtype=torch.float64).requires_grad_()
        kw.update(cmp_ratio=r, cmp_residual_kv=i32(S % r))
        if scenario == "CSA":
            kw["cmp_sparse_indices"] = torch.tensor([[1, 0, -1], [0, 2, 1]], dtype=torch.int32)[
                torch.arange(S) % 2].reshape(1, S, 1, 3)
    if layout == "TND":
        kw.update(cu_seq_lens_q=i32(0, S), cu_seq_lens_ori_kv=i32(0, S))
        if cmp is not None:
            kw["cu_seq_lens_cmp_kv"] = i32(0, cmp.size(1))
            if "cmp_sparse_indices" in kw:
                kw["cmp_sparse_indices"] = kw["cmp_sparse_indices"][0]

    def f(q, ori, sinks, *rest):
        c = rest[0] if rest else None
        if layout == "TND":
            q, ori, c = q[0], ori[0], (c[0] if c is not None else None)
        return dsattn.npu_sparse_flash_mla(q, ori_kv=ori, cmp_kv=c, sinks=sinks, **kw)[0]

    inputs = (q, ori, sinks) + ((cmp,) if cmp is not None else ())
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("ratio", [1, 4, 128])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_grad_matches_autograd_through_golden(layout, ratio):
    """20 §3.7: float32 inputs; dq, dori_kv, dcmp_kv, dsinks within rtol 1e-4, atol 1e-5."""
    c = cases.mla_case(layout, ratio, torch.float32, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    kw = dict(c.kwargs)
    q = torch.nan_to_num(c.q, nan=0.0).requires_grad_()
    ori = torch.nan_to_num(kw.pop("ori_kv"), nan=0.0).requires_grad_()
    cmp = kw.pop("cmp_kv", None)
    cmp = torch.nan_to_num(cmp, nan=0.0).requires_grad_() if cmp is not None else None
    sinks = kw.pop("sinks").clone().requires_grad_()
    o, lse = reference.sparse_flash_mla(q, ori_kv=ori, cmp_kv=cmp, sinks=sinks, return_softmax_lse=True, **kw)
    dout = torch.nan_to_num(c.extra["dout"], nan=0.0)
    wrt = [q, ori, sinks] + ([cmp] if cmp is not None else [])
    auto = torch.autograd.grad(o, wrt, dout)
    g = ops.sparse_flash_mla_grad(q.detach(), dout, o.detach(), lse.detach(), ori_kv=ori.detach(),
                                  cmp_kv=None if cmp is None else cmp.detach(), sinks=sinks.detach(), **kw)
    got = [g[0], g[1], g[3]] + ([g[2]] if cmp is not None else [])
    for a, e in zip(got, auto):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_summaries_against_direct_formulas(gen):
    """dsinks = -sum_rows p_sink (dO . O); cmp_softmax_l1_norm = head-mean of P at the slots."""
    H, D, S = 4, 16, 24
    q, ori, cmp = randn(gen, 1, S, H, D), randn(gen, 1, S, 1, D), randn(gen, 1, S // 4, 1, D)
    sinks, dout = randn(gen, H), randn(gen, 1, S, H, D)
    idx = torch.randint(-1, S // 4, (1, S, 1, 5), generator=gen, dtype=torch.int32)
    kw = dict(ori_kv=ori, cmp_kv=cmp, cmp_sparse_indices=idx, sinks=sinks, cmp_ratio=4, softmax_scale=0.25,
              ori_win_left=5, cmp_residual_kv=i32(0))
    o, lse = ops.sparse_flash_mla(q, return_softmax_lse=True, **kw)
    g = ops.sparse_flash_mla_grad(q, dout, o, lse, **kw)
    p_sink = torch.exp(sinks[None, :] - lse[0, 0])                      # [S, H]
    nonempty = (lse[0, 0] != 0).any(-1)
    want = -(p_sink * (dout[0] * o[0]).sum(-1))[nonempty].sum(0)
    torch.testing.assert_close(g[3], want, rtol=1e-4, atol=1e-5)
    # P at each kept slot from the definition: exp(scale * q.k_j - lse), averaged over heads
    for t in range(S):
        seen_end = False
        for s in range(5):
            j = int(idx[0, t, 0, s])
            thr = min((t + 1) // 4, S // 4)
            if j < 0:
                seen_end = True
            if seen_end or j >= thr or s >= thr:
                assert g[5][0, t, 0, s] == 0
                continue
            p = torch.exp(0.25 * (q[0, t] @ cmp[0, j, 0]) - lse[0, 0, t]).mean()
            torch.testing.assert_close(g[5][0, t, 0, s], p, rtol=1e-5, atol=1e-7)


def test_facade_autograd_equals_grad_op(gen):
    c = cases.mla_case("BSND", 4, torch.float16, seed=gen.initial_seed())
    kw = dict(c.kwargs)
    ori = torch.nan_to_num(kw.pop("ori_kv")).requires_grad_()
    cmp = torch.nan_to_num(kw.pop("cmp_kv")).requires_grad_()
    sinks = kw.pop("sinks").clone().requires_grad_()
    q = torch.nan_to_num(c.q).requires_grad_()
    lay = kw.pop("layout_q")
    kw.pop("layout_kv")
    o, lse = dsattn.npu_sparse_flash_mla(q, ori_kv=ori, cmp_kv=cmp, sinks=sinks, layout=lay,
                                         return_softmax_lse=True, **kw)
    o.backward(c.extra["dout"])
    g = dsattn.npu_sparse_flash_mla_grad(q.detach(), c.extra["dout"], o.detach(), lse, ori_kv=ori.detach(),
                                         cmp_kv=cmp.detach(), sinks=sinks.detach(), layout=lay, **kw)
    for got, want in zip((q.grad, ori.grad, cmp.grad, sinks.grad), g[:4]):
        assert torch.equal(got, want)
    o2 = dsattn.npu_sparse_flash_mla(q, ori_kv=ori, cmp_kv=cmp, sinks=sinks, layout=lay, **kw)
    assert torch.equal(o2[0], o) and o2[1].dim() == 0
