"""60-serving / issue 6: the DeepSeek-V4 attention layer over paged caches against a dense
float64 reference, for every layer type and every forward mode: one-shot prefill, chunked
prefill in several chunk sizes, token-by-token decode, draft-extend with 2 and 4 tokens; the
paths agree with each other and leave the same caches."""
import dataclasses

import pytest
import torch

from dsattn import quant, testing
from dsattn.model import PRESETS, DeepseekV4Attention
from dsattn.model.layer import PagedBatch, compressor_overlap
from dsattn.model.reference import reference_layer

CFG = PRESETS["small"]
LENS = [70, 37, 45]
PAYLOADS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def fresh(layer, pages, poison=True):
    """A page allocator and the layer's caches; every cache NaN when ``poison``."""
    pb = PagedBatch(CFG, pages, 24)
    caches = layer.new_caches(pages)
    if poison:
        for t in vars(caches).values():
            if t is None:
                continue
            if t.dtype in PAYLOADS.values():
                t.view(torch.uint8).fill_(0xFF)            # packed rows: NaN scales and rope
            else:
                t.fill_(float("nan"))
    return pb, caches


def run(layer, X, schedule, poison=True):
    """``schedule``: list of steps, each {request: new tokens}.  Returns per-request outputs of
    every token, the CSA top-k rows per request, and the caches.  Every cache starts NaN
    (``poison``): a read of a row nothing wrote, of the dummy page or past a request's length
    shows up as NaN in the outputs."""
    pb, caches = fresh(layer, 96, poison)
    done = {b: 0 for b in range(len(X))}
    outs = {b: [] for b in range(len(X))}
    tops = {b: [] for b in range(len(X))}
    for step_spec in schedule:
        reqs = [b for b, n in step_spec.items() if n]
        news = [step_spec[b] for b in reqs]
        step = pb.step(reqs, news, CFG.heads)
        x = torch.cat([X[b][done[b]:done[b] + n] for b, n in zip(reqs, news)])
        y = layer.forward(x, step, caches)
        o = 0
        for b, n in zip(reqs, news):
            outs[b].append(y[o:o + n])
            if layer.ratio == 4:
                tops[b].append(layer.last_topk[o:o + n, 0])
            o += n
            done[b] += n
    return {b: torch.cat(v) for b, v in outs.items()}, tops, caches, pb


def chunks(total, size):
    return [min(size, total - a) for a in range(0, total, size)]


def schedule_chunked(size):
    per = [chunks(L, size) for L in LENS]
    return [{b: (per[b][k] if k < len(per[b]) else 0) for b in range(len(LENS))} for k in range(max(map(len, per)))]


def schedule_prefill_then(n_per_step, prefix=20):
    """Prefill ``prefix`` tokens, then steps of ``n_per_step`` tokens (decode / draft-extend)."""
    steps = [{b: prefix for b in range(len(LENS))}]
    left = [L - prefix for L in LENS]
    while any(left):
        step = {}
        for b in range(len(LENS)):
            step[b] = min(n_per_step, left[b])
            left[b] -= step[b]
        steps.append(step)
    return steps


SCHEDULES = {"one-shot": [{b: L for b, L in enumerate(LENS)}], "chunks-16": schedule_chunked(16),
             "chunks-23": schedule_chunked(23), "decode": schedule_prefill_then(1),
             "draft-extend-2": schedule_prefill_then(2), "draft-extend-4": schedule_prefill_then(4)}


