"""Edge cases of the attention and indexer operators (20 §2.6, 10 §1.5, 00 §11 required tests)."""
import pytest
import torch
from conftest import i32, randn

from dsattn import ops, reference, testing

H, D = 4, 16


def _both(q, **kw):
    got = ops.sparse_flash_mla(q, return_softmax_lse=True, **kw)
    want = reference.sparse_flash_mla(q, return_softmax_lse=True, **kw)
    for a, e in zip(got, want):
        assert testing.compare(a, e), testing.compare(a, e)
    return got


def test_residual_changes_compressed_bound(gen):
    """20 §1.5: S2o = 42, S2c = 10, r = 4; residual 2 vs 0 on the same tensors (dense and CSA)."""
    q = randn(gen, 1, 2, H, D)
    ori = randn(gen, 1, 42, 1, D)
    cmp = randn(gen, 1, 10, 1, D)
    base = dict(ori_kv=ori, cmp_kv=cmp, cmp_ratio=4, softmax_scale=D ** -0.5, ori_win_left=7)
    idx = torch.tensor([[[[9, 8, 0, -1]]], [[[9, 1, -1, -1]]]], dtype=torch.int32).reshape(1, 2, 1, 4)
    for extra in ({}, {"cmp_sparse_indices": idx}):
        o2, l2 = _both(q, cmp_residual_kv=i32(2), **base, **extra)
        o0, l0 = _both(q, cmp_residual_kv=i32(0), **base, **extra)
        assert not torch.equal(o2, o0) and not torch.equal(l2, l0)
        assert torch.equal(o2[:, 1], o0[:, 1])                   # row 1: pc 41 / 39 -> thr 10 both


def test_no_visible_compressed_block_and_invalid_rows(gen):
    """Rows before the first complete compressed group see window keys only; rows with p < 0
    (more queries than keys) are fully masked: output 0, LSE 0, never NaN."""
    q = randn(gen, 1, 8, H, D)
    ori = randn(gen, 1, 5, 1, D)
    cmp = randn(gen, 1, 1, 1, D)
    sinks = randn(gen, H)
    o, lse = _both(q, ori_kv=ori, cmp_kv=cmp, cmp_ratio=4, sinks=sinks, cmp_residual_kv=i32(1),
                   softmax_scale=0.25)
    assert not torch.isnan(o).any()
    assert torch.equal(o[0, :3], torch.zeros_like(o[0, :3]))    # p = -3..-1: invalid
    assert torch.equal(lse[0, 0, :3], torch.zeros_like(lse[0, 0, :3]))
    assert (lse[0, 0, 3:] != 0).all()
    window_only = ops.sparse_flash_mla(q[:, 3:6], ori_kv=ori[:, :3], sinks=sinks, softmax_scale=0.25,
                                       return_softmax_lse=True)
    torch.testing.assert_close(o[:, 3:6], window_only[0])       # p = 0..2 < r - 1: no cmp entry


def test_all_minus_one_rows_duplicates_and_future_indices(gen):
    q = randn(gen, 1, 6, H, D)
    ori = randn(gen, 1, 24, 1, D)
    cmp = randn(gen, 1, 6, 1, D)
    cmp[0, 5] = float("nan")                                    # index 5 is always beyond thr: never read
    idx = torch.tensor([[-1, 3, 3, 3], [2, 2, -1, 0], [5, 1, 5, 0], [0, 1, 2, 3], [-7, 0, 1, 2], [4, 4, 4, 4]],
                       dtype=torch.int32).reshape(1, 6, 1, 4)
    kw = dict(ori_kv=ori, cmp_kv=cmp, cmp_sparse_indices=idx, cmp_ratio=4, softmax_scale=0.3, ori_win_left=3)
    o, lse = _both(q, **kw)
    assert not torch.isnan(o).any()
    # row 0: list ends at slot 0 -> window only; row 4: a negative other than -1 ends the list too
    win = ops.sparse_flash_mla(q, ori_kv=ori, softmax_scale=0.3, ori_win_left=3, return_softmax_lse=True)
    torch.testing.assert_close(o[0, 0], win[0][0, 0])
    torch.testing.assert_close(o[0, 4], win[0][0, 4])
    # row 2: index 5 is beyond thr (= 5 at p = 20) and skipped; slots 1 and 3 count
    same = idx.clone()
    same[0, 2, 0] = torch.tensor([1, 0, -1, -1], dtype=torch.int32)
    o2 = ops.sparse_flash_mla(q, **{**kw, "cmp_sparse_indices": same})[0]
    torch.testing.assert_close(o[0, 2], o2[0, 2])


