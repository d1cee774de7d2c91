"""60-serving helpers: store_rows, get_last_loc, the CPU mirrors, compressor_metadata."""
import pytest
import torch

from dsattn import ops, serving

from conftest import randn


def test_store_rows_skips_minus_one_and_keeps_other_rows(gen):
    cache = randn(gen, 4, 8, 1, 16)
    before = cache.clone()
    rows = randn(gen, 5, 1, 16)
    slots = torch.tensor([0, -1, 31, 9, -1], dtype=torch.int32)
    serving.store_rows(cache, rows, slots)
    flat, old = cache.view(32, 16), before.view(32, 16)
    assert torch.equal(flat[0], rows[0, 0]) and torch.equal(flat[31], rows[2, 0]) and torch.equal(flat[9], rows[3, 0])
    keep = torch.ones(32, dtype=torch.bool)
    keep[[0, 31, 9]] = False
    assert torch.equal(flat[keep], old[keep])
    serving.store_rows(cache, rows, torch.full((5,), -1))          # all skipped: nothing changes
    assert torch.equal(cache.view(32, 16)[keep], old[keep])


def test_store_rows_errors(gen):
    cache = randn(gen, 2, 4, 1, 8)
    rows = randn(gen, 2, 1, 8)
    with pytest.raises(ValueError, match="^slot_mapping"):
        serving.store_rows(cache, rows, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="^slot_mapping"):
        serving.store_rows(cache, rows, torch.tensor([0, -2]))
    with pytest.raises(TypeError, match="^rows"):
        serving.store_rows(cache, rows.double(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="^rows"):
        serving.store_rows(cache, rows[:, :, :4], torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="^slot_mapping"):
        serving.store_rows(cache, rows, torch.tensor([0.0, 1.0]))


def test_get_last_loc_exact_and_int64_safe():
    req_to_token = torch.arange(6 * 10, dtype=torch.int32).reshape(6, 10) * 7
    idx = torch.tensor([5, 0, 3, 2], dtype=torch.int64)
    pre = torch.tensor([10, 0, 1, 4], dtype=torch.int32)
    want = torch.tensor([int(req_to_token[5, 9]), -1, int(req_to_token[3, 0]), int(req_to_token[2, 3])])
    assert torch.equal(serving.get_last_loc(req_to_token, idx, pre), want)
    # offsets past 2^31: a [2^16 + 8, 2^15 + 1] pool as a strided view of one small row
    big = torch.arange(2 ** 15 + 1, dtype=torch.int32)[None].expand(2 ** 16 + 8, -1)
    got = serving.get_last_loc(big, torch.tensor([2 ** 16 + 7]), torch.tensor([2 ** 15 + 1]))
    assert got.tolist() == [2 ** 15] and got.dtype == torch.int64


def test_cpu_mirrors():
    assert serving.build_cu_seqlens_q_cpu("prefill", seq_lens_cpu=torch.tensor([3, 0, 5])).tolist() == [0, 3, 3, 8]
    assert serving.build_cu_seqlens_q_cpu("decode", batch_size=3).tolist() == [0, 1, 2, 3]
    assert serving.build_cu_seqlens_q_cpu("verify", batch_size=3, tokens_per_req=2).tolist() == [0, 2, 4, 6]
    assert serving.build_cu_seqlens_q_cpu("draft_extend", batch_size=2, tokens_per_req=4).dtype == torch.int32
    assert serving.build_seqused_kv_cpu(torch.tensor([7, 0, 9, 4]), 3).tolist() == [7, 1, 9]
    with pytest.raises(ValueError, match="^new_tokens_cpu"):
        serving.build_cu_seqlens_q_cpu("prefill", seq_lens_cpu=torch.tensor([1]), new_tokens_cpu=torch.tensor([1]))
    with pytest.raises(ValueError, match="^seq_lens_cpu"):
        serving.build_cu_seqlens_q_cpu("prefill", seq_lens_cpu=torch.tensor([1]).to("meta"))
    with pytest.raises(ValueError, match="^mode"):
        serving.build_cu_seqlens_q_cpu("train", batch_size=1)


@pytest.mark.parametrize("fmt", ["flat", "block_offset"])
def test_compressor_metadata_matches_the_compressor_packing(fmt, gen):
    r, bs = 4, 8
    starts, lens = [0, 6, 3], [13, 7, 0]
    T = sum(lens)
    num_rows = min(T, T // r + 3)
    cu = torch.tensor([0, 13, 20, 20], dtype=torch.int32)
    table = torch.tensor([[3, 1, 0], [2, 4, 0], [5, 0, 0]], dtype=torch.int32)
    cos, sin = torch.rand(64, 8, generator=gen), torch.rand(64, 8, generator=gen)
    c, s, slots = serving.compressor_metadata(cos, sin, cu, torch.tensor(starts, dtype=torch.int32), table,
                                              kv_block_size=bs, compress_ratio=r, num_rows=num_rows,
                                              slot_mapping_format=fmt)
    row = 0
    for b, (sp, su) in enumerate(zip(starts, lens)):
        for cp in range(sp // r, (sp + su) // r):
            assert torch.equal(c[row], cos[cp * r]) and torch.equal(s[row], sin[cp * r])
            page, off = int(table[b, cp // bs]), cp % bs
            assert (slots[row].tolist() == page * bs + off) if fmt == "flat" else (slots[row].tolist() == [page, off])
            row += 1
    assert (c[row:] == 1).all() and (s[row:] == 0).all()
    assert (slots[row:] == -1).all() if fmt == "flat" else (slots[row:].tolist() == [[-1, bs - 1]] * (num_rows - row))
    # the compressor emits exactly those rows, so its output lands in those slots
    x = randn(gen, T, 16)
    w = randn(gen, 32, 16, scale=0.25)
    state = torch.zeros(8, 8, 64)
    out = ops.compressor(x, w, w.clone(), state, torch.zeros(4, 32), r, cu_seqlens=cu, coff=2,
                         start_pos=torch.tensor([0, 0, 0], dtype=torch.int32))
    assert out.size(0) == num_rows


def test_compressor_metadata_and_layer_errors():
    from dsattn.model import DeepseekV4Attention
    from dsattn.model.config import PRESETS
    from dsattn.model.layer import PagedBatch
    cos = torch.ones(8, 4)
    cu, sp, table = torch.tensor([0, 4], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), \
        torch.zeros(1, 2, dtype=torch.int32)
    f = serving.compressor_metadata
    with pytest.raises(ValueError, match="^slot_mapping_format"):
        f(cos, cos, cu, sp, table, kv_block_size=4, compress_ratio=4, num_rows=2, slot_mapping_format="pairs")
    with pytest.raises(TypeError, match="^rope_cos"):
        f(cos.double(), cos, cu, sp, table, kv_block_size=4, compress_ratio=4, num_rows=2)
    with pytest.raises(TypeError, match="^start_pos"):
        f(cos, cos, cu, sp.long(), table, kv_block_size=4, compress_ratio=4, num_rows=2)
    with pytest.raises(ValueError, match="^start_pos"):
        f(cos, cos, cu, torch.zeros(2, dtype=torch.int32), table, kv_block_size=4, compress_ratio=4, num_rows=2)
    with pytest.raises(ValueError, match="^ratio"):
        DeepseekV4Attention(PRESETS["small"], 8)
    with pytest.raises(ValueError, match="^pad_to"):
        PagedBatch(PRESETS["small"], 8, 4).step([0, 1], [1, 1], 4, pad_to=1)
    with pytest.raises(ValueError, match="^group"):
        serving.context_parallel_attention(torch.zeros(1, 2, 16), torch.zeros(4, 1, 16), 0, 4, softmax_scale=0.25)
