"""cmp_topk_length (20 §2.8): a row examines min(K, thr, cmp_topk_length[row]) slots of its compressed
list.  Per request ``[B]`` or per query row; golden, fast paths (per-row and banded), gradient,
sharedkv (with plans) and the packed variant; errors."""
import pytest
import torch

from dsattn import cases, hyper_parallel, ops, reference, testing


def _seed():
    return int(torch.randint(0, 2**31 - 1, ()).item())


def _truncated(idx: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """The same lists with every slot at or past the row's cap set to -1."""
    K = idx.size(-1)
    slot = torch.arange(K)
    cap = cap.reshape(*cap.shape, *([1] * (idx.dim() - cap.dim())))
    return torch.where(slot < cap, idx, torch.full_like(idx, -1))


def _caps(case, per_row: bool, g):
    idx = case.kwargs["cmp_sparse_indices"]
    K = idx.size(-1)
    if per_row:
        return torch.randint(0, K + 1, idx.shape[:-2], generator=g, dtype=torch.int32)
    B = case.kwargs["cmp_residual_kv"].numel()
    return torch.randint(0, K + 1, (B,), generator=g, dtype=torch.int32)


def _row_caps(case, cap: torch.Tensor) -> torch.Tensor:
    """A [B] cap expanded to one value per query row (the lists' leading shape)."""
    idx = case.kwargs["cmp_sparse_indices"]
    if cap.shape == idx.shape[:-2]:
        return cap
    if case.kwargs["layout_q"] == "BSND":
        return cap[:, None].expand(idx.shape[:2])
    cu = case.kwargs["cu_seqlens_q"].long()
    rows = torch.arange(idx.size(0))
    batch = torch.searchsorted(cu[1:].contiguous(), rows, right=True).clamp(max=cap.numel() - 1)
    return cap[batch]


@pytest.mark.parametrize("per_row", [False, True], ids=["per-request", "per-row"])
@pytest.mark.parametrize("layout,paged", [("BSND", False), ("TND", False), ("TND", True)], ids=["BSND", "TND", "PA"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_cap_equals_truncated_lists(layout, paged, dtype, per_row):
    g = torch.Generator().manual_seed(_seed())
    c = cases.mla_case(layout, 4, dtype, paged=paged, seed=_seed(), topk=12)
    cap = _caps(c, per_row, g)
    capped = dict(c.kwargs, cmp_topk_length=cap)
    cut = dict(c.kwargs, cmp_sparse_indices=_truncated(c.kwargs["cmp_sparse_indices"], _row_caps(c, cap)))
    out, lse = ops.sparse_flash_mla(c.q, return_softmax_lse=True, **capped)
    want, want_lse = ops.sparse_flash_mla(c.q, return_softmax_lse=True, **cut)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)               # one walk, bit for bit
    gold, gold_lse = reference.sparse_flash_mla(c.q, return_softmax_lse=True, **capped)
    assert testing.compare(out, gold) and testing.compare(lse, gold_lse)
    if not paged:
        dout = c.extra["dout"]
        got = ops.sparse_flash_mla_grad(c.q, dout, gold, gold_lse, **capped)
        ref = reference.sparse_flash_mla_grad(c.q, dout, gold, gold_lse, **capped)
        via_cut = ops.sparse_flash_mla_grad(c.q, dout, gold, gold_lse, **cut)
        for a, e, x in zip(got, ref, via_cut):
            if e.numel():
                assert testing.compare(a, e)
        assert torch.equal(got[0], via_cut[0]) and torch.equal(got[5], via_cut[5])
        facade = hyper_parallel.npu_sparse_flash_mla_grad(
            c.q, dout, gold, gold_lse, **{k.replace("cu_seqlens_", "cu_seq_lens_"): v for k, v in capped.items()
                                          if k not in ("layout_q", "layout_kv")}, layout=layout)
        assert torch.equal(facade[0], got[0])


def test_zero_cap_sees_no_compressed_key():
    c = cases.mla_case("TND", 4, torch.float32, seed=_seed())
    B = c.kwargs["cmp_residual_kv"].numel()
    out, _ = ops.sparse_flash_mla(c.q, cmp_topk_length=torch.zeros(B, dtype=torch.int32), **c.kwargs)
    ori_only = {k: v for k, v in c.kwargs.items() if not k.startswith(("cmp_", "seqused_cmp", "cu_seqlens_cmp"))}
    want, _ = ops.sparse_flash_mla(c.q, **ori_only)
    assert testing.fp32_math_close(out, want)


@pytest.mark.parametrize("packed", [False, True])
def test_sharedkv_with_cap_and_plans(packed):
    g = torch.Generator().manual_seed(_seed())
    make = cases.packed_sharedkv_case if packed else cases.sharedkv_case
    c = make("TND", 4, torch.float32, seed=_seed())
    idx = c.kwargs["cmp_sparse_indices"]
    cap = torch.randint(0, idx.size(-1) + 1, idx.shape[:1], generator=g, dtype=torch.int32)
    fn = ops.sparse_attn_sharedkv_packed if packed else ops.sparse_attn_sharedkv
    ref = reference.sparse_attn_sharedkv_packed if packed else reference.sparse_attn_sharedkv
    want, _ = ref(c.q, cmp_topk_length=cap, **c.kwargs)
    cut, _ = fn(c.q, **dict(c.kwargs, cmp_sparse_indices=_truncated(idx, cap)))
    for cores, fd in ((None, False), (3, False), (9, True)):
        plan = None if cores is None else cases.sharedkv_plan(c, 4, cores, fd)
        out, _ = fn(c.q, metadata=plan, cmp_topk_length=cap, **c.kwargs)
        assert testing.compare(out, want), (cores, fd)
        if plan is None:
            assert torch.equal(out, cut)


def _base():
    c = cases.mla_case("BSND", 4, torch.float16, seed=0, topk=8)
    return c.q, c.kwargs


@pytest.mark.parametrize("cap,exc,match", [
    (torch.full((3,), 9, dtype=torch.int32), ValueError, "^cmp_topk_length: value 9"),
    (torch.full((3,), -1, dtype=torch.int32), ValueError, "^cmp_topk_length: value -1"),
    (torch.zeros(4, dtype=torch.int32), ValueError, "^cmp_topk_length: expected shape"),
    (torch.zeros(3, dtype=torch.int64), TypeError, "^cmp_topk_length:"),
])
def test_errors(cap, exc, match):
    q, kw = _base()
    with pytest.raises(exc, match=match):
        ops.sparse_flash_mla(q, cmp_topk_length=cap, **kw)
    with pytest.raises(exc, match=match):
        reference.sparse_flash_mla(q, cmp_topk_length=cap, **kw)


def test_cap_needs_sparse_lists_and_ori_cap_is_unsupported():
    q, kw = _base()
    dense = {k: v for k, v in kw.items() if k != "cmp_sparse_indices"}
    with pytest.raises(ValueError, match="^cmp_topk_length: caps the sparse"):
        ops.sparse_flash_mla(q, cmp_topk_length=torch.ones(3, dtype=torch.int32), **dense)
    with pytest.raises(NotImplementedError, match="^ori_topk_length:"):
        ops.sparse_flash_mla(q, ori_topk_length=torch.ones(3, dtype=torch.int32), **kw)


def test_fake_kernel_accepts_the_cap():
    q, kw = _base()
    cap = torch.full((3,), 4, dtype=torch.int32)
    fn = torch.compile(lambda q: ops.sparse_flash_mla(q, cmp_topk_length=cap, **kw)[0], fullgraph=True)
    assert testing.compare(fn(q), ops.sparse_flash_mla(q, cmp_topk_length=cap, **kw)[0])


def test_tnd_with_as_many_rows_as_requests_reads_per_row():
    """T == B is ambiguous between [B] and [T]: it is read per row (the general form)."""
    g = torch.Generator().manual_seed(_seed())
    H, D = 2, 16
    q = torch.randn(3, H, D, generator=g)
    kv = torch.randn(30, 1, D, generator=g)
    ckv = torch.randn(9, 1, D, generator=g)
    idx = torch.randint(0, 3, (3, 1, 4), generator=g, dtype=torch.int32)
    kw = dict(ori_kv=kv, cmp_kv=ckv, cmp_sparse_indices=idx, cu_seqlens_q=torch.tensor([0, 0, 2, 3], dtype=torch.int32),
              cu_seqlens_ori_kv=torch.tensor([0, 10, 20, 30], dtype=torch.int32),
              cu_seqlens_cmp_kv=torch.tensor([0, 2, 5, 9], dtype=torch.int32), cmp_ratio=4, layout_q="TND",
              layout_kv="TND")
    cap = torch.tensor([4, 0, 2], dtype=torch.int32)                            # rows 0, 1, 2
    out, _ = ops.sparse_flash_mla(q, cmp_topk_length=cap, **kw)
    want, _ = ops.sparse_flash_mla(q, **dict(kw, cmp_sparse_indices=_truncated(idx, cap)))
    assert torch.equal(out, want)
