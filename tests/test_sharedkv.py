"""sparse_attn_sharedkv (20 §4) executing sparse_attn_sharedkv_metadata plans: every core count
1..36, split-KV on and off, the three scenarios, every layout pair, against the golden."""
import pytest
import torch

from dsattn import cases, ops, reference, testing
from dsattn.planner.table import decode

import dsattn.sharedkv  # noqa: F401

attn = torch.ops.dsattn.sparse_attn_sharedkv
meta = torch.ops.dsattn.sparse_attn_sharedkv_metadata
SCEN = {1: "SWA", 4: "CSA", 128: "HCA"}


def _seed():
    return int(torch.randint(0, 2**31 - 1, ()).item())


LONG = [(3, 1500), (1, 700), (0, 50), (2, 1030)]      # several window and compressed s2-blocks per row


@pytest.mark.parametrize("ratio", [1, 4, 128], ids=lambda r: SCEN[r])
def test_every_core_count_and_split_kv(ratio):
    """fp32 within 1e-5 of the float64 golden for every plan: cores 1..36, support_fd off and on."""
    c = cases.sharedkv_case("TND", ratio, torch.float32, paged=True, seed=_seed(), lengths=LONG, D=16, window=1200)
    want, _ = reference.sparse_flash_mla(c.q, compute_dtype=torch.float64, **c.extra["mla_kwargs"])
    split_rows = 0
    for cores in range(1, 37):
        for fd in (False, True):
            m = cases.sharedkv_plan(c, ratio, cores, fd)
            split_rows += len({(e[0], e[1]) for e in decode(m).fd})
            out, lse = attn(c.q, metadata=m, **c.kwargs)
            res = testing.fp32_math_close(out, want)
            assert res, f"cores {cores} fd {fd}: {res}"
            assert lse.shape == (0,)
    assert split_rows > 30                                  # the flash-decode reduction really ran


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("layout,paged", [("TND", True), ("BSND", True), ("TND", False), ("BSND", False)],
                         ids=["TND+PA_ND", "BSND+PA_ND", "TND+TND", "BSND+BSND"])
@pytest.mark.parametrize("ratio", [1, 4, 128], ids=lambda r: SCEN[r])
def test_layouts_and_dtypes_against_golden(ratio, layout, paged, dtype):
    # 16 heads: the split-row share is a statistic; with 4 heads about 1 configuration in 1,000 falls under
    # 99.5 % from bf16 rounding noise alone (the golden against exact math does too)
    c = cases.sharedkv_case(layout, ratio, dtype, paged=paged, seed=_seed(), H=16)
    mla_kw = c.extra["mla_kwargs"]
    want, _ = reference.sparse_flash_mla(c.q, **mla_kw)
    want64 = reference.sparse_flash_mla(c.q, compute_dtype=torch.float64, **mla_kw)[0] if dtype == torch.float32 \
        else None
    for cores, fd in ((1, False), (5, True), (24, False)):
        out, _ = attn(c.q, metadata=cases.sharedkv_plan(c, ratio, cores, fd), **c.kwargs)
        if want64 is not None:
            res = testing.fp32_math_close(out, want64)
        else:                                 # a split row rounds P against its partial maxima
            res = testing.split_row_close(out, want) if fd else testing.compare(out, want)
        assert res, f"cores {cores} fd {fd}: {res}"
    direct, _ = attn(c.q, **c.kwargs)
    same, _ = ops.sparse_flash_mla(c.q, **mla_kw)               # 20 §4.4: one kernel, identical bits
    assert torch.equal(direct, same)


def test_softmax_scale_zero_means_inverse_sqrt_d():
    c = cases.sharedkv_case("TND", 4, torch.float32, seed=_seed())
    kw = dict(c.kwargs, softmax_scale=0.0)
    mla = dict(c.extra["mla_kwargs"], softmax_scale=c.q.size(-1) ** -0.5)
    assert torch.equal(attn(c.q, **kw)[0], ops.sparse_flash_mla(c.q, **mla)[0])


