"""sparse_attn_sharedkv_packed (library extension): sparse_attn_sharedkv over packed int8 / fp8
caches.  Checked against its golden (dequantise every row, then the sharedkv golden), bit for
bit against sparse_attn_sharedkv on the dequantised caches, with and without a plan, with
0xFF bytes (NaN scales and rope) in every row no query may read; plus the quantiser's error
bound, the error paths and torch.compile."""
import pytest
import torch

import dsattn
from dsattn import cases, ops, quant, reference, testing
from dsattn.quant.rows import rope_bytes_dtype

SCEN = {1: "SWA", 4: "CSA", 128: "HCA"}
PAYLOADS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _seed():
    return int(torch.randint(0, 2**31 - 1, ()).item())


def _dequantised(c):
    """The sharedkv arguments with the packed caches dequantised (0xFF rows become NaN rows)."""
    kw = {k: v for k, v in c.kwargs.items() if k not in ("kv_rope_dim", "kv_tile_size")}
    rope, tile = c.kwargs["kv_rope_dim"], c.kwargs["kv_tile_size"]
    for name in ("ori_kv", "cmp_kv"):
        if name in kw:
            kw[name] = quant.dequant_kv_rows(kw[name], rope, c.q.dtype, rope_bytes_dtype(c.q.dtype), tile)[0]
    return kw


