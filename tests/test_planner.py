"""sparse_attn_sharedkv_metadata (50-metadata-planner): hand-worked tables, fast == golden byte
for byte on 1000 random workloads, plan invariants, the seed's behaviour checks, the host
helper, and rejections."""
import random

import pytest
import torch

from dsattn import native, serving
from dsattn.planner import fast, native as native_planner, ref, table
from dsattn.planner.params import plan_params

import dsattn.sharedkv  # noqa: F401  (registers the ops)

meta = torch.ops.dsattn.sparse_attn_sharedkv_metadata


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def cu(lengths):
    out = [0]
    for x in lengths:
        out.append(out[-1] + x)
    return i32(out)


def fa(t, i):
    return t[8 * i:8 * i + 8].tolist()


def fd(t, v):
    return t[288 + 8 * v:288 + 8 * v + 8].tolist()


SWA = dict(has_cmp_kv=False, cmp_ratio=1)


def _golden_table(**kw):
    return table.encode(ref.plan(plan_params(**kw)))


def _both(**kw):
    """The operator's table, checked equal to the golden's and to its invariants."""
    t = meta(**kw)
    args = dict(kw)
    pp = plan_params(args.pop("num_heads_q"), args.pop("num_heads_kv"), args.pop("head_dim"), **args)
    g = table.encode(ref.plan(pp))
    assert torch.equal(t, g)
    rows = [ref.batch_rows(pp, b) for b in range(pp.B)]
    table.check_invariants(table.decode(t), lambda bn2: rows[bn2] if bn2 < pp.B else [], pp.B, pp.aic, pp.aiv,
                           pp.support_fd)
    return t


BASE = dict(num_heads_q=64, num_heads_kv=1, head_dim=512, layout_q="TND")


def test_worked_example_1_decode_swa():
    t = _both(**BASE, cu_seqlens_q=cu([1] * 8), seqused_kv=i32([1000] * 8), **SWA)
    assert t.dtype == torch.int32 and t.shape == (1024,)
    for i in range(8):
        assert fa(t, i) == [1, i, 0, 0, i + 1, 0, 0, 0]
    assert (t[64:] == 0).all()


def test_worked_example_2_single_query():
    t = _both(**BASE, cu_seqlens_q=cu([1]), seqused_kv=i32([640]), **SWA)
    assert fa(t, 0) == [1, 0, 0, 0, 1, 0, 0, 0] and (t[8:] == 0).all()


def test_worked_example_3_csa_32k_prefill():
    t = _both(**BASE, cu_seqlens_q=cu([32768]), seqused_kv=i32([32768]), cmp_ratio=4, cmp_topk=512)
    assert [fa(t, i)[0] for i in range(36)] == [1] * 24 + [0] * 12
    assert fa(t, 0) == [1, 0, 0, 0, 0, 1835, 0, 0]
    assert fa(t, 1) == [1, 0, 1835, 0, 0, 3180, 0, 0]
    assert fa(t, 2) == [1, 0, 3180, 0, 0, 4525, 0, 0]
    assert fa(t, 23) == [1, 0, 31423, 0, 1, 0, 0, 0]


def test_worked_example_4_split_kv():
    t = _both(**BASE, cu_seqlens_q=cu([1, 1]), seqused_kv=i32([100000, 300]), cmp_ratio=128, cmp_topk=0,
              aic_core_num=4, aiv_core_num=8, support_fd=True)
    assert [fa(t, i) for i in range(4)] == [[1, 0, 0, 0, 0, 0, 1, 0], [1, 0, 0, 1, 0, 0, 2, 1],
                                          [1, 0, 0, 2, 1, 0, 0, 2], [1, 1, 0, 0, 2, 0, 0, 3]]
    for v in range(8):
        assert fd(t, v) == [1, 0, 0, 0, 3, 8 * v, 8, 0]
    assert fd(t, 8)[0] == 0


