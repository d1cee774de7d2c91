"""quant_lightning_indexer: int8 / FP8 keys with per-token scales read in place, against its golden
(query and keys dequantised, then the lightning_indexer golden) on every backend, the writers of
dsattn.quant, the Ascend façade, and the errors."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dsattn
from dsattn import cases, native, ops, reference, testing, verify
from dsattn.cases import fuzz
from dsattn.quant import (dequantize_index_keys, pack_index_blocks, pack_index_rows, quantize_index_keys,
                          store_index_keys)

FP8 = torch.float8_e4m3fn
KEY_DTYPES = (torch.int8, FP8)
BACKENDS = ("compiled", "torch")


def _backend(name):
    if name == "compiled" and native.kernels() is None:
        pytest.skip(f"the compiled layer is not available: {native.status()}")
    return native.suspended() if name == "torch" else _nothing()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _check(case):
    rows = verify.quant_indexer_rows(case)
    for row in rows:
        assert row.result.passed, (case.name, row.result)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key_dtype", KEY_DTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("layout,paged,scale_layout", [
    ("BSND", False, "separate"), ("BSND", False, "row"), ("TND", False, "separate"), ("TND", False, "row"),
    ("BSND", True, "separate"), ("TND", True, "row"), ("TND", True, "block"), ("BSND", True, "block")])
@pytest.mark.parametrize("ratio", (1, 4, 128))
def test_matches_golden(backend, key_dtype, layout, paged, scale_layout, ratio):
    seed = hash((layout, paged, scale_layout, ratio, str(key_dtype))) % 1000
    dtype = (torch.bfloat16, torch.float16, torch.float32)[seed % 3]
    base = cases.indexer_case(layout, ratio, dtype, paged=paged, seed=seed)
    with _backend(backend):
        for query in ("float", "quant"):
            _check(cases.quant_indexer_case(base, key_dtype, scale_layout, query, block_pad=12))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(12))
def test_fuzz_configurations(backend, seed):
    """The float indexer's fuzz configurations (ragged and empty rows, -1 padding, masks, NaN in every
    key row no valid query reads) with their keys quantised, every format and scale layout."""
    with _backend(backend):
        name, failed, rows = fuzz.run("qindexer", seed)
        assert rows and not failed, (fuzz.repro("qindexer", seed), [str(r.result) for r in failed])


@pytest.mark.parametrize("layout,paged,page,scale_layout", [
    ("BSND", True, 64, "block"), ("TND", True, 16, "separate"), ("BSND", False, 0, "row"),
    ("TND", False, 0, "separate")])
@pytest.mark.parametrize("D", (64, 128))
@pytest.mark.parametrize("ratio", (1, 4))
def test_fp8_decode_rows_match_golden(layout, paged, page, scale_layout, D, ratio):
    """Decode rows (runs shorter than the shared-key path takes) over FP8 keys with bf16 or FP8 queries and a
    head dim that is a multiple of 64: where the compiled kernel decodes the codes as its GEMM's side work, a
    slice ahead.  Hundreds of keys per request, so that chunks hold several slices, slices cross into the
    next chunk or page, and a last slice holds fewer keys than its rows (the rest stale, never read)."""
    seed = hash((layout, paged, D, ratio)) % 1000
    base = cases.indexer_case(layout, ratio, torch.bfloat16, paged=paged, seed=seed, H=16, D=D, topk=40,
                              lengths=[4 * 331, 4 * 97 + 3, 4 * 190 + 1], page=page or 4,
                              query_rows=[1, 3, 2] if layout == "TND" else [2, 2, 2])   # (BSND: one S1 for all)
    with _backend("compiled"):
        for query in ("float", "quant"):
            _check(cases.quant_indexer_case(base, FP8, scale_layout, query, block_pad=12))


def test_indexer_case_sizes_come_in_pairs():
    with pytest.raises(ValueError, match="lengths, query_rows: give both"):
        cases.indexer_case("TND", 1, lengths=[40, 30])
    with pytest.raises(ValueError, match="one entry per batch"):
        cases.indexer_case("TND", 1, lengths=[40, 30], query_rows=[1])


def test_integer_scores_exact():
    """Small integer codes with power-of-two scales: every score is exact, so the compiled kernel and
    the golden agree exactly, ties (lower key first) included."""
    base = cases.indexer_case("TND", 4, torch.bfloat16, paged=True, seed=3, integer=True)
    for key_dtype in KEY_DTYPES:
        k = base.extra["k"]
        codes = torch.nan_to_num(k.float(), nan=0.0)
        key = codes.to(key_dtype)
        scale = torch.full(k.shape[:-1], 0.5)
        args = (base.q, key, base.extra["w"], None, scale, 8, 0)
        got = ops.quant_lightning_indexer(*args, **base.kwargs)
        want = reference.quant_lightning_indexer(*args, **base.kwargs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_compiled_and_torch_paths_agree_on_indices():
    if native.kernels() is None:
        pytest.skip(native.status())
    base = cases.indexer_case("BSND", 4, torch.bfloat16, paged=True, seed=11, H=8, D=64, topk=16)
    case = cases.quant_indexer_case(base, FP8, "block")
    x = case.extra
    args = (case.q, x["key"], x["w"], None, None, x["topk"], 0)
    a = ops.quant_lightning_indexer(*args, **case.kwargs)
    with native.suspended():
        b = ops.quant_lightning_indexer(*args, **case.kwargs)
    full = reference.quant_lightning_indexer(*args[:5], 4096, 0, **case.kwargs)
    assert testing.compare_indexer(a[0], a[1], b[0], b[1], *full)


def test_decode_hooks():
    module = native.kernels()
    if module is None:
        pytest.skip(native.status())
    assert module.indexer_codes_match()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(70)   # more than one parallel piece
    for dtype in KEY_DTYPES:
        got = module.index_codes_bf16(codes, dtype == FP8).float()
        want = codes.view(dtype).float()
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_prefill_rows_take_the_shared_key_path_with_the_same_bits(own_gemm):
    """Rows of one request (a prefill, the shared-key path) and the same rows one request each (the
    one-row path) give the same bits: the scales are applied in the same order on both paths."""
    if native.kernels() is None:
        pytest.skip(native.status())
    g = torch.Generator().manual_seed(5)
    H, D, S, Kc, bs = 16, 64, 24, 300, 16
    nb = -(-Kc // bs)
    k = torch.randn(nb, bs, 1, D, generator=g)
    v, s = quantize_index_keys(k, FP8)
    s[3, 5] = -s[3, 5]                                   # one chunk with a negative scale: the unfolded form
    q = torch.randn(1, S, H, D, generator=g).bfloat16()
    w = torch.rand(1, S, H, generator=g)
    table = torch.arange(nb, dtype=torch.int32)[None]
    kw = dict(seqused_k=torch.tensor([Kc], dtype=torch.int32), block_table=table, layout_k="PA_BBND", return_value=1)
    together = ops.quant_lightning_indexer(q, v, w, None, s, 32, 0, **kw)
    alone = [ops.quant_lightning_indexer(q[:, i:i + 1], v, w[:, i:i + 1], None, s, 32, 0, **kw) for i in range(S)]
    assert torch.equal(together[0], torch.cat([a[0] for a in alone], 1))
    assert torch.equal(together[1], torch.cat([a[1] for a in alone], 1))


# ---- the writers


@pytest.mark.parametrize("key_dtype", KEY_DTYPES, ids=["int8", "fp8"])
def test_quantize_dequantize(key_dtype):
    g = torch.Generator().manual_seed(1)
    k = torch.randn(37, 128, generator=g) * torch.rand(37, 1, generator=g) * 10
    k[4] = 0.0
    v, s = quantize_index_keys(k, key_dtype)
    assert v.dtype == key_dtype and s.dtype == torch.float32 and s.shape == (37,)
    qmax = 127.0 if key_dtype == torch.int8 else 448.0
    assert torch.equal(s[:4], k[:4].abs().amax(-1) / qmax) and s[4] == 0
    back = dequantize_index_keys(v, s)
    rel = (back - k).abs().amax(-1) / k.abs().amax(-1).clamp(min=1e-30)
    assert float(rel[torch.arange(37) != 4].max()) < (0.5 / 127 if key_dtype == torch.int8 else 0.07)
    assert torch.equal(back[4], torch.zeros(128))


@pytest.mark.parametrize("scale_layout", ("separate", "row", "block"))
@pytest.mark.parametrize("key_dtype", KEY_DTYPES, ids=["int8", "fp8"])
def test_store_index_keys(scale_layout, key_dtype):
    g = torch.Generator().manual_seed(2)
    nb, bs, D = 5, 16, 32
    k = torch.randn(9, D, generator=g)
    slots = torch.tensor([3, -1, 17, 40, 79, 0, -1, 64, 15], dtype=torch.int32)
    fill = torch.full((), 0x7F, dtype=torch.uint8)                                 # NaN / 127 codes
    if scale_layout == "separate":
        cache = fill.expand(nb, bs, 1, D).clone().view(key_dtype)
        scale_cache = torch.full((nb, bs, 1), float("nan"))
    elif scale_layout == "row":
        cache, scale_cache = fill.expand(nb, bs, 1, D + 4).clone().view(key_dtype), None
    else:
        cache, scale_cache = fill.expand(nb, bs * (D + 4) + 8).clone()[:, :bs * (D + 4)].view(key_dtype), None
    before = cache.view(torch.uint8).clone()
    store_index_keys(k, slots, cache, scale_cache, key_scale_layout=scale_layout)
    v, s = quantize_index_keys(k, key_dtype)
    # read back through the operator's own view of the cache, token by token
    from dsattn.quant.index_keys import index_key_pool
    pool = index_key_pool(cache, scale_cache, "PA_BBND", scale_layout, D)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(pool.values[slot // bs, slot % bs], v[t].view(torch.uint8))
        assert torch.equal(pool.scales[slot // bs, slot % bs], s[t])
    written = {x for x in slots.tolist() if x >= 0}
    after = cache.view(torch.uint8)
    for slot in range(nb * bs):                            # the other tokens' bytes are untouched
        if slot not in written:
            assert torch.equal(pool.values[slot // bs, slot % bs],
                               index_key_pool(before.view(key_dtype), scale_cache, "PA_BBND", scale_layout,
                                              D).values[slot // bs, slot % bs]) or scale_layout == "separate"
    assert after.shape == before.shape
    with pytest.raises(ValueError, match="slot_mapping"):
        store_index_keys(k, slots + 1000, cache, scale_cache, key_scale_layout=scale_layout)


def test_pack_layouts_hold_values_then_scales():
    v, s = quantize_index_keys(torch.randn(2, 16, 8), FP8)
    rows = pack_index_rows(v, s).view(torch.uint8)
    assert rows.shape == (2, 16, 12) and torch.equal(rows[..., :8], v.view(torch.uint8))
    assert torch.equal(rows[..., 8:].contiguous().view(torch.float32)[..., 0], s)
    blocks = pack_index_blocks(v, s).view(torch.uint8)
    assert blocks.shape == (2, 16 * 12)
    assert torch.equal(blocks[:, :128].reshape(2, 16, 8), v.view(torch.uint8))
    assert torch.equal(blocks[:, 128:].contiguous().view(torch.float32), s)


# ---- the Ascend façade


def test_npu_facade_matches_the_operator():
    base = cases.indexer_case("TND", 4, torch.bfloat16, paged=True, seed=9)
    case = cases.quant_indexer_case(base, torch.int8, "separate", "quant")
    x, kw = case.extra, case.kwargs
    cu_q = kw["cu_seqlens_q"]
    a = dsattn.npu_quant_lightning_indexer(case.q, x["key"], x["w"], x["query_dequant_scale"], x["key_dequant_scale"],
                                           actual_seq_lengths_query=cu_q[1:], actual_seq_lengths_key=kw["seqused_k"],
                                           block_table=kw["block_table"], layout_query="TND", layout_key="PA_BSND",
                                           sparse_count=x["topk"], sparse_mode=3, cmp_ratio=4, return_value=True)
    kw = dict(kw, return_value=1)
    kw.pop("cmp_residual_k")
    b = ops.quant_lightning_indexer(case.q, x["key"], x["w"], x["query_dequant_scale"], x["key_dequant_scale"],
                                    x["topk"], 0, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="pre_tokens"):
        dsattn.npu_quant_lightning_indexer(case.q, x["key"], x["w"], x["query_dequant_scale"],
                                           x["key_dequant_scale"], actual_seq_lengths_query=cu_q[1:],
                                           layout_query="TND", pre_tokens=128)


def test_fake_kernel_traces():
    base = cases.indexer_case("BSND", 4, torch.float16, paged=True, seed=4)
    case = cases.quant_indexer_case(base, FP8, "row")
    x = case.extra

    def f(q, key, w):
        return ops.quant_lightning_indexer(q, key, w, None, None, x["topk"], 0, **case.kwargs)

    eager = f(case.q, x["key"], x["w"])
    compiled = torch.compile(f, fullgraph=True, backend="eager")(case.q, x["key"], x["w"])
    assert torch.equal(eager[0], compiled[0])


# ---- errors


def _call(**over):
    base = cases.indexer_case("BSND", 4, torch.bfloat16, paged=True, seed=6)
    case = cases.quant_indexer_case(base, FP8, "separate")
    x = case.extra
    args = dict(query=case.q, key=x["key"], weights=x["w"], query_dequant_scale=None,
                key_dequant_scale=x["key_dequant_scale"], topk=x["topk"], quant_mode=0)
    kw = dict(case.kwargs)
    for name, value in over.items():
        (args if name in args else kw)[name] = value
    return ops.quant_lightning_indexer(*args.values(), **kw)


def test_errors_name_the_argument():
    base = cases.indexer_case("BSND", 4, torch.bfloat16, paged=True, seed=6)
    case = cases.quant_indexer_case(base, FP8, "separate")
    key, ks = case.extra["key"], case.extra["key_dequant_scale"]
    nb, bs, _, D = key.shape
    bad = [
        (TypeError, "key: is uint8", dict(key=key.view(torch.uint8))),
        (TypeError, "key: dtype torch.bfloat16", dict(key=key.float().bfloat16())),
        (ValueError, "key_dequant_scale: expected one scale per key row", dict(key_dequant_scale=ks[:, :-1])),
        (TypeError, "key_dequant_scale: dtype torch.bfloat16", dict(key_dequant_scale=ks.bfloat16())),
        (ValueError, "key_dequant_scale: is required", dict(key_dequant_scale=None)),
        (ValueError, "key: expected \\[num_blocks, block_size, 1, 36\\]",
         dict(key=key, key_dequant_scale=None, key_scale_layout="row")),
        (ValueError, "key: a \\[num_blocks, block bytes\\] block cache needs",
         dict(key=key.view(torch.uint8).reshape(nb, -1)[:, :-3].view(FP8), key_dequant_scale=None,
              key_scale_layout="block")),
        (ValueError, "key_dequant_scale: must be None with key_scale_layout='row'", dict(key_scale_layout="row")),
        (ValueError, "key_scale_layout: ", dict(key_scale_layout="tile")),
        (ValueError, "query: a quantised query is scored against keys of its own format",
         dict(query=case.q.to(torch.int8), query_dequant_scale=torch.ones(case.q.shape[:-1]))),
        (ValueError, "query_dequant_scale: is required", dict(query=case.q.to(FP8))),
        (ValueError, "query_dequant_scale: must be None for a float query",
         dict(query_dequant_scale=torch.ones(case.q.shape[:-1]))),
        (ValueError, "query_dequant_scale: expected one scale per token and head",
         dict(query=case.q.to(FP8), query_dequant_scale=torch.ones(case.q.shape[:-2]))),
        (ValueError, "quant_mode: ", dict(quant_mode=1)),
        (ValueError, "topk: value 1099511627776", dict(topk=1 << 40)),
        (ValueError, "weights: expected the shape of query", dict(weights=case.extra["w"][..., :-1])),
        (TypeError, "weights: dtype torch.float16", dict(weights=case.extra["w"].half())),
        (ValueError, "query: expected a 4-D tensor", dict(query=case.q[0])),
    ]
    for exc, match, over in bad:
        with pytest.raises(exc, match=match):
            _call(**over)
    # a block layout's block stride that cannot hold a block
    blocks = pack_index_blocks(*quantize_index_keys(torch.randn(4, 16, 8), FP8))
    narrow = torch.as_strided(blocks.view(torch.uint8), (4, 16, 12), (100, 12, 1))   # blocks of 192 bytes, 100 apart
    from dsattn.quant.index_keys import index_key_pool
    with pytest.raises(ValueError, match="block stride 100 bytes cannot hold a block of 16 x 12 bytes"):
        index_key_pool(narrow.view(FP8), None, "PA_BBND", "block", 8)
    with pytest.raises(ValueError, match="'block' holds a paged cache's blocks"):
        index_key_pool(blocks, None, "BSND", "block", 8)


def test_float_indexer_rejects_absurd_topk():
    c = cases.indexer_case("BSND", 4, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="topk: value 1099511627776"):
        ops.lightning_indexer(c.q, c.extra["k"], c.extra["w"], 1 << 40, **c.kwargs)


# ---- memory: the pool is read in place


def test_64k_paged_call_reads_the_pool_in_place():
    """Peak RSS growth of a 64K-token paged FP8 call stays under the pool's own size (a dequantised copy
    of the keys would be twice it in bf16, four times in fp32)."""
    if native.kernels() is None:
        pytest.skip(native.status())
    script = textwrap.dedent("""
        import resource, torch
        from dsattn import ops
        from dsattn.quant import quantize_index_keys, pack_index_blocks
        torch.set_num_threads(1)
        def call(tokens, seed):
            g = torch.Generator().manual_seed(seed)
            bs, D, H = 64, 128, 64
            nb = tokens // bs
            v, s = quantize_index_keys(torch.randn(nb, bs, D, generator=g), torch.float8_e4m3fn)
            cache = pack_index_blocks(v, s)
            del v, s
            q = torch.randn(1, 1, H, D, generator=g).bfloat16()
            w = torch.rand(1, 1, H, generator=g)
            table = torch.arange(nb, dtype=torch.int32)[None]
            lens = torch.tensor([tokens], dtype=torch.int32)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            ops.quant_lightning_indexer(q, cache, w, None, None, 512, 0, seqused_k=lens, block_table=table,
                                        layout_k="PA_BBND", key_scale_layout="block")
            return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024, cache.numel()
        call(1024, 0)                                   # the compiled layer loaded, buffers warm
        grown, pool = call(65536, 1)
        print(grown, pool)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-2000:]
    grown, pool = (int(v) for v in out.stdout.split())
    assert grown < pool, f"peak RSS grew {grown} bytes, the pool is {pool}"


