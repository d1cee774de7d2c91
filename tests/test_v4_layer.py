"""60-serving / issue 6: the DeepSeek-V4 attention layer over paged caches against a dense
float64 reference, for every layer type and every forward mode: one-shot prefill, chunked
prefill in several chunk sizes, token-by-token decode, draft-extend with 2 and 4 tokens; the
paths agree with each other and leave the same caches."""
import pytest
import torch

from dsattn import testing
from dsattn.model import PRESETS, DeepseekV4Attention
from dsattn.model.layer import PagedBatch
from dsattn.model.reference import reference_layer

CFG = PRESETS["small"]
LENS = [70, 37, 45]


def fresh(layer, pages, poison=True):
    """A page allocator and the layer's caches; every cache NaN when ``poison``."""
    pb = PagedBatch(CFG, pages, 16)
    caches = layer.new_caches(pages)
    if poison:
        for t in vars(caches).values():
            if t is not None:
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


def test_serving_demo_runs_and_matches_reference():
    from rich.console import Console

    from dsattn import serving_demo
    console = Console(record=True, width=160)
    assert serving_demo.run(requests=5, decode_steps=3, console=console)
    text = console.export_text()
    for needle in ("prefill throughput", "decode throughput", "KV row bytes", "planner balance",
                   "time share: sparse_attn_sharedkv", "dense float64 reference"):
        assert needle in text


def test_ops_demo_still_runs():
    from rich.console import Console

    from dsattn import demo
    assert demo.run(tokens=64, console=Console(record=True, width=160))


def _decode_setup(ratio, gen, poison=True):
    """Three requests prefilled, then one decode step padded to a bucket of 5 (graph replay)."""
    layer = DeepseekV4Attention(CFG, ratio, seed=5)
    pb, caches = fresh(layer, 64, poison)
    lens = [40, 17, 33]
    X = [torch.randn(L + 1, CFG.hidden, generator=gen) for L in lens]
    step = pb.step([0, 1, 2], lens, CFG.heads)
    layer.forward(torch.cat([x[:-1] for x in X]), step, caches)
    return layer, pb, caches, X


def _snapshot(caches):
    return {k: v.clone() for k, v in vars(caches).items() if v is not None}


@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["SWA", "CSA", "HCA"])
def test_padded_decode_step_reads_no_device_data_and_padding_changes_nothing(ratio, gen, monkeypatch):
    import dsattn
    layer, pb, caches, X = _decode_setup(ratio, gen)
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
        raise AssertionError("host read of tensor data inside the decode step")
    dsattn.set_content_checks(False)
    try:
        for name in ("item", "cpu", "tolist", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, forbidden)
        monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
        got = layer.forward(x_pad, step, caches)
    finally:
        monkeypatch.undo()
        dsattn.set_content_checks(True)
    assert torch.allclose(got[:3], want, rtol=1e-5, atol=1e-6)
    for k, v in _snapshot(caches).items():
        e = getattr(ref_caches, k)
        # padding wrote nothing: the same rows are still NaN (unwritten) as after the unpadded step;
        # written rows agree to rounding (a GEMM over 5 rows need not be bitwise the one over 3)
        assert torch.equal(v.isnan(), e.isnan()), k
        assert torch.allclose(v.nan_to_num(0.0), e.nan_to_num(0.0), rtol=1e-5, atol=1e-6), k


@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["SWA", "CSA", "HCA"])
def test_decode_step_compiles_fullgraph(ratio, gen):
    import dsattn
    layer, pb, caches, X = _decode_setup(ratio, gen, poison=False)
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
    for k, v in _snapshot(caches).items():
        assert torch.allclose(v, getattr(eager_caches, k), rtol=1e-6, atol=1e-7), k


def test_demo_cli_smoke():
    """`dsattn demo --steps 2` as CI runs it."""
    from dsattn.cli import main
    assert main(["demo", "--steps", "2"]) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_cuda_graph_capture_and_replay_match_eager():
    """60 §5 on a GPU: capture a padded decode step, refresh the inputs in place, replay; the result
    must equal an eager call on the same inputs."""
    import dsattn
    torch.manual_seed(0)
    layer = DeepseekV4Attention(CFG, 4, seed=5)
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