def test_hand_worked_swa_prefill_tail_row():
    """S1 = S2 = 5, G 64, mBase 256: row 0 = queries 0..3, window [0, 3] (tail 4):
    Cost(256, 4) = 6·16 + 10·1 = 106; row 1 (tail row of 64) = query 4, window [0, 4]:
    Cost(64, 5) = 34.  Core 0: the batch (140) exceeds 106 + 34//2; row 0 fits (106 + 53 >= 106),
    row 1 does not (106 + 17 < 140).  Core 1 takes the rest of the batch."""
    pp = plan_params(**BASE, cu_seqlens_q=cu([5]), seqused_kv=i32([5]), **SWA)
    rows = ref.batch_rows(pp, 0)
    assert [(r.cost, r.blocks, r.first, r.last, r.win_tail) for r in rows] == [(106, 1, 0, 3, 4), (34, 1, 0, 4, 5)]
    t = _both(**BASE, cu_seqlens_q=cu([5]), seqused_kv=i32([5]), **SWA)
    assert fa(t, 0) == [1, 0, 0, 0, 0, 1, 0, 0] and fa(t, 1) == [1, 0, 1, 0, 1, 0, 0, 0] and fa(t, 2)[0] == 0


def test_hand_worked_csa_decode_two_requests():
    """Batch 0 (S2 4096): window [3968, 4095] = 1 block, tail 128: Cost(64, 128) = 44; compressed
    min(1024, 512) = 512 slots = 1 full block: Cost(64, 512) = 104; row cost 148.  Batch 1 (S2 10):
    Cost(64, 10) + Cost(64, 2) = 34 + 34 = 68.  Core 0 limit max(216 // 24, 148) = 148 takes batch 0
    (148 + 104//2 >= 148) but not batch 1 (148 + 17 < 216); core 1 takes batch 1."""
    pp = plan_params(**BASE, cu_seqlens_q=cu([1, 1]), seqused_kv=i32([4096, 10]), cmp_ratio=4, cmp_topk=512)
    r0, r1 = ref.batch_rows(pp, 0)[0], ref.batch_rows(pp, 1)[0]
    assert (r0.cost, r0.blocks, r0.first, r0.last, r0.act, r0.last_block_cost) == (148, 2, 3968, 4095, 512, 104)
    assert (r1.cost, r1.blocks, r1.act) == (68, 2, 2)
    t = _both(**BASE, cu_seqlens_q=cu([1, 1]), seqused_kv=i32([4096, 10]), cmp_ratio=4, cmp_topk=512)
    assert fa(t, 0) == [1, 0, 0, 0, 1, 0, 0, 0] and fa(t, 1) == [1, 1, 0, 0, 2, 0, 0, 0]


@pytest.mark.parametrize("B", [0, 3])
def test_all_empty_table(B):
    """Idle or all-empty batches: core 0 enabled over [0, B·N2), nothing else."""
    t = _both(**BASE, cu_seqlens_q=cu([0] * B), seqused_kv=i32([7] * B), cmp_ratio=4, cmp_topk=512)
    assert fa(t, 0) == [1, 0, 0, 0, B, 0, 0, 0] and (t[8:] == 0).all()
    t = _both(**BASE, cu_seqlens_q=cu([3] * 2), seqused_kv=i32([0, 0]), **SWA)
    assert fa(t, 0) == [1, 0, 0, 0, 2, 0, 0, 0] and (t[8:] == 0).all()


def test_seed_behaviour_checks():
    t = meta(**BASE, cu_seqlens_q=cu([1] * 8), seqused_kv=i32([5000] * 8), cmp_ratio=4, cmp_topk=512)
    assert sum(fa(t, i)[0] for i in range(36)) == 8
    assert all(fa(t, i)[1:5] == [i, 0, 0, i + 1] for i in range(8))
    t = meta(**BASE, cu_seqlens_q=cu([32768]), seqused_kv=i32([32768]), cmp_ratio=128, cmp_topk=0)
    assert sum(fa(t, i)[0] for i in range(36)) > 1
    again = meta(**BASE, cu_seqlens_q=cu([32768]), seqused_kv=i32([32768]), cmp_ratio=128, cmp_topk=0)
    assert torch.equal(t, again)


