"""``fp8_block_linear`` (W8A16 over FP8 block-scaled weights) against its float64 golden: both compiled paths
(streamed for decode rows, tiled for prefill) on every ``DSATTN_CPU_ISA`` class, the PyTorch path, the edge
codes and scales, bad input."""
import pytest
import torch

import dsattn
from dsattn.weights import dispatch, e8m0_to_float, quantize_fp8_blocks, ref
from dsattn.weights.fast import linear_native, linear_torch
from dsattn.weights.problem import parse_fp8_linear

PATHS = {"streamed": -1, "tiled": 0}
# fp32 sums: a few ulps of each product's magnitude; 16-bit outputs add their own rounding
OUT_EPS = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _random_codes(N, K, gen):
    codes = torch.randint(0, 256, (N, K), dtype=torch.uint8, generator=gen)
    return torch.where(codes & 0x7F == 0x7F, codes ^ 0x01, codes)         # no NaN codes unless a test asks


def _check(y, x, codes, scale, block, bias=None):
    want = ref.fp8_block_linear(x, codes, scale, block, bias)
    bound = (x.double().abs().reshape(-1, x.shape[-1]) @ ref.dequantize(codes, scale, *block).abs().T).reshape(want.shape)
    tol = 2e-6 * bound + OUT_EPS[x.dtype] * want.abs() + 1e-30
    assert y.dtype == x.dtype and y.shape == want.shape
    err = (y.double() - want).abs()
    assert not torch.isnan(y).any() or torch.isnan(want).any(), "NaN never passes"
    finite = ~torch.isnan(want)
    assert torch.equal(torch.isnan(y), ~finite), "NaN exactly where the golden has one"
    bad = (err > tol) & finite
    assert not bad.any(), f"{int(bad.sum())} of {y.numel()} elements off; worst {float((err - tol)[finite].max()):.3g}"


def _run(path, x, codes, scale, block, bias=None):
    P = parse_fp8_linear(x, codes, scale, block, bias)
    return linear_torch(P) if path == "torch" else linear_native(P, PATHS[path])


@pytest.mark.parametrize("path", ["streamed", "tiled", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M,N,K,block", [(1, 300, 200, (128, 128)), (3, 129, 257, (128, 128)), (8, 64, 96, (32, 32)),
                                         (9, 17, 48, (1, 16)), (40, 576, 512, (128, 128)), (0, 32, 64, (128, 128)),
                                         (5, 7, 130, (64, 48))])
def test_matches_golden(path, dtype, M, N, K, block, gen):
    codes = _random_codes(N, K, gen)
    scale = torch.rand(-(-N // block[0]), -(-K // block[1]), generator=gen) * 0.02 + 1e-3
    x = torch.randn(M, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen) if M % 2 else None
    _check(_run(path, x, codes, scale, block, bias), x, codes, scale, block, bias)


@pytest.mark.parametrize("path", ["streamed", "tiled", "torch"])
def test_leading_dims_and_the_op(path, gen):
    w = torch.randn(192, 256, generator=gen)
    codes, scale = quantize_fp8_blocks(w)
    x = torch.randn(2, 3, 256, generator=gen)
    _check(_run(path, x, codes, scale, (128, 128)), x, codes, scale, (128, 128))
    y = dsattn.ops.fp8_block_linear(x, codes, scale, [128, 128])
    _check(y, x, codes, scale, (128, 128))
    assert dispatch.choose(parse_fp8_linear(x, codes, scale, [128, 128])).name == "compiled"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])     # (bf16: the vdpbf16ps route where it runs)