@pytest.mark.parametrize("sink", [-1e4, -30.0, 30.0, 1e4, float("-inf")])
def test_large_sinks(gen, sink):
    q = randn(gen, 1, 5, H, D, dtype=torch.float16)
    ori = randn(gen, 1, 5, 1, D, dtype=torch.float16)
    sinks = torch.full((H,), sink)
    o, lse = _both(q, ori_kv=ori, sinks=sinks, softmax_scale=0.25)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    if sink == float("-inf"):
        plain = ops.sparse_flash_mla(q, ori_kv=ori, softmax_scale=0.25, return_softmax_lse=True)
        assert torch.equal(o, plain[0]) and torch.equal(lse, plain[1])
    if sink >= 1e4:
        assert o.abs().max() == 0                               # all mass on the sink
        torch.testing.assert_close(lse, torch.full_like(lse, sink))


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_seqused_q_valid_rows_identical(gen, layout):
    """00 §11 required tests for sparse_flash_mla, its gradient, the indexer and the KL grad."""
    from dsattn import cases
    case = cases.mla_case("BSND", 4, torch.float16, seed=gen.initial_seed())
    kw = {k: v for k, v in case.kwargs.items() if k != "seqused_q"}
    q = torch.nan_to_num(case.q, nan=0.5)
    used = i32(10, 14, 7)
    full = ops.sparse_flash_mla(q, return_softmax_lse=True, **kw)
    part = ops.sparse_flash_mla(q, seqused_q=used, return_softmax_lse=True, **kw)
    g_full = ops.sparse_flash_mla_grad(q, case.extra["dout"], *full, **kw)
    g_part = ops.sparse_flash_mla_grad(q, case.extra["dout"], *part, seqused_q=used, **kw)
    for b, u in enumerate(used.tolist()):
        assert torch.equal(full[0][b, :u], part[0][b, :u])
        assert torch.equal(full[1][b, :, :u], part[1][b, :, :u])
        assert (part[0][b, u:] == 0).all() and (part[1][b, :, u:] == 0).all()
        assert torch.equal(g_full[0][b, :u], g_part[0][b, :u])
        assert torch.equal(g_full[5][b, :u], g_part[5][b, :u])
        assert (g_part[0][b, u:] == 0).all() and (g_part[5][b, u:] == 0).all()
    # padding rows add nothing to the key gradients: compare with a golden run on the valid rows only
    ref = reference.sparse_flash_mla_grad(q, case.extra["dout"], *part, seqused_q=used, **kw)
    for a, e in zip(g_part[1:4], ref[1:4]):
        assert testing.compare(a, e)
    # indexer and KL grad
    ic = cases.indexer_case("BSND", 4, torch.float16, seed=gen.initial_seed())
    ikw = {k: v for k, v in ic.kwargs.items()}
    k, w, topk = ic.extra["k"], ic.extra["w"], ic.extra["topk"]
    used = i32(12, 5, 0)
    a = ops.lightning_indexer(ic.q, k, w, topk, **ikw)
    bb = ops.lightning_indexer(ic.q, k, w, topk, seqused_q=used, **ikw)
    p = torch.rand(a[0].shape, generator=gen)
    kkw = {x: v for x, v in ikw.items() if x not in ("return_value", "block_table")}
    ka = ops.sparse_lightning_indexer_kl_loss_grad(ic.q, k, w, a[0], p, **kkw)
    kb = ops.sparse_lightning_indexer_kl_loss_grad(ic.q, k, w, a[0], p, seqused_q=used, **kkw)
    for b, u in enumerate(used.tolist()):
        assert torch.equal(a[0][b, :u], bb[0][b, :u]) and torch.equal(a[1][b, :u], bb[1][b, :u])
        assert (bb[0][b, u:] == -1).all() and torch.isneginf(bb[1][b, u:]).all()
        for n in (0, 2, 3):
            assert torch.equal(ka[n][b, :u], kb[n][b, :u])
            assert (kb[n][b, u:] == 0).all()


def test_return_flags_do_not_change_outputs(gen):
    from dsattn import cases
    c = cases.mla_case("TND", 4, torch.bfloat16, seed=gen.initial_seed())
    a = ops.sparse_flash_mla(c.q, return_softmax_lse=False, **c.kwargs)
    b = ops.sparse_flash_mla(c.q, return_softmax_lse=True, **c.kwargs)
    assert torch.equal(a[0], b[0]) and a[1].dim() == 0 and float(a[1]) == 0.0
    ic = cases.indexer_case("TND", 4, torch.float16, seed=gen.initial_seed())
    kw = {**ic.kwargs}
    kw.pop("return_value")
    x = ops.lightning_indexer(ic.q, ic.extra["k"], ic.extra["w"], 8, return_value=0, **kw)
    y = ops.lightning_indexer(ic.q, ic.extra["k"], ic.extra["w"], 8, return_value=1, **kw)
    assert torch.equal(x[0], y[0]) and x[1].shape == (0,)