def random_workload(rng: random.Random) -> dict:
    B = rng.choice([1, 2, 3, 5, 8, 16, 32, 64, 128, 256])
    kind = rng.choice(["decode", "verify", "prefill", "mixed", "zero"])
    budget = 160_000 // B
    S1, S2 = [], []
    for _ in range(B):
        s2 = rng.choice([0, rng.randint(1, 600), rng.randint(1, 20000), rng.randint(1, 131072)])
        if kind == "decode":
            s1 = 1
        elif kind == "verify":
            s1 = rng.randint(1, 4)
        elif kind == "prefill":
            s1 = rng.randint(0, min(131072, budget))
            s2 = max(s2, s1) if rng.random() < 0.7 else s2                  # some S1 > S2
        elif kind == "zero":
            s1, s2 = rng.choice([0, 1, 3]), rng.choice([0, s2])
        else:
            s1 = rng.choice([1, 1, rng.randint(1, min(2048, budget))])
        S1.append(s1)
        S2.append(s2)
    scenario = rng.choice(["SWA", "CFA", "SCFA"])
    kw = {"SWA": dict(has_cmp_kv=False, cmp_ratio=rng.choice([1, -1])),
          "CFA": dict(cmp_ratio=rng.choice([4, 128]), cmp_topk=0),
          "SCFA": dict(cmp_ratio=rng.choice([4, 128]), cmp_topk=rng.choice([512, 1024]))}[scenario]
    aic = rng.randint(1, 36)
    support_fd = rng.random() < 0.5
    aiv = rng.randint(aic, 72) if support_fd else rng.randint(1, 72)
    mode = rng.choice([4, 4, 4, 3, 0])
    return dict(num_heads_q=rng.choice([64, 128]), num_heads_kv=1, head_dim=512, layout_q="TND",
                cu_seqlens_q=cu(S1), seqused_kv=i32(S2), aic_core_num=aic, aiv_core_num=aiv,
                support_fd=support_fd, ori_mask_mode=mode, ori_win_left=rng.choice([127, 127, 5, -1]), **kw)


@pytest.mark.parametrize("seed", range(4))
def test_native_run_compression_on_long_prefills(seed, native_module):
    """The compiled planner groups a batch's rows into runs of equal cost found by bisection (for
    m-blocks of whole queries) or by a row scan (other head counts, the high-performance cost):
    long prefills through every mask mode, window, ratio and head count, including head counts
    that do not divide the 256-row m-block, against the NumPy fast planner (equal to the golden
    on the 1000 workloads above), which costs every row."""
    if native_module is None:
        pytest.skip(f"no compiled planner here: {native.status()}")
    rng = random.Random(7000 + seed)
    for n in range(150):
        B = rng.choice([1, 2, 4, 7])
        S1 = [rng.choice([rng.randint(1, 9000), rng.randint(1, 300), 1]) for _ in range(B)]
        S2 = [max(s1 + rng.choice([0, 0, rng.randint(0, 40000)]), 1) if rng.random() < 0.8 else rng.randint(1, 9000)
              for s1 in S1]
        scenario = rng.choice(["SWA", "CFA", "SCFA", "HP"])
        kw = {"SWA": dict(has_cmp_kv=False, cmp_ratio=1),
              "CFA": dict(cmp_ratio=rng.choice([4, 128]), cmp_topk=0),
              "SCFA": dict(cmp_ratio=rng.choice([4, 128]), cmp_topk=rng.choice([512, 1024])),
              "HP": dict(cmp_ratio=4, cmp_topk=1024)}[scenario]
        heads = 128 if scenario == "HP" else rng.choice([3, 48, 64, 96, 128])
        support_fd = False if scenario == "HP" else rng.random() < 0.5
        aic = rng.randint(1, 36)
        args = dict(cu_seqlens_q=cu(S1), seqused_kv=i32(S2), layout_q="TND", aic_core_num=aic,
                    aiv_core_num=rng.randint(aic, 72) if support_fd else rng.randint(1, 72), support_fd=support_fd,
                    ori_mask_mode=rng.choice([4, 4, 3, 0]), ori_win_left=rng.choice([127, 0, 5, 1000, -1]), **kw)
        expected = table.encode(fast.plan(plan_params(heads, 1, 512, **args)))
        got = native_planner.plan_table(native_module, heads, 1, 512, **args)
        assert torch.equal(expected, got), f"workload {seed}/{n}: heads {heads}, S1 {S1}, S2 {S2}, {args}"


@pytest.fixture(params=["numpy", "native"])
def planner_path(request, monkeypatch, native_module):
    """Run a test through the NumPy fast planner (DSATTN_NATIVE=0) and through the compiled one."""
    if request.param == "numpy":
        monkeypatch.setenv("DSATTN_NATIVE", "0")
    elif native_module is None:
        pytest.skip(f"no compiled planner here: {native.status()}")
    return request.param


