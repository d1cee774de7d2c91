"""dynamic_block_quant / dequant_block, packed rows, and the kv_rmsnorm_rope_quant_cache writer
(40-kv-quant §1-§3)."""
import numpy as np
import pytest
import torch

from dsattn import ops, quant, reference, testing

from conftest import randn

PAYLOADS = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def _bits_equal(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("dst", list(PAYLOADS))
def test_bit_exact_against_numpy_golden(dst, dtype, gen):
    x = randn(gen, 5, 3, 512, dtype=dtype, scale=3.0)
    x[0, 0, :128] = 0                                            # all-zero tile
    x[0, 1, 128:256] = -0.0                                      # all negative-zero tile
    x[1, 0, 7] = -0.0                                            # a signed zero in a live tile
    x[2, 2, 256:384] *= 1e-30 if dtype == torch.float32 else 1   # tiny (subnormal-scale) tile
    y, s = ops.dynamic_block_quant(x, dst)
    gy, gs = reference.dynamic_block_quant(x, dst)
    assert y.dtype == PAYLOADS[dst] and s.dtype == torch.float32 and s.shape == (5, 3, 4)
    assert _bits_equal(y, gy) and torch.equal(s.view(torch.int32), gs.view(torch.int32))
    assert (s[0, 0, 0].view(torch.int32) == 0) and (y[0, 0, :128].view(torch.uint8) == 0).all()
    assert (s[0, 1, 1].view(torch.int32) == 0) and (y[0, 1, 128:256].view(torch.uint8) == 0).all()
    assert torch.equal(ops.dequant_block(y, s), reference.dequant_block(y, s))


def test_hand_computed_tile():
    """amax 254 -> scale 2; 3 / 2 = 1.5 rounds to even 2, 5 / 2 = 2.5 to 2, -1 / 2 = -0.5 to -0."""
    x = torch.zeros(1, 128)
    x[0, :5] = torch.tensor([254.0, 3.0, 5.0, -1.0, -254.0])
    y, s = ops.dynamic_block_quant(x, "int8")
    assert s.item() == 2.0
    assert y[0, :5].tolist() == [127, 2, 2, 0, -127]
    y8, s8 = ops.dynamic_block_quant(x, "float8_e4m3fn")
    assert s8.item() == np.float32(254.0) / np.float32(448.0)
    assert y8[0, 0].float().item() == 448.0 and y8[0, 4].float().item() == -448.0


@pytest.mark.parametrize("dst", list(PAYLOADS))
def test_values_at_qmax_are_exact(dst, gen):
    """A tile whose amax equals qmax has scale 1: every representable value round-trips exactly."""
    q = QMAX[dst]
    x = (torch.rand(2, 256, generator=gen) * 2 - 1) * q
    x = x.round() if dst == "int8" else x.to(torch.float8_e4m3fn).float()     # representable values
    x[:, 0], x[:, 128] = q, -q
    y, s = ops.dynamic_block_quant(x, dst)
    assert (s == 1.0).all()
    assert torch.equal(ops.dequant_block(y, s), x)
    assert (y.float().abs().amax(-1) == q).all()


@pytest.mark.parametrize("dst", list(PAYLOADS))
def test_round_trip_error_bounds(dst, gen):
    x = randn(gen, 64, 512, scale=2.0)
    y, s = ops.dynamic_block_quant(x, dst)
    xh = ops.dequant_block(y, s)
    step = s.repeat_interleave(128, -1)
    err = (xh - x).abs()
    if dst == "int8":
        # half a quantisation step, plus the fp32 roundings of x / s and of y * s (each at most
        # 2^-24 relative to |x|: a value within that of a half step may round either way)
        assert (err <= 0.5 * step + x.abs() * 2 ** -23).all()
        assert (y.view(torch.int8) != -128).all()
    else:
        t = (x / step).abs()
        normal = t >= 2 ** -6                                  # e4m3 normal range: 3 mantissa bits
        assert (err[normal] <= 2 ** -4 * x.abs()[normal] * (1 + 1e-6)).all()
        assert (err[~normal] <= 2 ** -10 * step[~normal] * (1 + 1e-6)).all()
    rel = err / x.abs().clamp(min=1e-6)
    print(f"{dst}: max abs {err.max():.3g}, mean rel {rel.mean():.3g}")


def test_quant_errors(gen):
    x = randn(gen, 2, 256)
    with pytest.raises(NotImplementedError, match="dst_type"):
        ops.dynamic_block_quant(x, "hifloat8")
    with pytest.raises(ValueError, match="dst_type"):
        ops.dynamic_block_quant(x, "int4")
    with pytest.raises(TypeError, match="x"):
        ops.dynamic_block_quant(x.double())
    with pytest.raises(ValueError, match="^x"):
        ops.dynamic_block_quant(randn(gen, 2, 200))
    with pytest.raises(ValueError, match="tile_size"):
        ops.dynamic_block_quant(x, "int8", 0)
    bad = x.clone()
    bad[1, 3] = float("inf")
    with pytest.raises(ValueError, match="^x: .*non-finite"):
        ops.dynamic_block_quant(bad)


@pytest.mark.parametrize("rope", [0, 64])
@pytest.mark.parametrize("dst", list(PAYLOADS))
def test_packed_rows_layout(dst, rope, gen):
    assert quant.row_width(512, rope, 128) == {0: 528, 64: 656}[rope]
    y, s = ops.dynamic_block_quant(randn(gen, 3, 512), dst)
    r = randn(gen, 3, rope, dtype=torch.bfloat16) if rope else None
    packed = quant.pack_kv_rows(y, s, r)
    assert packed.dtype == PAYLOADS[dst] and packed.shape == (3, quant.row_width(512, rope))
    u8 = packed.view(torch.uint8)
    off = 512 + 2 * rope
    assert torch.equal(u8[:, off:off + 16].contiguous().view(torch.float32), s)
    if rope:
        assert torch.equal(u8[:, 512:640].contiguous().view(torch.bfloat16), r)
    ny, nr, ns = quant.unpack_kv_rows(packed, rope, torch.bfloat16)
    assert _bits_equal(ny, y) and torch.equal(ns, s) and (nr is None if not rope else torch.equal(nr, r))
    k, v = quant.dequant_kv_rows(packed, rope, torch.bfloat16)
    assert k.shape == (3, 512 + rope) and v.shape == (3, 512)
    assert torch.equal(v, ops.dequant_block(y, s).to(torch.bfloat16))


def _store_inputs(gen, T, rope, dtype=torch.bfloat16):
    kv = randn(gen, T, 512 + rope, dtype=dtype)
    gamma = randn(gen, 512, scale=0.2) + 1
    theta = torch.rand(T, rope, generator=gen) * 6
    return kv, gamma, (torch.cos(theta) if rope else None), (torch.sin(1.3 * theta) if rope else None)


@pytest.mark.parametrize("rotary_mode", [1, 2])
@pytest.mark.parametrize("rope", [0, 64])
@pytest.mark.parametrize("dst", list(PAYLOADS))
def test_store_against_golden_and_skips_minus_one(dst, rope, rotary_mode, gen):
    T, W = 9, quant.row_width(512, rope)
    kv, gamma, cos, sin = _store_inputs(gen, T, rope)
    cache = torch.randint(-128, 128, (4, 4, 1, W), generator=gen, dtype=torch.int8).view(PAYLOADS[dst])
    before = cache.clone()
    slots = torch.tensor([0, 3, -1, 5, 15, -1, 7, 8, 9], dtype=torch.int32)
    packed = ops.kv_rmsnorm_rope_quant_cache(kv, gamma, cos, sin, cache, slots, rope_head_dim=rope,
                                             rotary_mode=rotary_mode)
    gcache = before.clone()
    want = reference.kv_rmsnorm_rope_quant_cache(kv, gamma, cos, sin, gcache, slots, rope_head_dim=rope,
                                                 rotary_mode=rotary_mode)
    # 40 §3.4: rope and scales standard, dequantised nope within one quantisation step
    n, r, s = quant.unpack_kv_rows(packed, rope, torch.bfloat16)
    gn, gr, gs = quant.unpack_kv_rows(want, rope, torch.bfloat16)
    assert testing.standard_close(s, gs)
    if rope:
        assert testing.standard_close(r, gr)
    step = gs.repeat_interleave(128, -1)
    assert ((ops.dequant_block(n, s) - ops.dequant_block(gn, gs)).abs() <= step + 1e-6).all()
    flat, gflat, bflat = (c.view(-1, W).view(torch.uint8) for c in (cache, gcache, before))
    written = slots[slots >= 0].long()
    untouched = torch.ones(flat.size(0), dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat[untouched], bflat[untouched])     # -1 rows and the rest: bit-identical
    assert torch.equal(flat[written], packed.view(torch.uint8)[slots >= 0])


def test_store_errors(gen):
    kv, gamma, cos, sin = _store_inputs(gen, 3, 64)
    cache = torch.zeros(2, 4, 1, 656, dtype=torch.int8)
    slots = torch.tensor([0, 1, -1])
    f = ops.kv_rmsnorm_rope_quant_cache
    with pytest.raises(ValueError, match="slot_mapping"):
        f(kv, gamma, cos, sin, cache, torch.tensor([0, 8, 1]))
    with pytest.raises(ValueError, match="slot_mapping"):
        f(kv, gamma, cos, sin, cache, torch.tensor([0, -2, 1]))
    with pytest.raises(ValueError, match="kv_cache"):
        f(kv, gamma, cos, sin, torch.zeros(2, 4, 1, 528, dtype=torch.int8), slots)
    with pytest.raises(TypeError, match="kv_cache"):
        f(kv, gamma, cos, sin, cache.view(torch.uint8), slots)
    with pytest.raises(ValueError, match="cos"):
        f(kv, gamma, None, sin, cache, slots)
    with pytest.raises(ValueError, match="rope_head_dim"):
        f(kv, gamma, cos, sin, cache, slots, rope_head_dim=32)
    with pytest.raises(ValueError, match="tile_size"):
        f(kv, gamma, cos, sin, cache, slots, tile_size=64)
    with pytest.raises(ValueError, match="^kv"):
        f(kv[:, :520], gamma, cos, sin, cache, slots)
    with pytest.raises(TypeError, match="^kv"):
        f(kv.float(), gamma, cos, sin, cache, slots)
    with pytest.raises(ValueError, match="eps"):
        f(kv, gamma, cos, sin, cache, slots, eps=0.0)
