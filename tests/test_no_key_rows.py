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
