"""Regressions of issue 11 / 12 item 1: keys only padding rows may see never reach valid rows,
calls in which no row has a key (forward and gradient, every op, layout and mask mode), and
infinite sinks (00 §12: ``+inf`` -> out 0, LSE ``+inf``; ``-inf`` = no sink)."""
import pytest
import torch

from dsattn import ops, reference, testing, verify
from dsattn.cases import no_key_case
from dsattn.cases.kv_quant import NAN_BYTE
from dsattn.quant.rows import quantize_kv_rows

NAN = float("nan")


def i32(*v):
    return torch.tensor(v, dtype=torch.int32)


def test_keys_seen_only_by_padding_rows_do_not_leak():
    """Issue 11 repro 1: a SWA band over 15 query rows of which 12 are valid; the keys that only
    the 3 padding rows would see are NaN."""
    q = torch.randn(1, 15, 2, 16)
    q[0, 12:] = NAN
    kv = torch.randn(1, 40, 1, 16)
    kv[0, 37:] = NAN
    kw = dict(ori_kv=kv, seqused_q=i32(12), ori_mask_mode=4, ori_win_left=3, ori_win_right=0, return_softmax_lse=True)
    out, lse = ops.sparse_flash_mla(q, **kw)
    want, want_lse = reference.sparse_flash_mla(q, compute_dtype=torch.float64, **kw)
    assert not out.isnan().any() and not lse.isnan().any()
    assert testing.fp32_math_close(out, want) and testing.fp32_math_close(lse, want_lse)
    assert torch.equal(out[0, 12:], torch.zeros_like(out[0, 12:]))
    # bit-identical valid rows with and without seqused_q (00 §11)
    full, full_lse = ops.sparse_flash_mla(torch.nan_to_num(q), **dict(kw, seqused_q=None, ori_kv=torch.nan_to_num(kv)))
    assert torch.equal(out[0, :12], full[0, :12]) and torch.equal(lse[0, :, :12], full_lse[0, :, :12])


CALLS = [(lay, paged, r, om) for lay in ("BSND", "TND") for paged in (False, True) for r in (1, 4, 128)
         for om in (0, 3, 4)]


@pytest.mark.parametrize("layout,paged,ratio,om", CALLS)
def test_no_row_has_a_key(layout, paged, ratio, om):
    """00 §9 / §12: out 0 and LSE 0 for every row, gradients 0, never an exception (issue 12 item 1);
    the same check ``dsattn verify`` runs."""
    for dtype in (torch.bfloat16, torch.float32):
        rows = verify.no_key_rows(no_key_case(layout, paged, ratio, om, dtype))
        assert rows and all(r.result.passed for r in rows), [(r.output, str(r.result)) for r in rows]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_no_row_has_a_key_sharedkv(ratio, packed):
    c = no_key_case("TND", True, ratio, 4, torch.bfloat16)
    q, kw = c.q, c.kwargs
    args = dict(ori_kv=kw["ori_kv"], ori_block_table=kw["ori_block_table"], cu_seqlens_q=kw["cu_seqlens_q"],
                seqused_kv=kw["seqused_ori_kv"], sinks=kw["sinks"], layout_q="TND", layout_kv="PA_ND")
    if ratio > 1:
        args.update(cmp_kv=kw["cmp_kv"], cmp_block_table=kw["cmp_block_table"], cmp_ratio=ratio,
                    cmp_sparse_indices=kw.get("cmp_sparse_indices"))
    if packed:
        for name in ("ori_kv", "cmp_kv"):
            if name in args:
                rows = quantize_kv_rows(torch.zeros_like(args[name]), 0, torch.int8, 8)
                args[name] = rows.view(torch.uint8).fill_(NAN_BYTE).view(torch.int8)
        out, _ = ops.sparse_attn_sharedkv_packed(q, kv_rope_dim=0, kv_tile_size=8, **args)
    else:
        out, _ = ops.sparse_attn_sharedkv(q, **args)
    assert torch.equal(out, torch.zeros_like(out))