@pytest.mark.parametrize("chunk", range(8))
def test_fast_and_native_equal_golden_on_1000_random_workloads(chunk, native_module):
    """The NumPy fast planner and the compiled one (when this machine builds it) against the golden."""
    module = native_module
    rng = random.Random(1000 + chunk)
    for n in range(125):
        kw = random_workload(rng)
        args = dict(kw)
        pp = plan_params(args.pop("num_heads_q"), args.pop("num_heads_kv"), args.pop("head_dim"), **args)
        rows = [ref.batch_rows(pp, b) for b in range(pp.B)]
        g = ref.plan(pp, rows)
        f = table.encode(fast.plan(pp))
        assert torch.equal(table.encode(g), f), f"workload {chunk}/{n}: {kw}"
        if module is not None:
            args = dict(kw)
            t = native_planner.plan_table(module, args.pop("num_heads_q"), args.pop("num_heads_kv"),
                                          args.pop("head_dim"), **args)
            assert torch.equal(f, t), f"native, workload {chunk}/{n}: {kw}"
        table.check_invariants(g, lambda bn2: rows[bn2] if bn2 < pp.B else [], pp.B, pp.aic, pp.aiv,
                               pp.support_fd)


def test_invariant_checker_catches_broken_tables():
    kw = dict(**BASE, cu_seqlens_q=cu([1, 1]), seqused_kv=i32([100000, 300]), cmp_ratio=128, cmp_topk=0,
              aic_core_num=4, aiv_core_num=8, support_fd=True)
    t = meta(**kw)
    pp = plan_params(**{k: v for k, v in kw.items()})
    rows = [ref.batch_rows(pp, b) for b in range(pp.B)]

    def check(tt):
        table.check_invariants(table.decode(tt), lambda bn2: rows[bn2] if bn2 < pp.B else [], pp.B, 4, 8, True)
    check(t)
    for idx, value in ((6, 2), (8 + 3, 0), (4, 2), (288 + 4, 2), (288 + 5, 1)):
        bad = t.clone()
        bad[idx] = value
        with pytest.raises(AssertionError):
            check(bad)


@pytest.mark.parametrize("chunk", range(2))
def test_coverage_equals_the_walk_and_its_check_agrees(chunk):
    """The executor's vectorised reading of a plan (``coverage``: whole rows, partial segments
    with slots) equals the golden walk's segments on random workloads, and ``check_coverage``
    accepts what ``check_invariants`` accepts; on tables with one entry changed both checkers
    reject or both accept (the documented stricter case aside: a range bound past its row's
    blocks)."""
    rng = random.Random(500 + chunk)
    tried = rejected = 0
    for n in range(40):
        kw = random_workload(rng)
        args = dict(kw)
        pp = plan_params(args.pop("num_heads_q"), args.pop("num_heads_kv"), args.pop("head_dim"), **args)
        rw = fast.Rows(pp)
        t = table.encode(fast.plan(pp))
        for trial in range(4):
            tt = t.clone()
            if trial:
                i = rng.choice([8 * c + f for c in range(4) for f in range(1, 8)] +
                               [table.FD_BASE + 8 * c + f for c in range(2) for f in range(1, 7)])
                tt[i] = max(0, int(tt[i]) + rng.choice([-2, -1, 1, 2]))
            plan = table.decode(tt)
            cov = table.coverage(plan, rw)
            if trial == 0:
                segs = table.walk(plan, rw.views)
                whole = sorted(int(rw.off[s.bn2]) + s.m for s in segs if not s.partial)
                assert cov.whole.tolist() == whole, f"workload {chunk}/{n}"
                assert cov.partial == [s for s in segs if s.partial], f"workload {chunk}/{n}"
            golden = fast_check = None
            try:
                table.check_invariants(plan, rw.views, pp.B, pp.aic, pp.aiv, pp.support_fd)
            except AssertionError as e:
                golden = str(e)
            try:
                table.check_coverage(plan, rw, cov, pp.B, pp.aic, pp.aiv, pp.support_fd)
            except AssertionError as e:
                fast_check = str(e)
            tried += 1
            rejected += golden is not None
            if golden is None:
                assert fast_check is None or "past" in fast_check or "has blocks up to" in fast_check, \
                    f"workload {chunk}/{n} trial {trial}: only the fast check rejects: {fast_check}"
            else:
                assert fast_check is not None, f"workload {chunk}/{n} trial {trial}: golden rejects: {golden}"
    assert rejected > tried // 4, (rejected, tried)
    bad = t.clone()
    bad[2] = -1                                           # a negative row in core 0's start
    with pytest.raises(AssertionError, match="negative"):
        table.coverage(table.decode(bad), rw)