@pytest.mark.parametrize("path", ["streamed", "tiled", "torch"])
def test_zero_blocks_nan_codes_and_extreme_scales(path, dtype, gen):
    N, K, block = 260, 384, (128, 128)
    codes = _random_codes(N, K, gen)
    codes[:128, 128:256] = 0                        # a zero block
    codes[200, 300] = 0x7F                          # NaN codes: their rows' outputs are NaN, no other
    codes[5, 10] = 0xFF
    # ue8m0 extremes, with codes small enough that the products stay finite: 2^127 on the smallest codes
    # (subnormals, 2^-9 .. 7 x 2^-9), 2^-127 (an fp32 subnormal) elsewhere
    codes[128:256, :128] = torch.randint(0, 8, (128, 128), dtype=torch.uint8, generator=gen)
    e8 = torch.full((3, 3), 120, dtype=torch.uint8)
    e8[1, 0], e8[0, 2] = 254, 0
    scale = e8m0_to_float(e8)
    assert scale[1, 0] == 2.0 ** 127 and scale[0, 2] == 2.0 ** -127
    x = (torch.randn(4, K, generator=gen) * 1e-3).to(dtype)
    y = _run(path, x, codes, scale, block)
    _check(y, x, codes, scale, block)
    assert torch.isnan(y[:, 200]).all() and torch.isnan(y[:, 5]).all()
    assert torch.isfinite(y[:, 128:200]).all() and y[:, 128:200].abs().max() > 1e30
    # the same scales given as e8m0 to the op
    _check(dsattn.ops.fp8_block_linear(x, codes, e8.view(torch.float8_e8m0fnu), [128, 128]), x, codes, scale, block)


def test_quantize_round_trip():
    w = torch.randn(300, 200)
    for ue8m0 in (False, True):
        codes, scale = quantize_fp8_blocks(w, (128, 128), ue8m0=ue8m0)
        assert codes.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
        back = ref.dequantize(codes, scale, 128, 128).float()
        assert (back - w).abs().max() <= w.abs().max() * 2 ** -3
        if ue8m0:
            assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))


def test_bad_input_is_named():
    codes, scale = quantize_fp8_blocks(torch.randn(256, 256))
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match=r"weight_scale: expected shape \[ceil\(N / 128\), ceil\(K / 128\)\] = \[2, 2\]"):
        dsattn.ops.fp8_block_linear(x, codes, scale[:1], [128, 128])
    with pytest.raises(ValueError, match="block_size"):
        dsattn.ops.fp8_block_linear(x, codes, scale, [0, 128])
    with pytest.raises(TypeError, match="weight: expected float8_e4m3fn"):
        dsattn.ops.fp8_block_linear(x, codes.float(), scale, [128, 128])
    with pytest.raises(TypeError, match="weight_scale: expected float32 or float8_e8m0fnu"):
        dsattn.ops.fp8_block_linear(x, codes, scale.half(), [128, 128])
    with pytest.raises(TypeError, match="x: expected"):
        dsattn.ops.fp8_block_linear(x.double(), codes, scale, [128, 128])
    with pytest.raises(ValueError, match="x: last dim 255"):
        dsattn.ops.fp8_block_linear(x[:, :255], codes, scale, [128, 128])
    with pytest.raises(ValueError, match=r"bias: expected \[N=256\]"):
        dsattn.ops.fp8_block_linear(x, codes, scale, [128, 128], torch.zeros(3))


def test_fake_kernel_traces():
    codes, scale = quantize_fp8_blocks(torch.randn(64, 128))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(3, 5, 128, dtype=torch.bfloat16))
        y = torch.ops.dsattn.fp8_block_linear(x, mode.from_tensor(codes), mode.from_tensor(scale), [128, 128])
    assert y.shape == (3, 5, 64) and y.dtype == torch.bfloat16


# ---- MXFP4 (DeepSeek-V4's routed experts) ----

def _run_fp4(path, x, codes, scale, bias=None):
    from dsattn.weights.problem import parse_mxfp4_linear
    P = parse_mxfp4_linear(x, codes, scale, bias)
    return linear_torch(P) if path == "torch" else linear_native(P, PATHS[path])


def _check_fp4(y, x, codes, scale, bias=None):
    want = ref.mxfp4_linear(x, codes, scale, bias)
    w = ref.dequantize_mxfp4(codes, scale)
    bound = (x.double().abs().reshape(-1, x.shape[-1]) @ w.abs().T).reshape(want.shape)
    tol = 2e-6 * bound + OUT_EPS[x.dtype] * want.abs() + 1e-30
    assert y.dtype == x.dtype and y.shape == want.shape
    finite = ~torch.isnan(want)
    assert torch.equal(torch.isnan(y), ~finite), "NaN exactly where the golden has one"
    bad = ((y.double() - want).abs() > tol) & finite
    assert not bad.any(), f"{int(bad.sum())} of {y.numel()} elements off"