def test_indexer_worked_examples(gen):
    """10 §1.4 table: r = 4, Kc = 10, resid 2, prefill of 42 rows; decode with resid 3; offsets."""
    q = randn(gen, 1, 42, 2, 8)
    k = randn(gen, 1, 10, 1, 8)
    w = randn(gen, 1, 42, 2).abs()
    idx, _ = ops.lightning_indexer(q, k, w, 12, mask_mode=3, cmp_ratio=4, cmp_residual_k=i32(2))
    counts = (idx[0, :, 0] >= 0).sum(-1).tolist()
    assert counts == [(i + 1) // 4 for i in range(42)]
    idx1, _ = ops.lightning_indexer(q[:, :1], k, w[:, :1], 12, mask_mode=3, cmp_ratio=4, cmp_residual_k=i32(3))
    assert int((idx1 >= 0).sum()) == 10
    off, _ = ops.lightning_indexer(q, k, w, 12, mask_mode=3, cmp_ratio=4, cmp_residual_k=i32(2),
                                   output_idx_offset=i32(100))
    assert torch.equal(torch.where(idx >= 0, idx + 100, idx), off)
    ref, _ = reference.lightning_indexer(q, k, w, 12, mask_mode=3, cmp_ratio=4, cmp_residual_k=i32(2),
                                         output_idx_offset=i32(100))
    assert torch.equal(ref, off)


def test_merge_attention_states_matches_single_pass(gen):
    """Keys split in two partials (no sink), merged with the sink added once == one pass."""
    from dsattn.serving import merge_attention_states
    q = randn(gen, 1, 6, H, D)
    ori = randn(gen, 1, 30, 1, D)
    sinks = randn(gen, H)
    kw = dict(softmax_scale=0.3, ori_mask_mode=0, return_softmax_lse=True)
    full = ops.sparse_flash_mla(q, ori_kv=ori, sinks=sinks, **kw)
    a = ops.sparse_flash_mla(q, ori_kv=ori[:, :12], **kw)
    b = ops.sparse_flash_mla(q, ori_kv=ori[:, 12:], **kw)
    out, lse = merge_attention_states([a[0][0], b[0][0]], [a[1][0, 0], b[1][0, 0]], sinks=sinks)
    assert testing.fp32_math_close(out, full[0][0])
    assert testing.fp32_math_close(lse, full[1][0, 0])
    empty, else_ = merge_attention_states([a[0][0]], [a[1][0, 0]], valid=[torch.zeros(6, H, dtype=torch.bool)])
    assert (empty == 0).all() and (else_ == 0).all()


def test_masks_scalar_and_tensor_rules_agree():
    from dsattn.common import masks
    for om in (0, 3, 4):
        for wl, wr in ((-1, -1), (3, 0), (0, 2), (5, -1)):
            for S2o in (0, 1, 7):
                for p in range(-2, 9):
                    lo, hi = masks.ori_range_t(torch.tensor([p]), torch.tensor([S2o]), om, wl, wr)
                    if p >= 0 or om == 0:
                        assert (int(lo), int(hi)) == masks.ori_range(p, S2o, om, wl, wr) or \
                            int(hi) - int(lo) == 0 == max(0, masks.ori_range(p, S2o, om, wl, wr)[1]
                                                          - masks.ori_range(p, S2o, om, wl, wr)[0])
    for r in (1, 4, 128):
        for pc in range(-5, 300, 7):
            for cm in (0, 3):
                t = masks.cmp_threshold_t(torch.tensor([pc]), torch.tensor([290]), torch.tensor([50]), r, cm)
                assert int(t) == masks.cmp_threshold(pc, 290, 50, r, cm)
        for i in range(0, 12):
            t = masks.indexer_num_valid_t(torch.tensor([10]), r, torch.tensor([r - 1]), torch.tensor([12]),
                                          torch.tensor([i]), 3)
            assert int(t) == masks.indexer_num_valid(10, r, r - 1, 12, i, 3)
    idx = [[3, -1, 2], [5, 1, 1], [0, 9, 2]]
    keep = masks.sparse_walk_t(torch.tensor(idx), torch.tensor([3, 2, 3]), torch.tensor([4, 4, 3]))
    for row, k, lim, thr in zip(idx, keep.tolist(), (3, 2, 3), (4, 4, 3)):
        assert [s for s, _ in masks.sparse_walk(row, lim, thr)] == [s for s, v in enumerate(k) if v]
