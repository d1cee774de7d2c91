"""The compiled CPU kernels against the golden, beside the PyTorch paths they replace.

Attention forward and backward (dsattn/native/attention.cpp): layouts, ratios, dtypes, paged caches, ragged and
empty rows, -1 padding, NaN in every cache row no index references, odd head counts and head dims.
Indexer top-k (dsattn/native/indexer.cpp): exact ties in the golden's order over BSND, TND and paged
keys, and the scores against float64 math."""
import pytest
import torch

from dsattn import cases, native, ops, reference, testing, verify
from dsattn.indexer import fast as indexer_fast
from dsattn.sparse_mla import fast

from conftest import assert_draws

# the CPU lacks AVX512-BF16, or DSATTN_CPU_ISA caps the layer below it
NO_AVX512BF16 = "this CPU has no AVX512-BF16|caps the kernels below AVX512-BF16"

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _force_gemm(request, module, path):
    """Run the compiled kernels on GEMM path ``path`` for this test (skipped where the CPU lacks it)."""
    if path == "avx512bf16" and not module.cpu_has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16")
    if path == "onednn" and not module.bf16_gemm_choice()["onednn_runs"]:
        pytest.skip("oneDNN's avx512_core_bf16 ukernel is the path of AVX512-BF16 CPUs without AMX; not this one")
    module.set_gemm_path(path)
    request.addfinalizer(lambda: module.set_gemm_path(native.gemm_requested()))
    if path not in ("best", "own"):
        assert module.attention_gemm("bfloat16") == path


@pytest.fixture(params=["native", "native-avx512bf16", "native-onednn", "native-fp32", "torch"])
def path(request, monkeypatch, native_module):
    """Which CPU forward runs; 'native' also counts the compiled calls so a test sees it ran.
    'native-fp32' forces the compiled kernels' fp32 GEMMs (the AVX2-only machines' path) on this CPU,
    'native-avx512bf16' the vdpbf16ps micro-kernel and 'native-onednn' oneDNN's avx512_core_bf16 ukernel (the
    paths of AVX512-BF16 CPUs without AMX)."""
    calls = []
    if request.param == "torch":
        monkeypatch.setattr(fast, "native_sources", lambda P: None)
        monkeypatch.setattr(indexer_fast, "native_indexer", lambda P: None)
    else:
        if native_module is None:
            pytest.skip(f"no compiled layer here: {native.status()}")
        if request.param != "native":
            _force_gemm(request, native_module, request.param.split("-", 1)[1])
        for owner, name in ((fast, "_forward_native"), (fast, "_backward_native"), (indexer_fast, "_native_topk")):
            real = getattr(owner, name)

            def counted(*a, _real=real, **k):
                calls.append(1)
                return _real(*a, **k)
            monkeypatch.setattr(owner, name, counted)
    return request.param, calls


def own_gemm_or_skip(dtype):
    """Ends a test here (skipped, with the reason) where ``dtype``'s GEMMs are oneDNN's: the invariance checked
    after it (rows alone and in a call, one thread or two) is promised on dsattn's own GEMMs only."""
    if not native.gemm_is_own(dtype):
        pytest.skip(f"{dtype} runs on oneDNN's {native.kernels().attention_gemm(str(dtype).split('.')[-1])} kernel "
                    "here: a vendor library's kernel choice, no invariance promised (the 'own' path is checked)")


@pytest.fixture(params=["best", "own", "avx512bf16", "onednn", "fp32"])
def gemm_module(request, native_module):
    """The compiled module with its GEMM path set: the CPU's best, dsattn's own kernels only, or one forced (the
    vdpbf16ps micro-kernel or oneDNN's ukernel of AVX512-BF16 CPUs without AMX, the fp32 path of AVX2-only
    machines)."""
    if native_module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    _force_gemm(request, native_module, request.param)
    return native_module