@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["SWA", "CSA", "HCA"])
def test_every_mode_matches_dense_reference_and_each_other(ratio):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    X = [torch.randn(L, CFG.hidden, generator=g) for L in LENS]
    layer = DeepseekV4Attention(CFG, ratio, seed=3)
    results = {name: run(layer, X, sched) for name, sched in SCHEDULES.items()}
    base_out, base_tops, base_caches, _ = results["one-shot"]
    for b, x in enumerate(X):
        top = base_tops[b][0] if ratio == 4 else None
        ref = reference_layer(layer, x, top)
        for name, (outs, tops, caches, pb) in results.items():
            res = testing.fp32_math_close(outs[b], ref, rtol=1e-4)
            assert res, f"{name} request {b}: {res}"
            if ratio == 4:
                assert torch.equal(torch.cat(tops[b]).sort(-1)[0], base_tops[b][0].sort(-1)[0]), name
    # the caches each path leaves hold the same rows (pages differ per path: compare by position)
    for name, (outs, tops, caches, pb) in results.items():
        for b, L in enumerate(LENS):
            _, _, ref_caches, ref_pb = results["one-shot"]
            for field, pages_of, n in (("window", "raw_pages", L), ("cmp", "cmp_pages", L // max(ratio, 1))):
                cache, ref_cache = getattr(caches, field), getattr(ref_caches, field)
                if cache is None or (field == "cmp" and not ratio):
                    continue
                def rows(pbx, cc):
                    pages = torch.tensor(getattr(pbx, pages_of)[b])
                    pos = torch.arange(n)
                    return cc[pages[pos // CFG.page_size], pos % CFG.page_size]
                a, e = rows(pb, cache), rows(ref_pb, ref_cache)
                # equal up to fp32 rounding: the projections' GEMMs see other batch shapes per path, and a
                # compressed row passes that noise through a softmax pooling and an RMSNorm
                assert torch.equal(a.isnan(), e.isnan()), f"{name} {field} request {b}"
                assert torch.allclose(a, e, rtol=1e-4, atol=1e-5), f"{name} {field} request {b}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["SWA", "CSA", "HCA"])
def test_half_precision_layer_every_mode(ratio, dtype):
    """The layer in bf16 / fp16 (half-precision caches, the attention's half-precision paths):
    every forward mode within half-precision error of the dense float64 reference, and of the
    one-shot prefill."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    X = [torch.randn(L, CFG.hidden, generator=g).to(dtype) for L in LENS]
    layer = DeepseekV4Attention(CFG, ratio, seed=3, dtype=dtype)
    results = {name: run(layer, X, SCHEDULES[name]) for name in ("one-shot", "chunks-16", "decode", "draft-extend-2")}
    base_out, base_tops, _, _ = results["one-shot"]
    bound = 3e-2 if dtype == torch.bfloat16 else 5e-3
    for b, x in enumerate(X):
        ref = reference_layer(layer, x, base_tops[b][0] if ratio == 4 else None)
        scale = ref.abs().max()
        for name, (outs, _, caches, _) in results.items():
            assert outs[b].dtype == dtype and not outs[b].isnan().any()
            err = ((outs[b].double() - ref).abs().max() / scale).item()
            assert err < bound, f"{name} request {b}: {err}"
            agree = ((outs[b].double() - base_out[b].double()).abs().max() / scale).item()
            assert agree < bound, f"{name} request {b} vs one-shot: {agree}"


def _packed_positions(layer, caches, pb, b, n, field, pages_of):
    """Dequantised rows ``[n, d]`` of request b's first ``n`` positions of a packed cache, the
    raw bytes, and the tile scales."""
    pages = torch.tensor(getattr(pb, pages_of)[b])
    pos = torch.arange(n)
    packed = getattr(caches, field)[pages[pos // CFG.page_size], pos % CFG.page_size, 0]
    k, scales = _dequant_packed(packed)
    return k, packed, scales


def _dequant_packed(packed):
    """Packed cache rows of the small preset -> (fp32 keys, fp32 tile scales)."""
    k, _ = quant.dequant_kv_rows(packed, CFG.rope_dim, torch.float32, torch.bfloat16, CFG.kv_quant_tile)
    _, _, scales = quant.unpack_kv_rows(packed, CFG.rope_dim, torch.bfloat16, CFG.kv_quant_tile)
    return k, scales


@pytest.mark.parametrize("payload", list(PAYLOADS))
@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["SWA", "CSA", "HCA"])
def test_packed_kv_cache_every_mode(ratio, payload):
    """``kv_cache_dtype`` int8 / fp8: every forward mode over packed window and compressed caches
    (0xFF bytes wherever nothing wrote).  The output stays within the quantiser's error of the
    dense float64 reference, and every cached row is the quantisation of the row the unquantised
    layer caches: the nope part within half a step (int8) or 2^-4 relative (e4m3) of it, the
    rope part its bf16 rounding; rows nothing wrote stay 0xFF."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    X = [torch.randn(L, CFG.hidden, generator=g) for L in LENS]
    dt = PAYLOADS[payload]
    layer = DeepseekV4Attention(CFG, ratio, seed=3, kv_cache_dtype=dt)
    plain = DeepseekV4Attention(CFG, ratio, seed=3)
    assert layer.kv_row_bytes == 48 + 2 * 16 + 4 * 3 and plain.kv_row_bytes == 4 * 64
    base_out, base_tops, plain_caches, plain_pb = run(plain, X, SCHEDULES["one-shot"])
    bound = 0.02 if dt == torch.int8 else 0.08
    N = CFG.head_dim - CFG.rope_dim
    for name in ("one-shot", "chunks-23", "decode", "draft-extend-4"):
        outs, tops, caches, pb = run(layer, X, SCHEDULES[name])
        for b, x in enumerate(X):
            ref = reference_layer(layer, x, base_tops[b][0] if ratio == 4 else None)
            assert not outs[b].isnan().any()
            err = ((outs[b].double() - ref).abs().max() / ref.abs().max()).item()
            assert err < bound, f"{name} request {b}: {err}"
            for field, pages_of, n in (("window", "raw_pages", LENS[b]), ("cmp", "cmp_pages", LENS[b] // max(ratio, 1))):
                if not ratio and field == "cmp":
                    continue
                k, packed, scales = _packed_positions(layer, caches, pb, b, n, field, pages_of)
                pages = torch.tensor(getattr(plain_pb, pages_of)[b])
                pos = torch.arange(n)
                exact = getattr(plain_caches, field)[pages[pos // CFG.page_size], pos % CFG.page_size, 0]
                assert not (packed.view(torch.uint8) == 0xFF).all(-1).any(), f"{name} {field}: a row was not written"
                # rope: bf16 rounding (half an ulp, 2^-9 relative; one ulp where fp32 noise crosses a tie)
                rope_err = (k[:, N:] - exact[:, N:]).abs()
                assert (rope_err <= 2.0 ** -8 * exact[:, N:].abs() + 1e-6).all(), f"{name} {field} rope"
                if name == "one-shot":
                    assert torch.equal(k[:, N:], exact[:, N:].to(torch.bfloat16).float()), f"{name} {field} rope"
                step = scales.repeat_interleave(CFG.kv_quant_tile, -1)
                d = (k[:, :N] - exact[:, :N]).abs()
                # 1e-4: the unquantised path's own fp32 rounding between different GEMM shapes
                tol = 0.5 * step if dt == torch.int8 else 2.0 ** -4 * exact[:, :N].abs() + 2.0 ** -9 * step
                assert (d <= tol * 1.001 + 1e-4 * step.clamp(min=1) + 1e-5).all(), f"{name} {field} nope"
        pages_used = {p for v in (pb.raw_pages, pb.cmp_pages) for lst in v.values() for p in lst}
        spare = [p for p in range(1, 96) if p not in pages_used]
        assert (caches.window[spare].view(torch.uint8) == 0xFF).all()


def test_packed_kv_cache_rejects_bad_settings():
    with pytest.raises(TypeError, match="kv_cache_dtype"):
        DeepseekV4Attention(CFG, 4, kv_cache_dtype=torch.float16)
    bad = dataclasses.replace(CFG, kv_quant_tile=20)
    with pytest.raises(ValueError, match="tile_size"):
        DeepseekV4Attention(bad, 4, kv_cache_dtype=torch.int8)


def test_serving_demo_runs_and_matches_reference():
    from rich.console import Console

    from dsattn import serving_demo
    console = Console(record=True, width=160)
    assert serving_demo.run(requests=5, decode_steps=3, console=console)
    text = console.export_text()
    for needle in ("prefill throughput", "decode throughput", "KV row bytes", "planner balance", "raw pages held",
                   "time share: sparse_attn_sharedkv", "dense float64 reference"):
        assert needle in text


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_serving_demo_with_packed_kv_cache(kv):
    from rich.console import Console

    from dsattn import serving_demo
    console = Console(record=True, width=200)
    assert serving_demo.run(requests=4, decode_steps=2, kv_cache=kv, console=console)
    text = console.export_text()
    assert "time share: sparse_attn_sharedkv_packed" in text and "this run: 92 B" in text
    assert "bf16 433 B, int8 packed 316 B" in text
    with pytest.raises(ValueError, match="kv_cache"):
        serving_demo.run(requests=1, decode_steps=1, kv_cache="int4", console=console)


def test_ops_demo_still_runs():
    from rich.console import Console

    from dsattn import demo
    assert demo.run(tokens=64, console=Console(record=True, width=160))


def _decode_setup(ratio, gen, poison=True, kv_cache_dtype=None):
    """Three requests prefilled, then one decode step padded to a bucket of 5 (graph replay)."""
    layer = DeepseekV4Attention(CFG, ratio, seed=5, kv_cache_dtype=kv_cache_dtype)
    pb, caches = fresh(layer, 64, poison)
    lens = [40, 17, 33]
    X = [torch.randn(L + 1, CFG.hidden, generator=gen) for L in lens]
    step = pb.step([0, 1, 2], lens, CFG.heads)
    layer.forward(torch.cat([x[:-1] for x in X]), step, caches)
    return layer, pb, caches, X


def _snapshot(caches):
    return {k: v.clone() for k, v in vars(caches).items() if v is not None}


def _unwritten_and_values(t):
    """Per cache row: never written (NaN / all 0xFF bytes), and its values as fp32 (packed rows
    dequantised; unwritten rows 0)."""
    if t.dtype in PAYLOADS.values():
        unwritten = (t.view(torch.uint8) == 0xFF).all(-1)
        return unwritten, torch.where(unwritten[..., None], 0.0, _dequant_packed(t)[0])
    return t.isnan(), t.float().nan_to_num(0.0)


def assert_caches_match(got, want, rtol, atol):
    """The same rows written; written rows equal to rounding (packed: within one quantisation step)."""
    for k, v in _snapshot(got).items():
        (un_v, val_v), (un_e, val_e) = _unwritten_and_values(v), _unwritten_and_values(getattr(want, k))
        assert torch.equal(un_v, un_e), k
        if v.dtype in PAYLOADS.values():
            scales = _dequant_packed(v)[1]
            # the quantised part: one quantisation step; the rope part (stored in bf16): one bf16 ulp,
            # 2^(e - 8) for |x| in [2^(e-1), 2^e) -- up to 2^-7 |x|, not 2^-8 |x| (a seed that flipped a
            # rope value of 0.0371 by its ulp, 2.4e-4, failed that)
            _, exponent = torch.frexp(val_e[..., scales.size(-1) * CFG.kv_quant_tile:])
            step = torch.cat([scales.repeat_interleave(CFG.kv_quant_tile, -1),
                              torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent - 8)], -1)
            step = torch.where(un_v[..., None], 0.0, step)
            if v.dtype == torch.float8_e4m3fn:
                step = step + 2.0 ** -3 * val_e.abs()
            assert ((val_v - val_e).abs() <= step * 1.001 + atol).all(), k
        else:
            assert torch.allclose(val_v, val_e, rtol=rtol, atol=atol), k


KV_DTYPES = {"model-dtype": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


@pytest.mark.parametrize("kv", list(KV_DTYPES))
@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["SWA", "CSA", "HCA"])
def test_padded_decode_step_reads_no_device_data_and_padding_changes_nothing(ratio, kv, gen, monkeypatch):
    import dsattn
    layer, pb, caches, X = _decode_setup(ratio, gen, kv_cache_dtype=KV_DTYPES[kv])
    x_dec = torch.cat([x[-1:] for x in X])
    # reference: the unpadded decode step on a copy of the caches
    pb_ref = PagedBatch(CFG, 64, 16)
    pb_ref.__dict__.update({k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                            for k, v in pb.__dict__.items()})
    ref_caches = type(caches)(**_snapshot(caches))
    want = layer.forward(x_dec, pb_ref.step([0, 1, 2], [1, 1, 1], CFG.heads), ref_caches)
    # the padded step, built on the host first, then run with every host read forbidden
    step = pb.step([0, 1, 2], [1, 1, 1], CFG.heads, pad_to=5)
    assert step.seqused_kv.tolist()[3:] == [1, 1] and step.window_slots.tolist()[3:] == [-1, -1]
    x_pad = torch.cat([x_dec, torch.full((2, CFG.hidden), 7.0)])

    def forbidden(*a, **k):
        raise AssertionError("host read of tensor data (or host data copied in) inside the decode step")
    dsattn.set_content_checks(False)
    try:
        for name in ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            monkeypatch.setattr(torch.Tensor, name, forbidden)
        monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
        # host data turned into tensors inside the step would be a host-to-device copy on an
        # accelerator, which CUDA graph capture does not allow
        monkeypatch.setattr(torch, "tensor", forbidden)
        monkeypatch.setattr(torch, "as_tensor", forbidden)
        got = layer.forward(x_pad, step, caches)
    finally:
        monkeypatch.undo()
        dsattn.set_content_checks(True)
    # padding wrote nothing: the same rows are still unwritten as after the unpadded step; written
    # rows agree to rounding (a GEMM over 5 rows need not be bitwise the one over 3)
    assert_caches_match(caches, ref_caches, rtol=1e-5, atol=1e-6)
    if KV_DTYPES[kv] is None:
        assert torch.allclose(got[:3], want, rtol=1e-5, atol=1e-6)
    else:                       # a one-step flip of a quantised row moves the output by about that step
        assert ((got[:3] - want).abs().max() / want.abs().max()).item() < 5e-3


@pytest.mark.parametrize("kv", ["model-dtype", "int8"])
@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["SWA", "CSA", "HCA"])
def test_decode_step_compiles_fullgraph(ratio, kv, gen):
    import dsattn
    layer, pb, caches, X = _decode_setup(ratio, gen, poison=False, kv_cache_dtype=KV_DTYPES[kv])
    step = pb.step([0, 1, 2], [1, 1, 1], CFG.heads, pad_to=4)
    x = torch.cat([torch.cat([x[-1:] for x in X]), torch.zeros(1, CFG.hidden)])
    eager_caches = type(caches)(**_snapshot(caches))
    want = layer.forward(x, step, eager_caches)
    torch._dynamo.reset()
    dsattn.set_content_checks(False)
    try:
        got = torch.compile(lambda x, st, c: layer.forward(x, st, c), fullgraph=True, backend="aot_eager")(
            x, step, caches)
    finally:
        dsattn.set_content_checks(True)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert_caches_match(caches, eager_caches, rtol=1e-6, atol=1e-7)


def test_demo_cli_smoke():
    """`dsattn demo --steps 2` as CI runs it."""
    from dsattn.cli import main
    assert main(["demo", "--steps", "2"]) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
@pytest.mark.parametrize("kv", ["model-dtype", "int8"])
def test_cuda_graph_capture_and_replay_match_eager(kv):
    """60 §5 on a GPU: capture a padded decode step, refresh the inputs in place, replay; the result
    must equal an eager call on the same inputs."""
    import dsattn
    torch.manual_seed(0)
    layer = DeepseekV4Attention(CFG, 4, seed=5, kv_cache_dtype=KV_DTYPES[kv])
    layer.w = {k: v.cuda() for k, v in layer.w.items()}
    layer.cos, layer.sin = layer.cos.cuda(), layer.sin.cuda()
    pb = PagedBatch(CFG, 64, 16)
    caches = layer.new_caches(64)
    for k, v in vars(caches).items():
        if v is not None:
            setattr(caches, k, v.cuda())
    X = [torch.randn(L + 2, CFG.hidden, device="cuda") for L in (40, 17, 33)]
    pre = pb.step([0, 1, 2], [40, 17, 33], CFG.heads)
    to_cuda = lambda st: type(st)(**{k: (v.cuda() if isinstance(v, torch.Tensor) else  # noqa: E731
                                          {r: p.cuda() for r, p in v.items()} if isinstance(v, dict) else v)
                                       for k, v in vars(st).items()})
    layer.forward(torch.cat([x[:-2] for x in X]), to_cuda(pre), caches)
    static_step = to_cuda(pb.step([0, 1, 2], [1, 1, 1], CFG.heads, pad_to=4))
    static_x = torch.cat([torch.cat([x[-2:-1] for x in X]), torch.zeros(1, CFG.hidden, device="cuda")])
    snapshot = {k: v.clone() for k, v in vars(caches).items() if v is not None}
    dsattn.set_content_checks(False)
    try:
        layer.forward(static_x, static_step, caches)                       # warm-up
        for k, v in snapshot.items():
            getattr(caches, k).copy_(v)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer.forward(static_x, static_step, caches)
        for k, v in snapshot.items():
            getattr(caches, k).copy_(v)
        graph.replay()
        replayed = static_out.clone()
        for k, v in snapshot.items():
            getattr(caches, k).copy_(v)
        eager = layer.forward(static_x, static_step, caches)
    finally:
        dsattn.set_content_checks(True)
    assert torch.allclose(replayed, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["SWA", "CSA", "HCA"])
def test_state_dict_official_names_round_trip(ratio):
    """Weights under the official tensor names: exported, loaded into a layer with other weights,
    the two layers then compute the same outputs; bad checkpoints are refused by name."""
    src = DeepseekV4Attention(CFG, ratio, seed=1)
    dst = DeepseekV4Attention(CFG, ratio, seed=2)
    sd = {f"model.layers.7.attn.{k}": v.bfloat16() for k, v in src.state_dict().items()}
    sd["model.layers.7.ffn.w1.weight"] = torch.zeros(3)                 # other modules are ignored
    names = {k.split("attn.", 1)[1] for k in sd if ".attn." in k}
    assert {"wq_a.weight", "wkv.weight", "attn_sink", "wo_a.weight", "wo_b.weight"} <= names
    assert ("compressor.ape" in names) == bool(ratio) and ("indexer.compressor.ape" in names) == (ratio == 4)
    assert sd["model.layers.7.attn.wo_a.weight"].shape == (CFG.o_groups * CFG.o_lora_rank,
                                                           CFG.heads * CFG.head_dim // CFG.o_groups)
    dst.load_state_dict(sd, prefix="model.layers.7.attn.")
    for k, v in dst.state_dict().items():
        assert torch.equal(v, src.state_dict()[k].bfloat16().double()), k
    src.load_state_dict({k: v.double() for k, v in dst.state_dict().items()})   # same bf16-rounded weights
    g = torch.Generator().manual_seed(0)
    X = [torch.randn(L, CFG.hidden, generator=g) for L in LENS]
    a, _, _, _ = run(src, X, SCHEDULES["chunks-23"])
    b, _, _, _ = run(dst, X, SCHEDULES["chunks-23"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    good = src.state_dict()
    with pytest.raises(ValueError, match="missing .*wkv.weight"):
        dst.load_state_dict({k: v for k, v in good.items() if k != "wkv.weight"})
    with pytest.raises(ValueError, match="unexpected .*bogus"):
        dst.load_state_dict(dict(good, bogus=torch.zeros(1)))
    with pytest.raises(ValueError, match="wq_b.weight has shape"):
        dst.load_state_dict(dict(good, **{"wq_b.weight": torch.zeros(3, 3)}))
    with pytest.raises(TypeError, match="dequantise FP8"):
        dst.load_state_dict(dict(good, **{"wkv.weight": good["wkv.weight"].to(torch.float8_e4m3fn)}))


@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["SWA", "CSA", "HCA"])
def test_released_pages_are_never_read_and_are_reused(ratio):
    """``release_old_pages``: raw pages below the window and the open compressor groups go back to
    the allocator (table entries -1).  Every free page is NaN before each step, so a read of a
    released page would show; the outputs equal those of the run that keeps every page, a
    request holds a bounded number of raw pages, and finished requests return all of theirs."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    lens = [300, 150, 45] if ratio == 128 else LENS     # HCA: past its open 128-token group
    X = [torch.randn(L, CFG.hidden, generator=g) for L in lens]
    layer = DeepseekV4Attention(CFG, ratio, seed=3)
    sched = [{b: min(20, L) for b, L in enumerate(lens)}]
    left = [max(L - 20, 0) for L in lens]
    while any(left):                                    # decode (ratio 0, 4) or 3-token draft-extend steps
        sched.append({b: min(1 if ratio != 128 else 3, n) for b, n in enumerate(left)})
        left = [n - sched[-1][b] for b, n in enumerate(left)]
    want, _, _, _ = run(layer, X, sched)
    pb = PagedBatch(CFG, 96, 24, release_old_pages=True)
    caches = layer.new_caches(96)
    done = {b: 0 for b in range(len(X))}
    outs = {b: [] for b in range(len(X))}
    ratios = (0, ratio) if ratio else (0,)
    held = 0
    for spec in sched:
        reqs = [b for b, n in spec.items() if n]
        news = [spec[b] for b in reqs]
        step = pb.step(reqs, news, CFG.heads, ratios)
        for t in (caches.window, caches.state):
            if t is not None:
                t[pb.free] = float("nan")
        y = layer.forward(torch.cat([X[b][done[b]:done[b] + n] for b, n in zip(reqs, news)]), step, caches)
        o = 0
        for b, n in zip(reqs, news):
            outs[b].append(y[o:o + n])
            o += n
            done[b] += n
            held = max(held, sum(p >= 0 for p in pb.raw_pages[b]))
            assert (step.raw_table[reqs.index(b), :len(pb.raw_pages[b])] == torch.tensor(pb.raw_pages[b])).all()
    for b in range(len(X)):
        assert torch.equal(torch.cat(outs[b]), want[b]), f"request {b}"
    need = max(CFG.window - 1, (compressor_overlap(ratio) * ratio) if ratio else 0) + 1
    assert held <= -(-need // CFG.page_size) + 1, held
    assert all(-1 in pb.raw_pages[b] for b in range(2))           # something was released
    for b in range(len(X)):
        pb.finish(b)
    assert sorted(pb.free) == list(range(1, 96))


def test_first_needed_position():
    pb = PagedBatch(CFG, 8, 4)
    W = CFG.window                                                  # 16 in the small preset
    assert pb.first_needed_position(100, (0,)) == 100 - W + 1
    assert pb.first_needed_position(100, (0, 4)) == 100 - W + 1   # CSA state: from (25 - 1)·4 = 96
    assert pb.first_needed_position(100, (0, 128)) == 0           # HCA state: the open group from 0
    assert pb.first_needed_position(300, (0, 128)) == 256
    assert pb.first_needed_position(5, (0, 4, 128)) == 0
    with pytest.raises(RuntimeError, match="max_pages_per_req"):
        pb.step([0], [5 * CFG.page_size], CFG.heads)


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["model", "int8"])
def test_v4_flash_dimensions_against_reference(kv):
    """The real V4-Flash attention dimensions (64 heads x 512, window 128, top-512, YaRN) in bf16,
    through the demo's serving loop and its dense float64 check (`pytest -m slow`, ~1 min each)."""
    from rich.console import Console

    from dsattn import serving_demo
    assert serving_demo.run(requests=2, decode_steps=2, preset="v4-flash", dtype=torch.bfloat16, kv_cache=kv,
                            console=Console(record=True, width=160))