@pytest.mark.parametrize("payload", list(PAYLOADS), ids=list(PAYLOADS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("layout,paged", [("TND", True), ("BSND", True), ("TND", False), ("BSND", False)],
                         ids=["TND+PA_ND", "BSND+PA_ND", "TND+TND", "BSND+BSND"])
@pytest.mark.parametrize("ratio", [1, 4, 128], ids=lambda r: SCEN[r])
def test_against_golden_and_dequantised_sharedkv(ratio, layout, paged, dtype, payload):
    # 16 heads: the split-row share is a statistic; with 4 heads about 1 configuration in 1,000 falls under
    # 99.5 % from bf16 rounding noise alone (the golden against exact math does too)
    c = cases.packed_sharedkv_case(layout, ratio, dtype, paged=paged, payload=PAYLOADS[payload], seed=_seed(), H=16)
    want, _ = reference.sparse_attn_sharedkv_packed(c.q, **c.kwargs)
    direct, lse = ops.sparse_attn_sharedkv_packed(c.q, **c.kwargs)
    assert lse.shape == (0,)
    res = testing.compare(direct, want)
    assert res, res
    same, _ = ops.sparse_attn_sharedkv(c.q, **_dequantised(c))   # only the gathered rows are dequantised
    assert torch.equal(direct, same)
    for cores, fd in ((1, False), (5, True)):
        planned, _ = ops.sparse_attn_sharedkv_packed(c.q, metadata=cases.sharedkv_plan(c, ratio, cores, fd), **c.kwargs)
        res = testing.split_row_close(planned, want) if fd and dtype != torch.float32 else testing.compare(planned,
                                                                                                             want)
        assert res, f"cores {cores} fd {fd}: {res}"


@pytest.mark.parametrize("rope,tile", [(0, 16), (0, 32), (16, 8), (8, 8)])
def test_row_formats(rope, tile):
    """Rope 0 (the whole row quantised) and other tile sizes; the row width is the packed formula."""
    c = cases.packed_sharedkv_case("TND", 4, torch.bfloat16, rope=rope, tile=tile, seed=_seed())
    N = 32 - rope
    assert c.kwargs["ori_kv"].size(-1) == N + 2 * rope + 4 * (N // tile)
    want, _ = reference.sparse_attn_sharedkv_packed(c.q, **c.kwargs)
    got, _ = ops.sparse_attn_sharedkv_packed(c.q, **c.kwargs)
    assert testing.compare(got, want)


@pytest.mark.parametrize("payload", list(PAYLOADS), ids=list(PAYLOADS))
def test_quantisation_error_against_the_unquantised_attention(payload):
    """The packed cache moves the fp32 output by about the quantiser's relative step (int8: 1/254
    of a tile's max; e4m3: 2^-4 of the value): bounded by 2 % / 8 % of the output's scale."""
    c = cases.packed_sharedkv_case("TND", 4, torch.float32, payload=PAYLOADS[payload], seed=_seed())
    got, _ = ops.sparse_attn_sharedkv_packed(c.q, **c.kwargs)
    want, _ = ops.sparse_attn_sharedkv(c.q, **c.extra["unpacked"])
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert 0 < err < (0.02 if payload == "int8" else 0.08), err


def test_quantize_kv_rows_round_trip():
    """A packed row read back: the rope part exactly, the rest equal to dequant_block of
    dynamic_block_quant (whose NumPy golden is bit-exact)."""
    g = torch.Generator().manual_seed(_seed())
    k = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    rows = quant.quantize_kv_rows(k, 16, torch.int8, 16)
    assert rows.shape == (64, 48 - 16 + 32 + 4 * 2) and rows.dtype == torch.int8
    back, v = quant.dequant_kv_rows(rows, 16, torch.float32, torch.bfloat16, 16)
    assert torch.equal(back[:, 32:], k[:, 32:].float())                  # rope kept exactly
    y, scale = ops.dynamic_block_quant(k[:, :32], "int8", 16)
    assert torch.equal(back[:, :32], ops.dequant_block(y, scale, 16, torch.float32))
    assert torch.equal(v, back[:, :32])


def _bad(**over):
    c = cases.packed_sharedkv_case("TND", 4, torch.bfloat16, seed=1)
    kw = dict(c.kwargs)
    kw.update(over)
    return c.q, kw


@pytest.mark.parametrize("over,exc,match", [
    (dict(kv_tile_size=12), ValueError, "kv_tile_size"),
    (dict(kv_rope_dim=40), ValueError, "kv_tile_size"),
    (dict(kv_rope_dim=0), ValueError, "ori_kv: row width 52 bytes"),
], ids=["tile", "rope-too-wide", "width-mismatch"])
def test_errors(over, exc, match):
    q, kw = _bad(**over)
    with pytest.raises(exc, match=match):
        ops.sparse_attn_sharedkv_packed(q, **kw)


def test_error_unpacked_cache_and_bad_quantiser_args():
    c = cases.sharedkv_case("TND", 4, torch.bfloat16, seed=1)
    with pytest.raises(TypeError, match="ori_kv: dtype torch.bfloat16 is not supported for a packed cache"):
        ops.sparse_attn_sharedkv_packed(c.q, kv_rope_dim=16, kv_tile_size=16, **c.kwargs)
    k = torch.randn(4, 32)
    with pytest.raises(TypeError, match="dtype"):
        quant.quantize_kv_rows(k, 16, torch.bfloat16, 16)
    with pytest.raises(ValueError, match="rope_head_dim"):
        quant.quantize_kv_rows(k, 16, torch.int8, 32)
    with pytest.raises(TypeError, match="k: dtype torch.int32"):
        quant.quantize_kv_rows(k.int(), 16, torch.int8, 16)
    k[2, 5] = float("inf")
    with pytest.raises(ValueError, match=r"k: holds a non-finite value inf at \[2, 5\]"):
        quant.quantize_kv_rows(k, 16, torch.int8, 16)


def test_torch_compile_fullgraph():
    c = cases.packed_sharedkv_case("TND", 4, torch.float32, seed=3)
    kw = dict(c.kwargs)
    plan = cases.sharedkv_plan(c, 4, 3, True)

    def step(q, metadata):
        return torch.ops.dsattn.sparse_attn_sharedkv_packed(q, metadata=metadata, **kw)
    eager = step(c.q, plan)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)(c.q, plan)
    assert torch.equal(eager[0], compiled[0])
    assert dsattn.sparse_attn_sharedkv_packed is ops.sparse_attn_sharedkv_packed