@pytest.mark.parametrize("quantised", (False, True), ids=["lightning_indexer", "quant_lightning_indexer"])
@pytest.mark.parametrize("paged", (False, True), ids=["BSND", "paged"])
def test_one_row_split_over_threads_gives_the_one_thread_bits(quantised, paged, own_gemm):
    """A call of one decode row with many keys splits them over the threads and merges the parts'
    selections: the same bits as one thread, ties (repeated keys) included."""
    if native.kernels() is None:
        pytest.skip(native.status())
    g = torch.Generator().manual_seed(8)
    H, D, Kc, bs = 16, 64, 3000, 64
    k = torch.randn(Kc, D, generator=g)
    k[1500:1600] = k[100:200]                              # equal scores across the parts' boundary
    q = torch.randn(1, 1, H, D, generator=g).bfloat16()
    w = torch.rand(1, 1, H, generator=g)
    kw = dict(return_value=1, output_idx_offset=torch.tensor([7], dtype=torch.int32))
    if paged:
        nb = -(-Kc // bs)
        pool = torch.full((nb + 3, bs, D), float("nan"))
        perm = torch.randperm(nb + 3, generator=g)[:nb]
        pool.view(-1, D)[(perm[:, None] * bs + torch.arange(bs)).reshape(-1)[:Kc]] = k
        keys = pool[:, :, None]
        kw.update(seqused_k=torch.tensor([Kc], dtype=torch.int32), block_table=perm[None].to(torch.int32),
                  layout_k="PA_BBND")
    else:
        keys = k[None, :, None]
    if quantised:
        values, scales = quantize_index_keys(keys, FP8)
        call = lambda: ops.quant_lightning_indexer(q, values, w, None, scales, 600, 0, **kw)  # noqa: E731
    else:
        keys = keys.bfloat16()
        call = lambda: ops.lightning_indexer(q, keys, w, 600, **kw)  # noqa: E731
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = call()
        torch.set_num_threads(2)
        two = call()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_block_layout_takes_each_cache_shape():
    """vLLM's block cache as [num_blocks, block bytes], [num_blocks, block_size, D + 4] or
    [num_blocks, block_size, 1, D + 4]: the same bytes, the same results."""
    g = torch.Generator().manual_seed(3)
    nb, bs, D, H = 6, 16, 32, 4
    blocks = pack_index_blocks(*quantize_index_keys(torch.randn(nb, bs, D, generator=g), FP8))
    q, w = torch.randn(2, 1, H, D, generator=g).bfloat16(), torch.rand(2, 1, H, generator=g)
    kw = dict(seqused_k=torch.tensor([40, 70], dtype=torch.int32), layout_k="PA_BBND", key_scale_layout="block",
              block_table=torch.tensor([[5, 0, 3, 1, 2], [4, 1, 2, 3, 0]], dtype=torch.int32), return_value=1)
    want = reference.quant_lightning_indexer(q, blocks, w, None, None, 8, 0, **kw)
    for shape in ((nb, bs * (D + 4)), (nb, bs, D + 4), (nb, bs, 1, D + 4)):
        got = ops.quant_lightning_indexer(q, blocks.view(shape), w, None, None, 8, 0, **kw)
        assert torch.equal(got[0], want[0]), shape


def test_writer_and_facade_errors_name_the_argument():
    k = torch.randn(4, 16)
    with pytest.raises(TypeError, match="dtype: expected torch.int8 or torch.float8_e4m3fn"):
        quantize_index_keys(k, torch.uint8)
    with pytest.raises(TypeError, match="k: expected a float tensor"):
        quantize_index_keys(k.to(torch.int32))
    with pytest.raises(TypeError, match="values: is uint8"):
        dequantize_index_keys(torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4))
    cache = torch.zeros(2, 16, 1, 16, dtype=torch.int8)
    with pytest.raises(TypeError, match="k: expected a float \\[T, D\\] tensor"):
        store_index_keys(k[None], torch.arange(4), cache, torch.zeros(2, 16, 1))
    with pytest.raises(ValueError, match="slot_mapping: expected int32 / int64 \\[T=4\\]"):
        store_index_keys(k, torch.arange(3), cache, torch.zeros(2, 16, 1))
    with pytest.raises(ValueError, match="key_dequant_scale: is required"):
        store_index_keys(k, torch.arange(4), cache)
    case = cases.quant_indexer_case(cases.indexer_case("TND", 4, torch.bfloat16, seed=2), torch.int8, "separate",
                                    "quant")
    x = case.extra
    args = (case.q, x["key"], x["w"], x["query_dequant_scale"], x["key_dequant_scale"])
    with pytest.raises(ValueError, match="key_quant_mode: value 1 differs"):
        dsattn.npu_quant_lightning_indexer(*args, key_quant_mode=1, layout_query="TND", layout_key="TND")
    with pytest.raises(ValueError, match="actual_seq_lengths_query: is required for a TND layout"):
        dsattn.npu_quant_lightning_indexer(*args, layout_query="TND", layout_key="TND")
    with pytest.raises(ValueError, match="layout_key: "):
        dsattn.npu_quant_lightning_indexer(*args, layout_query="TND", layout_key="PA_ND")