@pytest.mark.parametrize("path", ["streamed", "tiled", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M,N,K", [(1, 300, 64), (3, 129, 288), (8, 64, 512), (9, 17, 32), (40, 100, 544), (0, 8, 64)])
def test_mxfp4_matches_golden(path, dtype, M, N, K, gen):
    codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(120, 131, (N, K // 32), dtype=torch.uint8, generator=gen)   # ue8m0: 2^-7 .. 2^3
    x = torch.randn(M, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen) if M % 2 else None
    _check_fp4(_run_fp4(path, x, codes, scale, bias), x, codes, scale, bias)


@pytest.mark.parametrize("path", ["streamed", "tiled", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_extreme_scales_and_the_op(path, dtype, gen):
    N, K = 40, 256
    codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    scale = torch.full((N, K // 32), 127, dtype=torch.uint8)
    scale[:10, 2] = 254                  # 2^127 on codes of 0.5 at most: 2^126 products of x ~ 1e-3
    codes[:10, 32:48] &= 0x99            # (magnitudes 0 / 0.5 only)
    scale[10:20, 5] = 0                  # 2^-127, an fp32 subnormal
    scale[20, 1] = 255                   # NaN scale: that row's outputs NaN
    x = (torch.randn(6, K, generator=gen) * 1e-3).to(dtype)
    y = _run_fp4(path, x, codes, scale)
    _check_fp4(y, x, codes, scale)
    assert torch.isnan(y[:, 20]).all() and torch.isfinite(y[:, :20]).all() and y[:, :10].abs().max() > 1e30
    # the op, with the scales as float8_e8m0fnu
    _check_fp4(dsattn.ops.mxfp4_linear(x, codes, scale.view(torch.float8_e8m0fnu)), x, codes, scale)
    # ue8m0 bytes are read as they are: the same bits as their fp32 widening
    assert _same_bits(y, _run_fp4(path, x, codes, e8m0_to_float(scale)))


@pytest.mark.parametrize("path", ["streamed", "tiled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_scales_either_side_of_the_fold(path, dtype, gen):
    """ue8m0 scales at both edges of the range the vdpbf16ps route folds into the codes (2^-63 .. 2^63) and past
    them, mixed within rows; fp32 scales that are not powers of two; both against the golden, and ue8m0 against its
    fp32 widening bit for bit (a power of two folds whichever type carries it)."""
    N, K = 70, 512
    codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    edges = torch.tensor([62, 63, 64, 65, 120, 127, 131, 189, 190, 191, 192], dtype=torch.uint8)
    scale = edges[torch.randint(0, len(edges), (N, K // 32), generator=gen)]
    x = torch.randn(5, K, generator=gen).to(dtype)
    y = _run_fp4(path, x, codes, scale)
    _check_fp4(y, x, codes, scale)
    assert _same_bits(y, _run_fp4(path, x, codes, e8m0_to_float(scale)))
    arbitrary = torch.rand(N, K // 32, generator=gen) * 4 + 0.01
    _check_fp4(_run_fp4(path, x, codes, arbitrary), x, codes, arbitrary)


def _same_bits(a, b) -> bool:
    """Bitwise equal (NaN where the other has NaN, its payload aside)."""
    a, b = a.float(), b.float()
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0).view(torch.int32),
                                                                       b.nan_to_num(0.0).view(torch.int32))


@pytest.mark.parametrize("path", ["streamed", "tiled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_ue8m0_scales_read_as_fp32_would_be(path, dtype, gen):
    N, K = 200, 320
    codes = (torch.randn(N, K, generator=gen) * 50).to(torch.float8_e4m3fn)
    e8 = torch.randint(110, 140, (2, 3), dtype=torch.uint8, generator=gen)
    x = torch.randn(5, K, generator=gen).to(dtype)
    y = _run(path, x, codes, e8.view(torch.float8_e8m0fnu), (128, 128))
    assert _same_bits(y, _run(path, x, codes, e8m0_to_float(e8), (128, 128)))
    _check(y, x, codes, e8m0_to_float(e8), (128, 128))


def test_mxfp4_round_trip_and_bad_input():
    from dsattn.weights import quantize_mxfp4
    w = torch.randn(50, 96)
    codes, scale = quantize_mxfp4(w)
    assert codes.shape == (50, 48) and scale.shape == (50, 3)
    back = ref.dequantize_mxfp4(codes, scale).float()
    group_max = w.abs().reshape(50, 3, 32).amax(-1).repeat_interleave(32, 1)
    assert ((back - w).abs() <= group_max / 4 + 1e-6).all()       # within half e2m1's coarsest step of the group
    x = torch.randn(2, 96)
    with pytest.raises(ValueError, match=r"weight_scale: expected shape \[N, K / 32\] = \[50, 3\]"):
        dsattn.ops.mxfp4_linear(x, codes, scale[:, :2])
    with pytest.raises(ValueError, match="x: last dim 95 must equal 2 x weight's packed columns = 96"):
        dsattn.ops.mxfp4_linear(x[:, :95], codes, scale)
    with pytest.raises(TypeError, match="weight: expected e2m1 codes packed two a byte"):
        dsattn.ops.mxfp4_linear(x, codes.float(), scale)
    with pytest.raises(ValueError, match="a multiple of 32"):
        dsattn.ops.mxfp4_linear(torch.randn(2, 80), codes[:, :40], scale[:, :2])


# ---- batch invariance ----

INVARIANCE_ROWS = list(range(1, 18)) + [31, 32, 33, 64, 65, 129, 200]


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.dtype != torch.float32 else t.contiguous().view(torch.int32)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_batch_invariant_mode_sums_each_row_in_one_order(fmt, dtype, gen, native_module):
    """In the batch-invariant mode a row's bits do not depend on M, on where it sits in the call or on the threads:
    every slice of rows called alone (every M from 1 to 17, then past the streamed path's groups and the tiled path's
    panels) gives its rows of the 200-row call, on 1 thread as on 2, and one row alone gives the decode path's bits
    (the default mode's for M 1)."""
    if native_module is None:
        pytest.skip("the promise is the compiled kernel's")
    from dsattn.cases.invariance import on_threads
    from dsattn.weights import batch_invariant
    N, K = 203, 320
    if fmt == "fp8":
        codes = _random_codes(N, K, gen)
        scale = torch.randint(118, 130, (2, 3), dtype=torch.uint8, generator=gen)       # ue8m0, K's last block partial

        def op(a):
            return dsattn.ops.fp8_block_linear(a, codes, scale, [128, 128])
    else:
        codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
        scale = torch.randint(118, 130, (N, K // 32), dtype=torch.uint8, generator=gen)

        def op(a):
            return dsattn.ops.mxfp4_linear(a, codes, scale)
    x = torch.randn(max(INVARIANCE_ROWS), K, generator=gen).to(dtype)
    with batch_invariant():
        full = op(x)
        assert torch.equal(_bits(on_threads(1, lambda: op(x))), _bits(full)), "1 thread against 2"
        for M in INVARIANCE_ROWS:
            for start in sorted({0, 7, x.shape[0] - M} & set(range(0, x.shape[0] - M + 1))):
                got = op(x[start:start + M])
                assert torch.equal(_bits(got), _bits(full[start:start + M])), f"rows {start}..{start + M - 1} alone"
    for i in (0, 57, 199):
        assert torch.equal(_bits(op(x[i:i + 1])), _bits(full[i:i + 1])), f"row {i}: the default mode's decode call"
    if fmt == "fp8":
        _check(full, x, codes, e8m0_to_float(scale), (128, 128))


def test_batch_invariant_mode_switches(monkeypatch):
    from dsattn.weights import batch_invariant, invariance
    monkeypatch.delenv(invariance.ENV, raising=False)
    assert not invariance.requested()
    monkeypatch.setenv(invariance.ENV, "1")
    assert invariance.requested()
    with batch_invariant(False):
        assert not invariance.requested()
        with batch_invariant():
            assert invariance.requested()
    monkeypatch.setenv(invariance.ENV, "sometimes")
    with pytest.raises(ValueError, match="DSATTN_BATCH_INVARIANT='sometimes': expected 1 or 0"):
        invariance.requested()