@pytest.mark.parametrize("over,arg", [
    (dict(cmp_topk=64), "cmp_topk"), (dict(cmp_ratio=7), "cmp_ratio"), (dict(num_heads_kv=2), "num_heads_kv"),
    (dict(ori_win_right=1), "ori_win_right"), (dict(ori_mask_mode=2), "ori_mask_mode"),
    (dict(cmp_mask_mode=0), "cmp_mask_mode"), (dict(has_ori_kv=False), "has_ori_kv"),
    (dict(aic_core_num=37), "aic_core_num"), (dict(aiv_core_num=0), "aiv_core_num"),
    (dict(support_fd=True, aic_core_num=24, aiv_core_num=8), "aiv_core_num"), (dict(layout_q="BNSD"), "layout_q"),
    (dict(cu_seqlens_q=i32([0, 5, 3])), "cu_seqlens_q"), (dict(seqused_kv=i32([5, -1])), "seqused_kv"),
    (dict(seqused_kv=i32([5])), "seqused_kv"), (dict(ori_win_left=-2), "ori_win_left"),
    (dict(head_dim=0), "head_dim")])
def test_rejections(over, arg, planner_path):
    kw = dict(**BASE, cu_seqlens_q=cu([3, 2]), seqused_kv=i32([5, 9]), cmp_ratio=4, cmp_topk=512)
    kw.update(over)
    with pytest.raises(ValueError, match=f"^{arg}"):
        meta(**kw)


def test_rejects_non_int32_lengths(planner_path):
    with pytest.raises(TypeError, match="^seqused_kv"):
        meta(**BASE, cu_seqlens_q=cu([3]), seqused_kv=torch.tensor([5]), **SWA)


def test_host_helper_contract(monkeypatch, planner_path):
    kw = dict(cmp_ratio=4, cmp_topk=512)
    c, s = cu([1, 7, 0]), i32([5000, 90, 3])
    want = meta(**BASE, cu_seqlens_q=c, seqused_kv=s, **kw)

    def no_pinning(*a, **k):
        raise AssertionError("pin_memory called on a CPU target")
    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning)
    got = serving.sparse_attn_sharedkv_metadata_host(64, 1, 512, "TND", "PA_ND", c, s, **kw)
    assert torch.equal(got, want) and got.device.type == "cpu" and not got.is_pinned()
    out = torch.full((1024,), 7, dtype=torch.int32)
    assert serving.sparse_attn_sharedkv_metadata_host(64, 1, 512, "TND", "PA_ND", c, s, out=out, **kw) is out
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="^cu_seqlens_q"):
        serving.sparse_attn_sharedkv_metadata_host(64, 1, 512, "TND", "PA_ND", c.to("meta"), s, **kw)
    with pytest.raises(ValueError, match="^seqused_kv"):
        serving.sparse_attn_sharedkv_metadata_host(64, 1, 512, "TND", "PA_ND", c, s.to("meta"), **kw)
    with pytest.raises(TypeError, match="^seqused_kv"):
        serving.sparse_attn_sharedkv_metadata_host(64, 1, 512, "TND", "PA_ND", c, s.long(), **kw)
    with pytest.raises(ValueError, match="^layout_q"):
        serving.sparse_attn_sharedkv_metadata_host(64, 1, 512, "BSND", "PA_ND", c, s, **kw)
    with pytest.raises(ValueError, match="^batch_size"):
        serving.sparse_attn_sharedkv_metadata_host(64, 1, 512, "TND", "PA_ND", c, s, batch_size=2, **kw)


def test_operator_copies_device_inputs_and_places_output():
    t = meta(**BASE, cu_seqlens_q=cu([2]), seqused_kv=i32([9]), device="cpu", **SWA)
    assert t.device.type == "cpu"


