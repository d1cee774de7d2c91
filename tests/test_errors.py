"""Bad input gets a clear ValueError / TypeError / NotImplementedError naming the argument."""
import pytest
import torch

import dsattn
from dsattn import ops, reference

H, D = 4, 16
f16 = torch.float16


def mla(**over):
    kw = dict(q=torch.randn(2, 6, H, D, dtype=f16), ori_kv=torch.randn(2, 6, 1, D, dtype=f16),
              cmp_kv=torch.randn(2, 2, 1, D, dtype=f16), cmp_ratio=4)
    kw.update(over)
    return kw


def tnd(**over):
    kw = dict(q=torch.randn(9, H, D, dtype=f16), ori_kv=torch.randn(9, 1, D, dtype=f16),
              cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32),
              cu_seqlens_ori_kv=torch.tensor([0, 4, 9], dtype=torch.int32), layout_q="TND", layout_kv="TND")
    kw.update(over)
    return kw


def idx(**over):
    kw = dict(q=torch.randn(2, 5, H, D, dtype=f16), k=torch.randn(2, 7, 1, D, dtype=f16),
              w=torch.rand(2, 5, H), topk=4)
    kw.update(over)
    return kw


def i32(*v):
    return torch.tensor(v, dtype=torch.int32)


MLA_CASES = [
    (mla(q=torch.ones(2, 6, H, D, dtype=torch.int8)), TypeError, "^q:"),
    (mla(ori_kv=torch.randn(2, 6, 1, D)), TypeError, "^ori_kv:"),
    (mla(ori_kv=None), ValueError, "^ori_kv:"),
    (mla(sinks=torch.randn(H, dtype=torch.float64)), TypeError, "^sinks:"),
    (mla(sinks=torch.randn(H + 1)), ValueError, "^sinks:"),
    (mla(q=torch.randn(2, 6, D, dtype=f16)), ValueError, "^q:"),
    (mla(ori_kv=torch.randn(2, 6, 2, D, dtype=f16)), ValueError, "^ori_kv:"),
    (mla(ori_kv=torch.randn(2, 6, 1, D + 1, dtype=f16)), ValueError, "^ori_kv:.*head dim"),
    (mla(ori_kv=torch.randn(3, 6, 1, D, dtype=f16)), ValueError, "^ori_kv:.*batch"),
    (mla(cmp_kv=None, cmp_sparse_indices=torch.zeros(2, 6, 1, 3, dtype=torch.int32)), ValueError,
     "^cmp_sparse_indices:"),
    (mla(cmp_sparse_indices=torch.zeros(2, 5, 1, 3, dtype=torch.int32)), ValueError, "^cmp_sparse_indices:"),
    (mla(cmp_sparse_indices=torch.zeros(2, 6, 1, 3, dtype=torch.int64)), TypeError, "^cmp_sparse_indices:"),
    (mla(cmp_residual_kv=i32(1, 4)), ValueError, "^cmp_residual_kv:.*batch 1"),
    (mla(cmp_residual_kv=i32(1)), ValueError, "^cmp_residual_kv:"),
    (mla(cmp_ratio=0), ValueError, "^cmp_ratio:"),
    (mla(ori_mask_mode=1), ValueError, "^ori_mask_mode:"),
    (mla(cmp_mask_mode=4), ValueError, "^cmp_mask_mode:"),
    (mla(ori_win_left=-2), ValueError, "^ori_win_left:"),
    (mla(layout_q="BNSD"), ValueError, "^layout_q:"),
    (mla(layout_kv="TND"), ValueError, "^layout_kv:"),
    (mla(topk_value_mode=2), NotImplementedError, "^topk_value_mode:"),
    (mla(topk_value_mode=5), ValueError, "^topk_value_mode:"),
    (mla(cmp_topk_length=i32(1, 1)), ValueError, "^cmp_topk_length: caps the sparse"),
    (mla(seqused_q=i32(7, 1)), ValueError, "^seqused_q:"),
    (mla(seqused_ori_kv=i32(7, 1)), ValueError, "^seqused_ori_kv:"),
    (mla(cu_seqlens_q=i32(0, 3, 6)), ValueError, "^cu_seqlens_q:"),
    (tnd(cu_seqlens_q=i32(0, 5, 4)), ValueError, "^cu_seqlens_q:.*non-decreasing"),
    (tnd(cu_seqlens_q=i32(1, 4, 9)), ValueError, "^cu_seqlens_q:.*start at 0"),
    (tnd(cu_seqlens_q=i32(0, 4, 12)), ValueError, "^cu_seqlens_q:.*exceeds"),
    (tnd(cu_seqlens_ori_kv=i32(0, 9)), ValueError, "^cu_seqlens_ori_kv:"),
    (tnd(cu_seqlens_q=None), ValueError, "^cu_seqlens_q:.*required"),
    (mla(layout_kv="PA_BBND", ori_kv=torch.randn(4, 4, 1, D, dtype=f16), cmp_kv=None,
         seqused_ori_kv=i32(6, 6)), ValueError, "^ori_block_table:.*required"),
    (mla(layout_kv="PA_BBND", ori_kv=torch.randn(4, 4, 1, D, dtype=f16), cmp_kv=None,
         ori_block_table=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "^seqused_ori_kv:.*required"),
    (mla(layout_kv="PA_BBND", ori_kv=torch.randn(4, 4, 1, D, dtype=f16), cmp_kv=None, seqused_ori_kv=i32(6, 6),
         ori_block_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError, "^ori_block_table:.*too short"),
    (mla(layout_kv="PA_BBND", ori_kv=torch.randn(4, 4, 1, D, dtype=f16), cmp_kv=None, seqused_ori_kv=i32(6, 6),
         ori_block_table=torch.tensor([[0, 9], [1, 2]], dtype=torch.int32)), ValueError,
     r"^ori_block_table:.*num_blocks"),
    (mla(ori_block_table=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "^ori_block_table:"),
]


@pytest.mark.parametrize("impl", ["ops", "reference"])
@pytest.mark.parametrize("kw,exc,match", MLA_CASES)
def test_sparse_flash_mla_errors(kw, exc, match, impl):
    fn = ops.sparse_flash_mla if impl == "ops" else reference.sparse_flash_mla
    kw = dict(kw)
    q = kw.pop("q")
    with pytest.raises(exc, match=match):
        fn(q, **kw)


IDX_CASES = [
    (idx(w=torch.rand(2, 5, H, dtype=torch.float64)), TypeError, "^w:"),
    (idx(k=torch.randn(2, 7, 1, D)), TypeError, "^k:"),
    (idx(w=torch.rand(2, 5, H + 1)), ValueError, "^w:"),
    (idx(k=torch.randn(2, 7, 2, D, dtype=f16)), ValueError, "^k:"),
    (idx(topk=0), ValueError, "^topk:"),
    (idx(mask_mode=4), ValueError, "^mask_mode:"),
    (idx(cmp_ratio=129), ValueError, "^cmp_ratio:"),
    (idx(return_value=2), ValueError, "^return_value:"),
    (idx(max_seqlen_q=-2), ValueError, "^max_seqlen_q:"),
    (idx(cmp_residual_k=i32(0, 1)), ValueError, "^cmp_residual_k:"),
    (idx(layout_k="PA_BBND"), ValueError, "^block_table:"),
    (idx(block_table=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "^block_table:"),
    (idx(output_idx_offset=i32(1, 2, 3)), ValueError, "^output_idx_offset:"),
    (idx(output_idx_offset=i32(-100, 0), mask_mode=0), ValueError, "^output_idx_offset:.*negative"),
    (idx(seqused_k=i32(8, 1)), ValueError, "^seqused_k:"),
    (idx(seqused_k=torch.tensor([1, 1])), TypeError, "^seqused_k:"),
]


@pytest.mark.parametrize("kw,exc,match", IDX_CASES)
def test_lightning_indexer_errors(kw, exc, match):
    for fn in (ops.lightning_indexer, reference.lightning_indexer):
        k = dict(kw)
        with pytest.raises(exc, match=match):
            fn(k.pop("q"), k.pop("k"), k.pop("w"), k.pop("topk"), **k)


def test_grad_and_kl_errors():
    kw = mla()
    q = kw.pop("q")
    o, lse = ops.sparse_flash_mla(q, return_softmax_lse=True, **kw)
    with pytest.raises(ValueError, match="^softmax_lse:.*placeholder"):
        ops.sparse_flash_mla_grad(q, o, o, torch.zeros(()), **kw)
    with pytest.raises(TypeError, match="^dout:"):
        ops.sparse_flash_mla_grad(q, o.float(), o, lse, **kw)
    with pytest.raises(ValueError, match="^attn_out:"):
        ops.sparse_flash_mla_grad(q, o, o[:, :3], lse, **kw)
    with pytest.raises(ValueError, match="^layout_kv:.*paged"):
        ops.sparse_flash_mla_grad(q, o, o, lse, **{**kw, "layout_kv": "PA_BBND"})
    k = idx()
    si = torch.zeros(2, 5, 1, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="^attn_softmax_l1_norm:"):
        ops.sparse_lightning_indexer_kl_loss_grad(k["q"], k["k"], k["w"], si, si, layout_q="BSND", layout_k="BSND")
    with pytest.raises(ValueError, match="^layout_k:"):
        ops.sparse_lightning_indexer_kl_loss_grad(k["q"], k["k"], k["w"], si, si.float(), layout_q="BSND",
                                                  layout_k="TND", cu_seqlens_k=i32(0, 7))
    with pytest.raises(ValueError, match="^sparse_indices:"):
        ops.sparse_lightning_indexer_kl_loss_grad(k["q"], k["k"], k["w"], si[:, :4], si[:, :4].float(),
                                                  layout_q="BSND", layout_k="BSND")
    with pytest.raises(ValueError, match="^layout:"):
        dsattn.npu_sparse_flash_mla(q, ori_kv=kw["ori_kv"], layout="PA_BBND")


def test_content_checks_can_be_switched_off():
    kw = mla(cmp_residual_kv=i32(1, 4))
    q = kw.pop("q")
    dsattn.set_content_checks(False)
    try:
        out, _ = ops.sparse_flash_mla(q, **kw)                  # no check: runs (garbage in, no crash)
        assert out.shape == q.shape
    finally:
        dsattn.set_content_checks(True)
    with pytest.raises(ValueError):
        ops.sparse_flash_mla(q, **kw)


# ----------------------------------------------------------------------------- the argument at fault
def test_paged_indexer_lengths_past_the_block_table_name_it():
    q, k, w = torch.randn(2, 3, H, D), torch.randn(6, 4, 1, D), torch.randn(2, 3, H)
    table = torch.tensor([[0, 1, -1], [2, 3, -1]], dtype=torch.int32)
    paged = dict(block_table=table, layout_k="PA_BBND")
    with pytest.raises(ValueError, match=r"^block_table: entry \[0, 2\] = -1 is needed for key 8 of batch 0 "
                                         r"\(seqused_k reads 12 keys\)"):
        ops.lightning_indexer(q, k, w, 4, seqused_k=torch.tensor([12, 3], dtype=torch.int32), **paged)
    with pytest.raises(ValueError, match=r"^seqused_k: batch 0 reads 13 keys, past what block_table maps"):
        ops.lightning_indexer(q, k, w, 4, seqused_k=torch.tensor([13, 3], dtype=torch.int32), **paged)


def test_a_float64_activation_with_half_precision_weights_names_the_activation():
    x = torch.randn(2, 8, 64, dtype=torch.float64)
    wkv = torch.randn(32, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^x: dtype torch.float64 needs float64 wkv"):
        ops.compressor(x, wkv, wkv.clone(), torch.zeros(1, 8, 64), torch.zeros(4, 32), 4)
    q, kv = torch.randn(1, 2, 4, 64, dtype=torch.float64), torch.randn(1, 8, 1, 64, dtype=torch.bfloat16)
    common = dict(ori_kv=kv, softmax_scale=0.1)
    with pytest.raises(TypeError, match=r"^q: dtype torch.float64 needs float64 ori_kv"):
        ops.sparse_attn_sharedkv(q, layout_q="BSND", layout_kv="BSND", **common)
    with pytest.raises(TypeError, match=r"^q: dtype torch.float64 needs float64 ori_kv"):
        ops.sparse_flash_mla(q, layout_q="BSND", layout_kv="BSND", **common)
    with pytest.raises(TypeError, match=r"^query: dtype torch.float64 needs float64 ori_kv"):
        dsattn.npu_sparse_flash_mla(q, layout="BSND", **common)
    with pytest.raises(ValueError, match=r"^cu_seq_lens_q: "):       # the wrapper's own spelling, in its errors
        dsattn.npu_sparse_flash_mla(q.bfloat16(), layout="BSND", cu_seq_lens_q=torch.tensor([0, 2], dtype=torch.int32),
                                    **common)


def test_store_rows_refuses_meta_and_mixed_devices():
    from dsattn.serving.caches import store_rows
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"^cache: is on the meta device"):
        store_rows(torch.empty(4, 16, 1, 64, device="meta"), torch.randn(3, 1, 64), slots)
    with pytest.raises(ValueError, match=r"^rows: is on meta but cache is on cpu"):
        store_rows(torch.zeros(4, 16, 1, 64), torch.randn(3, 1, 64, device="meta"), slots)