def _forward_rows(**case_args):
    """attn_out and softmax_lse of ``cases.mla_case(**case_args)`` against the golden."""
    assert_draws(lambda seed: [r for r in verify.mla_rows(cases.mla_case(seed=seed, **case_args))
                               if r.output in ("attn_out", "softmax_lse")], outputs={"attn_out", "softmax_lse"})


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "PA_BBND"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("ratio", [1, 4, 128])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_forward_equals_golden(path, layout, ratio, dtype, paged):
    _forward_rows(layout=layout, ratio=ratio, dtype=dtype, paged=paged)
    assert bool(path[1]) == (path[0] != "torch")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("ratio", [1, 4, 128])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_backward_equals_golden(path, layout, ratio, dtype):
    """Every output of sparse_flash_mla_grad (dq, dori_kv, dcmp_kv, dsinks, the L1 norms)."""
    assert_draws(lambda seed: verify.mla_rows(cases.mla_case(layout, ratio, dtype, seed=seed)),
                 outputs={"dq", "dori_kv", "dsinks"} | ({"dcmp_kv"} if ratio > 1 else set()))
    assert bool(path[1]) == (path[0] != "torch")


@pytest.mark.parametrize("path", ["native", "native-fp32"], indirect=True)   # (the blocks are the compiled path's)
@pytest.mark.parametrize("ratio", [1, 4])
def test_rows_in_blocks(path, ratio, monkeypatch):
    """Long calls go to the kernels in blocks of rows, each written into its rows of the op's outputs
    (forward: out and lse; backward: dq) and its key gradients summed: blocks of 5 rows here."""
    monkeypatch.setattr(fast, "_native_block_rows", lambda P, R: 5)
    assert_draws(lambda seed: verify.mla_rows(cases.mla_case("TND", ratio, torch.bfloat16, seed=seed)))
    assert len(path[1]) >= 2