def test_plan_cli_and_plot(tmp_path, capsys):
    from dsattn.cli import main
    png = tmp_path / "plan.png"
    assert main(["plan", "--preset", "mixed", "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert main(["plan", "--lengths", "1:100000,1:300", "--scenario", "hca", "--cores", "4", "--aiv", "8",
                 "--fd"]) == 0
    text = capsys.readouterr().out
    assert "balance" in text and "FD tasks 1 on 8 vector cores" in text


@pytest.mark.parametrize("over", [dict(cu_seqlens_q=i32([0, 5, 3])), dict(cu_seqlens_q=i32([-1, 2, 5])),
                                  dict(cu_seqlens_q=i32([])), dict(seqused_kv=i32([5, -1])),
                                  dict(seqused_kv=i32([5])), dict(batch_size=3)],
                         ids=["decreasing", "negative-start", "empty", "negative-kv", "short-kv", "batch"])
def test_native_and_numpy_planners_reject_lengths_alike(over, monkeypatch, native_module):
    """The compiled planner resolves the length mirrors itself: same exception type and message."""
    if native_module is None:
        pytest.skip(f"no compiled planner here: {native.status()}")
    kw = dict(**BASE, cu_seqlens_q=cu([3, 2]), seqused_kv=i32([5, 9]), cmp_ratio=4, cmp_topk=512)
    kw.update(over)
    with pytest.raises(Exception) as compiled:
        meta(**kw)
    monkeypatch.setenv("DSATTN_NATIVE", "0")
    with pytest.raises(Exception) as numpy_path:
        meta(**kw)
    assert type(compiled.value) is type(numpy_path.value) is ValueError
    assert str(compiled.value) == str(numpy_path.value), (compiled.value, numpy_path.value)


@pytest.mark.parametrize("chunk", range(4))
def test_native_plan_reading_equals_numpy(chunk, native_module):
    """The executor's compiled reading of a plan (``plan_coverage``: row geometry, whole rows, partial
    pieces, FD entries, the first violated invariant) equals the NumPy reading (``Rows``, ``decode``,
    ``coverage``, ``check_coverage``) on random workloads and on tables with one entry changed
    (enable flags and negative values included): the same arrays, or the same message."""
    if native_module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    from dsattn.planner.params import FA_CORES, FD_CORES
    rng = random.Random(900 + chunk)
    rejected = 0
    for n in range(40):
        args = dict(random_workload(rng))
        pp = plan_params(args.pop("num_heads_q"), args.pop("num_heads_kv"), args.pop("head_dim"), **args)
        t = table.encode(fast.plan(pp))
        for trial in range(5):
            tt = t.clone()
            if trial:
                i = rng.choice([8 * c + f for c in range(4) for f in range(8)] +
                               [table.FD_BASE + 8 * c + f for c in range(3) for f in range(7)])
                tt[i] = int(tt[i]) + rng.choice([-2, -1, 1, 2])
            for check in (False, True):
                want = want_err = got = got_err = None
                try:
                    rw, plan = fast.Rows(pp, costs=False), table.decode(tt)
                    cov = table.coverage(plan, rw)
                    if check:
                        table.check_coverage(plan, rw, cov, pp.B, FA_CORES, FD_CORES, bool(plan.fd) or any(
                            s[2] for s in plan.starts) or any(e[2] for e in plan.ends))
                    want = (rw, plan.fd, cov)
                except AssertionError as e:
                    want_err = str(e)
                try:
                    got = native_planner.read_plan(native_module, tt, pp, check)
                except AssertionError as e:
                    got_err = str(e)
                where = f"workload {chunk}/{n} trial {trial} check {check}"
                assert got_err == want_err, where
                rejected += want_err is not None
                if want is None:
                    continue
                (rw, fd, cov), (grw, gfd, gcov) = want, got
                for name in ("off", "S1v", "first", "win_end", "s2_start", "s2_end", "blocks"):
                    assert getattr(grw, name).tolist() == getattr(rw, name).tolist(), f"{where}: {name}"
                assert gfd == [tuple(e) for e in fd], where
                assert gcov.whole.tolist() == cov.whole.tolist(), where
                assert gcov.partial == cov.partial, where
    assert rejected > 20, rejected