def test_plan_from_other_lengths_is_rejected():
    c = cases.sharedkv_case("TND", 128, torch.float32, seed=_seed(), lengths=LONG, D=16, window=1200)
    kw = c.kwargs
    s2o = kw["seqused_kv"]                                   # paged: the key lengths are given
    # (twice the queries: FD tasks over rows that do not exist; one batch fewer)
    for cu_q, s2o in ((kw["cu_seqlens_q"] * 2, s2o), (kw["cu_seqlens_q"][:-1], s2o[:-1])):
        other = meta(4, 1, 16, cu_seqlens_q=cu_q, seqused_kv=s2o, layout_q="TND", cmp_ratio=128, cmp_topk=0,
                     ori_win_left=kw["ori_win_left"], aic_core_num=6, aiv_core_num=8, support_fd=True)
        with pytest.raises(ValueError, match="^metadata"):
            attn(c.q, metadata=other, **kw)


def test_errors():
    c = cases.sharedkv_case("TND", 4, torch.float32, seed=1)
    kw = c.kwargs
    with pytest.raises(NotImplementedError, match="^return_softmax_lse"):
        attn(c.q, return_softmax_lse=True, **kw)
    with pytest.raises(ValueError, match="^seqused_kv"):
        attn(c.q, **{k: v for k, v in kw.items() if k != "seqused_kv"})
    with pytest.raises(ValueError, match="^cmp_block_table"):
        attn(c.q, **{k: v for k, v in kw.items() if k != "cmp_block_table"})
    with pytest.raises(TypeError, match="^metadata"):
        attn(c.q, metadata=torch.zeros(1024), **kw)
    with pytest.raises(ValueError, match="^metadata"):
        attn(c.q, metadata=torch.zeros(512, dtype=torch.int32), **kw)
    bad = cases.sharedkv_plan(c, 4, 4, False).clone()
    bad[2] = -1                                                # a negative row in core 0's range
    with pytest.raises(ValueError, match="^metadata.*negative"):
        attn(c.q, **dict(kw, metadata=bad))
    with pytest.raises(ValueError, match="^layout_kv"):
        attn(c.q, **dict(kw, layout_kv="BSND"))
    with pytest.raises(ValueError, match="^metadata"):                  # K = 8 is not a plannable cmp_topk
        c8 = cases.sharedkv_case("TND", 4, torch.float32, seed=1, topk=8)
        attn(c8.q, metadata=cases.sharedkv_plan(c8, 4, 4, False), **c8.kwargs)


def test_rows_the_planner_clips_are_still_computed(gen):
    """ori_mask_mode 0 without a compressed branch: rows before the first key position (S1 > S2)
    see every key; the CANN planner clips them away, the library computes them outside the plan."""
    q = torch.randn(7, 4, 16, generator=gen)
    kv = torch.randn(5, 1, 16, generator=gen)
    cu_q, cu_kv = torch.tensor([0, 5, 7], dtype=torch.int32), torch.tensor([0, 3, 5], dtype=torch.int32)
    kw = dict(ori_kv=kv, cu_seqlens_q=cu_q, cu_seqlens_ori_kv=cu_kv, ori_mask_mode=0, layout_q="TND",
              layout_kv="TND", softmax_scale=0.25)
    plan = meta(4, 1, 16, cu_seqlens_q=cu_q, cu_seqlens_ori_kv=cu_kv, layout_q="TND", layout_kv="TND",
                has_cmp_kv=False, ori_mask_mode=0, aic_core_num=3)
    out, _ = attn(q, metadata=plan, **kw)
    want, _ = reference.sparse_flash_mla(q, compute_dtype=torch.float64, **kw)
    assert testing.fp32_math_close(out, want)
    assert (out[:2].abs().sum() > 0)                          # the clipped rows of batch 0