@pytest.mark.parametrize("H, D", [(3, 33), (20, 48), (80, 24)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_odd_heads_and_dims(path, H, D, dtype):
    """Head counts padded to 16 (and past one 64-head panel), head dims padded to 16 (odd ones too):
    forward and backward."""
    assert_draws(lambda seed: verify.mla_rows(cases.mla_case("TND", 4, dtype, H=H, D=D, seed=seed)))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_forward_many_keys_per_row(path, dtype):
    """Rows over several 64-key blocks: a 100-key window and 96 compressed keys, ragged."""
    _forward_rows(layout="TND", ratio=4, dtype=dtype, window=100, topk=96, lengths=[(7, 700), (0, 50), (3, 130)])


@pytest.mark.parametrize("scale", [-0.3, 0.0], ids=["negative", "zero"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_forward_non_positive_scale(path, dtype, scale):
    """bf16 rows take the maximum of the raw scores and scale it once, which is the maximum of the
    scaled scores only for a positive scale; a zero or negative softmax_scale scales them first.
    (Against the golden in the same dtype: the float64 checks' statistics assume a usual scale.)"""
    case = cases.mla_case("TND", 4, dtype, seed=torch.randint(0, 2**31 - 1, ()).item())
    case.kwargs["softmax_scale"] = scale
    out, lse = ops.sparse_flash_mla(case.q, return_softmax_lse=True, **case.kwargs)
    ref_out, ref_lse = reference.sparse_flash_mla(case.q, return_softmax_lse=True, **case.kwargs)
    used = ~torch.isnan(case.q).any(-1)                        # padding rows are not compared
    # summation order only: two ulps of a half-precision output (a rounding flip); fp32 sums of
    # ~100 terms differ by a few ulps
    tol = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(out[used].float(), ref_out[used].float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse[0][used], ref_lse[0][used], rtol=1e-5, atol=1e-5)   # lse [N_kv, T, H]
    assert bool(path[1]) == (path[0] != "torch")


@pytest.mark.parametrize("sink", [float("inf"), float("-inf")])
def test_forward_infinite_sinks(path, sink):
    case = cases.mla_case("BSND", 4, torch.bfloat16, seed=torch.randint(0, 2**31 - 1, ()).item())
    case.kwargs["sinks"][::2] = sink
    out, lse = ops.sparse_flash_mla(case.q, return_softmax_lse=True, **case.kwargs)
    ref_out, ref_lse = reference.sparse_flash_mla(case.q, return_softmax_lse=True, **case.kwargs)
    used = ~torch.isnan(case.q).any(-1)                        # padding rows are not compared
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert torch.allclose(out[used].float(), ref_out[used].float(), atol=2e-2)
    assert not torch.isnan(out[used]).any()


def test_packed_layout_is_the_ukernels(native_module):
    module = native_module
    if module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    for K, N in [(64, 64), (640, 64), (2, 16), (130, 48)]:
        same = module.packed_layout_matches(K, N)
        if same is None:
            pytest.skip("this CPU has no packed bf16 GEMM (the fp32 GEMM path runs)")
        assert same, (K, N)


@pytest.mark.parametrize("M, K, N", [(64, 640, 512), (64, 640, 576), (16, 130, 1040), (128, 64, 48), (3, 2, 16),
                                     (9, 14, 48), (17, 66, 16)])
def test_gemm_through_wide_packed_panels_is_a_matmul(gemm_module, M, K, N):
    # panels wider than cpublas::pack writes (up to 512 columns): the ukernel must read them as
    # [K/2][w][2], and so must the vdpbf16ps micro-kernel (row blocks of 1..8, masked column edges);
    # bf16 products are exact in fp32, so only the fp32 summation order differs
    err = gemm_module.packed_gemm_error(M, K, N)
    if err is None:
        assert gemm_module.attention_gemm("bfloat16") == "fp32"
        pytest.skip("bf16 runs the fp32 GEMM path here")
    assert err <= K * 2.0 ** -24, err


def test_native_rejects_rows_out_of_range(native_module):
    module = native_module
    if module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    q = torch.randn(2, 4, 32).bfloat16()
    src = torch.randn(10, 32).bfloat16()
    rows = torch.tensor([[0, 9, -1], [3, 10, 2]])
    with pytest.raises(IndexError, match="out of range"):
        module.sparse_attention_forward(q, [src], [rows], None, 1.0)
    with pytest.raises(RuntimeError, match="dtype"):
        module.sparse_attention_forward(q.double(), [src.double()], [rows.clamp(max=9)], None, 1.0)
    ok = rows.clamp(max=9)
    with pytest.raises(RuntimeError, match="out: expected"):
        module.sparse_attention_forward(q, [src], [ok], None, 1.0, out=torch.empty(2, 4, 32))
    with pytest.raises(RuntimeError, match="lse: expected"):
        module.sparse_attention_forward(q, [src], [ok], None, 1.0, lse=torch.empty(4, 2))
    # given outputs are written in place and returned
    out, lse = torch.full_like(q, float("nan")), torch.full((2, 4), float("nan"))
    o, l = module.sparse_attention_forward(q, [src], [ok], None, 1.0, out=out, lse=lse)
    want_o, want_l = module.sparse_attention_forward(q, [src], [ok], None, 1.0)
    assert o.data_ptr() == out.data_ptr() and l.data_ptr() == lse.data_ptr()
    assert torch.equal(out, want_o) and torch.equal(lse, want_l)
    # the backward's dq: checked, and written in place when given
    dout = torch.randn_like(q)
    grad = lambda **kw: module.sparse_attention_backward(q, dout, want_o, want_l, [src], [ok], None, 1.0, **kw)  # noqa: E731
    with pytest.raises(RuntimeError, match="dq: expected"):
        grad(dq=torch.empty(2, 4, 32))
    dq = torch.full_like(q, float("nan"))
    assert grad(dq=dq)[0].data_ptr() == dq.data_ptr() and torch.equal(dq, grad()[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("H", [16, 64, 72, 128])
def test_rows_split_over_heads_give_the_whole_rows_bits(gemm_module, H, dtype, gen):
    """With fewer rows than threads each row's heads are split into groups over the threads (a decode
    step of one request): every row's bits equal those it gets computed whole, among many rows."""
    module = gemm_module
    own_gemm_or_skip(dtype)
    R, D, W = 6, 80, 300
    q = torch.randn(R, H, D, generator=gen).to(dtype)
    src = torch.randn(500, D, generator=gen).to(dtype)
    rows = torch.randint(0, 500, (R, W), generator=gen)
    rows[torch.rand(rows.shape, generator=gen) < 0.2] = -1
    sinks = torch.randn(H, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        whole = module.sparse_attention_forward(q, [src], [rows], sinks, 0.1)           # R >= threads: whole rows
        for r in range(R):                                                               # one row: heads split
            alone = module.sparse_attention_forward(q[r:r + 1].contiguous(), [src], [rows[r:r + 1]], sinks, 0.1)
            assert torch.equal(alone[0][0], whole[0][r]) and torch.equal(alone[1][0], whole[1][r]), r
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "PA_BBND"])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_indexer_exact_ties_in_the_golden_order(path, layout, paged, dtype):
    """Small integers: every score is exact in every dtype, ties are real; indices and values must
    equal the golden's exactly (ties to the lower key)."""
    case = cases.indexer_case(layout, 4, dtype, paged=paged, integer=True, seed=torch.randint(0, 2**31 - 1, ()).item())
    k, w, topk = case.extra["k"], case.extra["w"], case.extra["topk"]
    i1, v1 = ops.lightning_indexer(case.q, k, w, topk, **case.kwargs)
    i2, v2 = reference.lightning_indexer(case.q, k, w, topk, **case.kwargs)
    assert torch.equal(i1, i2) and torch.equal(v1, v2)
    assert (i1 >= 0).any()
    assert bool(path[1]) == (path[0] != "torch")


@pytest.mark.parametrize("R, H, D, N, page", [(5, 3, 33, 300, 300), (2, 80, 16, 64, 7), (7, 64, 128, 600, 64),
                                              (1, 4, 8, 1, 1), (40, 5, 33, 700, 64), (30, 64, 128, 1500, 1500),
                                              (20, 16, 32, 90, 7)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_indexer_topk_against_float64(R, H, D, N, page, dtype, gemm_module):
    """topk = every key: the kernel's values are each row's scores in order, against float64 math;
    keys reached through pages of ``page`` rows laid out in reverse, the unused rows NaN.  Rows of a
    request are contiguous, as the op lays them out: long runs take the shared-key path (keys packed
    once per block of rows), short ones the per-row path."""
    module = gemm_module
    P = -(-N // page)
    keys = torch.full((P * page + 5, D), float("nan")).to(dtype)
    logical = torch.randn(N, D).to(dtype)
    starts = (torch.arange(P - 1, -1, -1) * page + 5)[None, :].repeat(2, 1)       # batch 0 and 1, same pages
    for j in range(N):
        keys[starts[0, j // page] + j % page] = logical[j]
    q, w = torch.randn(R, H, D).to(dtype), torch.rand(R, H) + 0.1
    n = torch.randint(0, N + 1, (R,))
    n[0] = N
    batch = torch.sort(torch.randint(0, 2, (R,))).values
    vals, idx = module.indexer_topk(q, keys, starts, page, batch, n, w, N)
    exact = torch.einsum("rh,rhn->rn", w.double(), torch.relu(torch.einsum("rhd,nd->rhn", q.double(), logical.double())))
    for t in range(R):
        m = int(n[t])
        want = torch.sort(exact[t, :m], descending=True).values
        assert torch.allclose(vals[t, :m].double(), want, rtol=1e-5, atol=1e-4 * H)
        assert torch.allclose(exact[t, idx[t, :m].long()], vals[t, :m].double(), rtol=1e-5, atol=1e-4 * H)
        assert sorted(idx[t, :m].tolist()) == list(range(m))
        assert torch.isneginf(vals[t, m:]).all() and (idx[t, m:] == -1).all()


@pytest.mark.parametrize("topk", [1, 7, 64, 300])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_indexer_topk_streaming_selection_keeps_the_golden_order(topk, dtype, gemm_module):
    """Many keys (several chunks, selections that trim the candidates to topk more than once), small
    integers (exact scores, many ties), a few NaN keys (NaN scores rank first, as torch.topk ranks
    them): indices and values equal a stable descending sort exactly, ties to the lower key; the
    per-row offset is added to kept indices only.  Two requests: 6 rows on the per-row path, 24 on the
    shared-key path (over more keys than one packed block holds)."""
    module = gemm_module
    R, H, D, N, page = 30, 8, 32, 2200, 100
    keys = torch.randint(-3, 4, (N, D)).to(dtype)
    nan_keys = torch.randperm(N)[:3]
    keys[nan_keys] = float("nan")
    pages = (torch.arange(N // page) * page)[None, :]
    q, w = torch.randint(-3, 4, (R, H, D)).to(dtype), torch.randint(1, 3, (R, H)).float()
    n = torch.cat([torch.tensor([N, N - 1, 513, 37, 0, 650]), torch.randint(0, N + 1, (R - 6,))])
    n[-1] = N
    batch = torch.tensor([0] * 6 + [1] * (R - 6))         # 6 rows (per-row path), then 24 (shared-key path)
    offset = torch.randint(0, 50, (R,))
    vals, idx = module.indexer_topk(q, keys, pages.repeat(2, 1), page, batch, n, w, topk, offset)
    exact = torch.einsum("rh,rhn->rn", w.double(), torch.relu(torch.einsum("rhd,nd->rhn", q.double(), keys.double())))
    for t in range(R):
        m = min(int(n[t]), topk)
        row = exact[t, : int(n[t])].tolist()
        want = sorted(range(len(row)), key=lambda j: (row[j] == row[j], -row[j] if row[j] == row[j] else 0, j))[:m]
        assert idx[t, :m].tolist() == [j + int(offset[t]) for j in want]
        assert torch.allclose(vals[t, :m].double(), exact[t, want], rtol=0, atol=0, equal_nan=True)
        assert (idx[t, m:] == -1).all() and torch.isneginf(vals[t, m:]).all()


def test_indexer_topk_rejects_pages_out_of_range(native_module):
    module = native_module
    if module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    q, keys, w = torch.randn(1, 4, 16).bfloat16(), torch.randn(10, 16).bfloat16(), torch.rand(1, 4)
    args = (torch.tensor([[0, 8]]), 4, torch.tensor([0]))
    module.indexer_topk(q, keys, *args, torch.tensor([6]), w, 4)        # rows 0-3, 8-9: in range
    with pytest.raises(IndexError, match="not within"):
        module.indexer_topk(q, keys, *args, torch.tensor([7]), w, 4)    # row 10
    with pytest.raises(IndexError, match="not covered"):
        module.indexer_topk(q, keys, *args, torch.tensor([9]), w, 4)    # a third page
    with pytest.raises(RuntimeError, match="keys"):
        module.indexer_topk(q, keys.float(), *args, torch.tensor([6]), w, 4)
    with pytest.raises(RuntimeError, match="offset: expected an int64"):
        module.indexer_topk(q, keys, *args, torch.tensor([6]), w, 4, torch.tensor([1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="offset: expected an int64"):
        module.indexer_topk(q, keys, *args, torch.tensor([6]), w, 4, torch.tensor([1, 2]))


def test_native_gemm_setting_is_checked(monkeypatch, native_module):
    monkeypatch.setenv("DSATTN_NATIVE_GEMM", "fp16")
    with pytest.raises(ValueError, match="DSATTN_NATIVE_GEMM: expected 'own', 'fp32', 'avx512bf16', 'onednn' or unset, got 'fp16'"):
        native.gemm_requested()
    monkeypatch.setenv("DSATTN_NATIVE_GEMM", "FP32")
    assert native.fp32_requested()
    monkeypatch.setenv("DSATTN_NATIVE_GEMM", "avx512bf16")
    assert native.gemm_requested() == "avx512bf16"
    with pytest.raises(ValueError, match="gemm_path: expected one of"):
        with native.gemm_path("amx"):
            pass
    if native_module is not None:
        with pytest.raises(ValueError, match="gemm path: expected 'best', 'own', 'avx512bf16', 'onednn' or 'fp32', got 'fp16'"):
            native_module.set_gemm_path("fp16")
        if not native_module.cpu_has_avx512bf16():
            with pytest.raises(ValueError, match=NO_AVX512BF16):
                native_module.set_gemm_path("avx512bf16")


@pytest.mark.parametrize("cache_mode", [1, 2])
@pytest.mark.parametrize("packed", [False, True], ids=["3D", "2D"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("combo", [(64, 2, 4), (32, 1, 16)], ids=["coff2-r4", "coff1-r16"])
@pytest.mark.parametrize("pool_path", ["native", "torch"])
def test_compressor_pool_equals_golden(pool_path, combo, dtype, packed, cache_mode, monkeypatch, native_module):
    """The compressor's pooling (dsattn/native/compressor.cpp) and the PyTorch gathers it replaces, in both
    the inference op and the training op's forward: ragged batches starting mid-group (state rows read
    back), tails, unbacked locations, NaN in every state row the call must not read."""
    from types import SimpleNamespace
    from dsattn.compressor import fast as compressor_fast
    calls = []
    if pool_path == "torch":
        monkeypatch.setattr(compressor_fast, "native", SimpleNamespace(load=lambda: None, kernels=lambda: None))
    else:
        if native_module is None:
            pytest.skip(f"no compiled layer here: {native.status()}")

        def counted(*a):
            calls.append(1)
            return native_module.compressor_pool(*a)
        monkeypatch.setattr(compressor_fast, "native", SimpleNamespace(load=lambda: SimpleNamespace(
            compressor_pool=counted), kernels=lambda: native_module))
    D, coff, r = combo

    def draw(seed):
        case = cases.compressor_case(D=D, coff=coff, r=r, H=24, dtype=dtype, packed=packed, cache_mode=cache_mode,
                                     starts=(0, 2 * r + 1, 3, r), lengths=(3 * r + 1, r + 2, 0, 1),
                                     rope_head_dim=16, seed=seed, block_size=8)
        args, kw = case.inference_args()
        got = ops.compressor_inference(*args, **kw)
        want = reference.compressor_inference(*case.inference_args()[0], compute_dtype=torch.float64, **kw)
        x, wkv, wgate, state, ape, rr = case.clone_args()
        out = ops.compressor(x, wkv, wgate, state, ape, rr, **case.kwargs)
        want_c = reference.compressor(*case.clone_args(), compute_dtype=torch.float64, **case.kwargs)
        assert not got.isnan().any() and not out.isnan().any()
        return [("cmp_kv (inference)", testing.compare(got, want.to(got.dtype))),
                ("cmp_kv", testing.compare(out, want_c.to(out.dtype)))]

    base = int(torch.randint(0, 2**31 - 16, ()).item())
    failed = testing.check_draws(draw, range(base, base + 8))     # 512-element outputs: statistics pooled
    assert not failed, "\n".join(failed)
    assert calls and len(calls) % 2 == 0 if pool_path == "native" else not calls


def test_compressor_pool_rejects_rows_outside_its_sources(native_module):
    if native_module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    kv = torch.randn(4, 8)
    kind = torch.ones(1, 2, dtype=torch.long)
    at = torch.tensor([[0, 4]])
    with pytest.raises(RuntimeError, match="new_at"):
        native_module.compressor_pool(kv, kv, torch.zeros(0, 8), kind, at, torch.zeros_like(at),
                                      torch.ones(1, dtype=torch.bool), 1)
    with pytest.raises(RuntimeError, match="state_at"):
        native_module.compressor_pool(kv, kv, torch.zeros(2, 8), kind + 1, torch.zeros_like(at), at - 3,
                                      torch.ones(1, dtype=torch.bool), 1)
    with pytest.raises(RuntimeError, match="state: rows of D"):
        native_module.compressor_pool(kv, kv, torch.zeros(2, 5), kind, at - 4, at - 4, torch.ones(1, dtype=torch.bool), 1)


def test_paged_rows_equal_locate_and_flat_index(native_module, gen):
    """KVSource.rows_index (one compiled call for paged CPU caches) gives locate + flat_index's numbers,
    including for masked-in keys whose table entry is bad when nothing checks, and the same error
    when the check is on."""
    if native_module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    from dsattn.common.layout import PAGED, KVSource
    nb, bs, B, nbt = 7, 4, 3, 5
    table = torch.randint(0, nb, (B, nbt), generator=gen, dtype=torch.int32)
    table[1, 3] = -1
    table[2, 1] = nb + 2
    src = KVSource("ori_kv", torch.randn(nb, bs, 1, 8), PAGED, torch.full((B,), nbt * bs), nbt * bs,
                   block_table=table, table_name="ori_block_table")
    b = torch.randint(0, B, (40, 1), generator=gen)
    x = torch.randint(0, nbt * bs + 6, (40, 9), generator=gen)          # some past the table
    mask = torch.rand(40, 9, generator=gen) < 0.7
    want = src.flat_index(*src.locate(b, x, mask), mask)
    assert torch.equal(src.rows_index(b, x, mask), want)
    for check_mask in (mask, mask & (x < nbt * bs)):
        with pytest.raises(ValueError) as torch_err:
            src.locate(b, x, check_mask, check=True)
        with pytest.raises(ValueError) as native_err:
            src.rows_index(b, x, check_mask, check=True)
        assert str(native_err.value) == str(torch_err.value)
    good = mask & (x < nbt * bs) & (table[b.expand_as(x), (x // bs).clamp(max=nbt - 1)] >= 0) & \
        (table[b.expand_as(x), (x // bs).clamp(max=nbt - 1)] < nb)
    assert torch.equal(src.rows_index(b, x, good, check=True), src.flat_index(*src.locate(b, x, good, check=True), good))


@pytest.mark.parametrize("rows,cols", [(16, 16), (64, 256), (37, 50), (5, 3), (48, 17)])
def test_operand_transposes_match_the_element_loop(native_module, rows, cols):
    """The 32-bit transposes that pack GEMM operands: the scalar tile (what an AVX2 machine runs), the
    AVX-512 tile where this CPU has it, and the edges of partial tiles."""
    if native_module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    assert native_module.transposes_match(rows, cols)


@pytest.mark.parametrize("H", [1, 14, 16, 64, 70])
def test_indexer_head_sums_give_the_same_bits_in_both_layouts(native_module, H):
    # the one-row path (key-major scores) and the shared-key path (head-major) sum a key's heads in
    # one order, NaN and -0.0 included, on every implementation this CPU runs
    if native_module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    assert all(native_module.indexer_head_sums_match(H, n) for n in (1, 5, 16, 17, 64, 130))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("R, K, N", [(1, 4, 16), (19, 7, 33), (64, 530, 40), (600, 64, 1030), (0, 8, 8), (5, 0, 3)])
def test_rows_matmul_is_a_matmul_whose_rows_do_not_depend_on_the_others(gemm_module, dtype, R, K, N):
    # the compressor's projections: fp32 C = A B^T against float64; on dsattn's own GEMMs any row alone gives the
    # bits it gives in the call, and any column those of a call with fewer columns, on one thread or all (K summed
    # in one order whatever R, N and the threads); tests/test_vendor_invariance.py repeats this for M 1 to 600 with
    # MKL and oneDNN pushed to their other kernels
    g = torch.Generator().manual_seed(R * 7 + K * 3 + N)
    a, b = torch.randn(R, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)
    c, c2 = gemm_module.rows_matmul(a, [b, b[:N // 2].contiguous()])      # a packed once for both
    want = a.double() @ b.double().T
    bound = a.double().abs() @ b.double().abs().T
    assert c.dtype == torch.float32 and c.shape == (R, N)
    assert bool(((c.double() - want).abs() <= (K + 1) * 2.0 ** -23 * bound + 1e-30).all())
    assert bool(((c2.double() - want[:, :N // 2]).abs() <= (K + 1) * 2.0 ** -23 * bound[:, :N // 2] + 1e-30).all())
    own_gemm_or_skip(dtype)
    assert torch.equal(c2, c[:, :N // 2])
    for r in {0, R // 2, R - 1} if R else ():
        assert torch.equal(gemm_module.rows_matmul(a[r:r + 1].contiguous(), [b])[0][0], c[r])
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(gemm_module.rows_matmul(a, [b])[0], c)
    finally:
        torch.set_num_threads(was)


def test_rows_matmul_rejects_operands_that_do_not_fit(native_module):
    if native_module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    a = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match=r"b\[1\]: expected \[N, K=8\]"):
        native_module.rows_matmul(a, [torch.randn(4, 8), torch.randn(4, 7)])
    with pytest.raises(RuntimeError, match=r"b\[0\]: dtype BFloat16, expected a's Float"):
        native_module.rows_matmul(a, [torch.randn(4, 8).bfloat16()])
    with pytest.raises(RuntimeError, match=r"b\[0\]: a contiguous CPU tensor"):
        native_module.rows_matmul(a, [torch.randn(8, 4).T])


def test_backward_groups_and_gradient_buffers_are_checked(native_module):
    if native_module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    q = torch.randn(2, 16, 32).bfloat16()
    src = torch.randn(10, 32).bfloat16()
    rows = torch.tensor([[0, 1, -1], [2, 3, 4]])
    out, lse = native_module.sparse_attention_forward(q, [src], [rows], None, 0.2)
    args = (q, torch.randn_like(q), out, lse, [src], [rows], None, 0.2)
    with pytest.raises(RuntimeError, match=r"groups: expected a contiguous CPU int64 \[2\] tensor"):
        native_module.sparse_attention_backward(*args, groups=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match=r"dsources\[0\]: expected a contiguous CPU fp32 \[10, 32\] tensor"):
        native_module.sparse_attention_backward(*args, dsources=[torch.zeros(9, 32)])
    # into given buffers: the key gradients are added there, the same as into fresh zeros
    fresh = native_module.sparse_attention_backward(*args)[1]
    into = torch.ones(10, 32)
    native_module.sparse_attention_backward(*args, groups=torch.tensor([0, 0]), dsources=[into])
    assert torch.equal(into - 1, (fresh + 1) - 1)