def test_gradient_with_zero_length_keys_and_l1_outputs():
    """Issue 11 repro 3: BSND, S2o = [0], with the L1-norm outputs requested."""
    q = torch.randn(1, 6, 2, 8)
    kv = torch.randn(1, 0, 1, 8)
    osi = torch.randint(-1, 3, (1, 6, 1, 4), dtype=torch.int32)
    o, lse = ops.sparse_flash_mla(q, ori_kv=kv, ori_mask_mode=0, return_softmax_lse=True)
    dq, dkv, _, _, ori_l1, _ = ops.sparse_flash_mla_grad(q, torch.randn_like(q), o, lse, ori_kv=kv,
                                                         ori_sparse_indices=osi, ori_mask_mode=0)
    assert torch.equal(dq, torch.zeros_like(dq)) and dkv.shape == kv.shape
    assert ori_l1.shape == osi.shape and torch.equal(ori_l1, torch.zeros_like(ori_l1))


@pytest.mark.parametrize("fn", ["ops", "reference"])
def test_infinite_sinks(fn):
    """A +inf sink takes all the weight: out 0, LSE +inf; a -inf sink is no sink; gradients finite."""
    impl = ops if fn == "ops" else reference
    q = torch.randn(2, 7, 3, 16)
    kv = torch.randn(2, 20, 1, 16)
    sinks = torch.tensor([float("inf"), float("-inf"), 0.5])
    kw = dict(ori_kv=kv, sinks=sinks, ori_win_left=5, return_softmax_lse=True)
    out, lse = impl.sparse_flash_mla(q, **kw)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert bool((lse[:, 0, :, 0] == float("inf")).all())
    plain, plain_lse = impl.sparse_flash_mla(q, **dict(kw, sinks=None))
    assert testing.fp32_math_close(out[:, :, 1], plain[:, :, 1])          # -inf sink = no sink
    assert testing.fp32_math_close(lse[..., 1], plain_lse[..., 1])
    grads = impl.sparse_flash_mla_grad(q, torch.randn_like(q), out, lse, **{k: v for k, v in kw.items()
                                                                           if k != "return_softmax_lse"})
    for g in grads[:4]:
        assert torch.isfinite(g).all()
    assert torch.equal(grads[0][:, :, 0], torch.zeros_like(grads[0][:, :, 0]))  # the +inf head: no gradient


INF = float("inf")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("path", ["default", "torch", "triton"])
def test_sink_grid_on_rows_with_and_without_keys(path, dtype, gen, monkeypatch):
    """00 §9 / §12 on {row without a key, row with keys} x {+inf, -inf, finite sink}, on each forward
    path: a row without a key gets out 0, LSE 0 whatever its sink; with keys, a +inf sink gives out 0
    and LSE +inf, a -inf sink is no sink, a finite one the golden's value.  Never a NaN."""
    from dsattn.sparse_mla import fast
    if path == "torch":
        monkeypatch.setattr(fast, "native_sources", lambda P: None)
    elif path == "triton":
        monkeypatch.setenv("DSATTN_BACKEND", "triton")
    H, D = 3, 32
    q = torch.randn(12, H, D, generator=gen).to(dtype)
    kv = torch.randn(30, 1, D, generator=gen).to(dtype)
    kv[0:10] = NAN                                         # batch 0's keys: its length is 0, never read
    kv[27:] = NAN                                          # past batch 2's length
    kw = dict(ori_kv=kv, cu_seqlens_q=i32(0, 4, 9, 12), cu_seqlens_ori_kv=i32(0, 10, 20, 30),
              seqused_ori_kv=i32(0, 10, 7), softmax_scale=0.2, ori_mask_mode=4, ori_win_left=5, layout_q="TND",
              layout_kv="TND", return_softmax_lse=True)
    sinks = torch.tensor([INF, -INF, 0.5])
    out, lse = ops.sparse_flash_mla(q, sinks=sinks, **kw)
    plain, plain_lse = ops.sparse_flash_mla(q, **kw)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[:4], torch.zeros_like(out[:4])) and torch.equal(lse[0, :4], torch.zeros_like(lse[0, :4]))
    assert torch.equal(out[4:, 0], torch.zeros_like(out[4:, 0])) and bool((lse[0, 4:, 0] == INF).all())
    assert testing.compare(out[:, 1], plain[:, 1]) and testing.fp32_math_close(lse[..., 1], plain_lse[..., 1])
    want, want_lse = reference.sparse_flash_mla(q, sinks=sinks, compute_dtype=torch.float64,
                                                emulate_rounding=dtype != torch.float32, **kw)
    close = testing.fp32_math_close if dtype == torch.float32 else testing.compare
    assert close(out, want) and testing.fp32_math_close(lse, want_lse)


@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_sink_grid_through_split_kv_plans(ratio, gen):
    """sparse_attn_sharedkv whose rows are split across cores (the partials merged, the sink added once
    in the merge): the same grid, against the golden."""
    from dsattn import cases
    c = cases.sharedkv_case("TND", ratio, torch.bfloat16, paged=True, seed=int(torch.randint(0, 2**31 - 1, (),
                            generator=gen)), H=16, lengths=[(3, 1500), (0, 700), (2, 1030)], window=1200)
    sinks = torch.randn(16, generator=gen)
    sinks[0], sinks[1] = INF, -INF
    c.kwargs["sinks"] = c.extra["mla_kwargs"]["sinks"] = sinks
    want, _ = reference.sparse_flash_mla(c.q, **c.extra["mla_kwargs"])
    m = cases.sharedkv_plan(c, ratio, 24, True)
    out, _ = ops.sparse_attn_sharedkv(c.q, metadata=m, **c.kwargs)
    assert not out.isnan().any() and torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    assert testing.split_row_close(out, want)


def test_sink_grid_in_the_merge():
    """merge_attention_states: partials with and without keys under +inf / -inf / finite sinks."""
    from dsattn.serving import merge_attention_states
    o1, o2 = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    l1 = torch.tensor([[0.3, 1.0, -0.2], [0.0, 0.0, 0.0]])
    l2 = torch.tensor([[1.1, -0.5, 0.4], [0.0, 0.0, 0.0]])
    valid = [torch.tensor([[True] * 3, [False] * 3])] * 2                # row 1: no partial saw a key
    sinks = torch.tensor([INF, -INF, 0.5])
    out, lse = merge_attention_states([o1, o2], [l1, l2], sinks=sinks, valid=valid)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(lse[1], torch.zeros_like(lse[1]))
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0])) and lse[0, 0] == INF
    both = torch.logaddexp(l1[0], l2[0])
    mixed = (torch.exp(l1[0] - both)[:, None] * o1[0] + torch.exp(l2[0] - both)[:, None] * o2[0])
    assert torch.allclose(out[0, 1], mixed[1], atol=1e-6) and torch.allclose(lse[0, 1], both[1])
    total = torch.logaddexp(both[2], sinks[2])
    assert torch.allclose(out[0, 2], mixed[2] * torch.exp(both[2] - total), atol=1e-6)
    assert torch.allclose(lse[0, 2], total)


def test_sink_grid_in_kv_quant_attention():
    """kv_quant_sparse_flash_attention returns (softmax_max, softmax_sum): a +inf sink gives out 0 and
    sum +inf on rows with keys; rows without a key get 0 / 0 whatever the sink."""
    from dsattn import cases
    c = cases.qsfa_case("TND", "PA_BSND", torch.bfloat16, sinks=True, seed=int(torch.randint(0, 2**31 - 1, ())))
    c.kwargs["sinks"] = torch.tensor([INF, -INF, 0.5, 1.0])
    key, idx = c.extra["key"], c.extra["sparse_indices"]
    out, mx, sm = ops.kv_quant_sparse_flash_attention(c.q, key, key, idx, **c.kwargs)[:3]
    want, want_mx, want_sm = reference.kv_quant_sparse_flash_attention(c.q, key, key, idx, **c.kwargs)[:3]
    assert not (out.isnan().any() or mx.isnan().any() or sm.isnan().any())
    has_key = want_sm[0, :, 1] > 0                                      # head 1 (-inf sink): keys only
    assert bool(has_key.any()) and bool((~has_key).any())
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    assert bool((sm[0, has_key, 0] == INF).all()) and bool((sm[0, ~has_key] == 0).all())
    assert bool((mx[0, ~has_key] == 0).all())
    assert testing.compare(out, want) and testing.fp32_math_close(mx, want_mx) and testing.nonfinite_match(sm, want_sm)
