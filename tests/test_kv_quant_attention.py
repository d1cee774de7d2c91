"""kv_quant_sparse_flash_attention (40-kv-quant §4): the test matrix of §4.8 against the golden,
the rope-0 / rope-64 equivalence, the uniform case, the full store -> attention pipeline and
the error paths."""
import pytest
import torch

from dsattn import cases, ops, quant, testing, verify

from conftest import assert_draws, randn

PAIRS = [("BSND", "PA_BSND"), ("TND", "PA_BSND"), ("TND", "TND")]


def _seed():
    return int(torch.randint(0, 2**31 - 1, ()).item())


def _run(case, fn=ops.kv_quant_sparse_flash_attention, **over):
    key, idx = case.extra["key"], case.extra["sparse_indices"]
    return fn(case.q, key, key, idx, **dict(case.kwargs, **over))


@pytest.mark.parametrize("lse", [False, True], ids=["lse-off", "lse-on"])
@pytest.mark.parametrize("rope", [0, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("batch", ["B1", "ragged-B3"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "+".join(p))
def test_matrix_against_golden(pair, batch, dtype, rope, lse):
    lengths = [(3, 29)] if batch == "B1" else None              # default: 3 ragged batches, a page tail
    def rows(seed):
        case = cases.qsfa_case(*pair, dtype, rope_head_dim=rope, lse=lse, lengths=lengths, seed=seed)
        out = _run(case)
        assert torch.isfinite(out[0]).all()                    # 0xFF rows never read
        if not lse:
            assert out[1].shape == (0,) and out[2].shape == (0,)
        return verify.qsfa_rows(case)

    assert_draws(rows)


@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("mode", [0, 3])
@pytest.mark.parametrize("block", [1, 4, 16])
@pytest.mark.parametrize("payload", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_payload_block_mode_sinks(payload, block, mode, sinks):
    pair = PAIRS[(block + mode) % 3]
    assert_draws(lambda seed: verify.qsfa_rows(cases.qsfa_case(
        *pair, torch.bfloat16, payload=payload, sparse_block_size=block, sparse_mode=mode, sinks=sinks, seed=seed)))


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "+".join(p))
def test_lse_flag_does_not_change_output(pair):
    case = cases.qsfa_case(*pair, torch.bfloat16, seed=_seed())
    on, off = _run(case, return_softmax_lse=True), _run(case, return_softmax_lse=False)
    assert torch.equal(on[0], off[0])


def _zero_pad_rope(case):
    """The rope-64 form of a compact rope-0 case (40 §4.5)."""
    key = case.extra["key"]
    u8 = key.view(torch.uint8)
    wide = torch.cat([u8[..., :512], torch.zeros(*u8.shape[:-1], 128, dtype=torch.uint8), u8[..., 512:]], -1)
    q = torch.cat([case.q, torch.zeros(*case.q.shape[:-1], 64, dtype=case.q.dtype)], -1)
    return q, wide.view(key.dtype)


@pytest.mark.parametrize("payload", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "+".join(p))
def test_rope0_equals_zero_padded_rope64(pair, payload):
    case = cases.qsfa_case(*pair, torch.bfloat16, rope_head_dim=0, payload=payload, seed=_seed())
    compact = _run(case)
    q, key = _zero_pad_rope(case)
    kw = dict(case.kwargs, rope_head_dim=64)
    wide = ops.kv_quant_sparse_flash_attention(q, key, key, case.extra["sparse_indices"], **kw)
    for a, b in zip(compact, wide):
        assert torch.equal(a, b)


def test_uniform_attention_is_the_mean_of_selected_rows(gen):
    """A zero query and no sinks: every score is 0, out = mean of the selected V rows, softmax_max 0,
    softmax_sum = n and lse = log n (40 §4.6)."""
    case = cases.qsfa_case("TND", "PA_BSND", torch.bfloat16, sinks=False, sparse_mode=0, seed=_seed())
    case.q = torch.zeros_like(case.q)
    out, smax, ssum = _run(case)
    key, idx, kw = case.extra["key"], case.extra["sparse_indices"], case.kwargs
    table, lens = kw["block_table"], kw["actual_seq_lengths_kv"].tolist()
    ends = kw["actual_seq_lengths_query"].tolist()
    bs_page = key.size(1)
    for b in range(len(ends)):
        for t in range(ends[b - 1] if b else 0, ends[b]):
            toks = []
            for v in idx[t, 0].tolist()[:lens[b]]:             # 40 §4.4: at most ceil(thr / bs) slots
                if v < 0:
                    break
                if v < lens[b]:
                    toks.append(v)
            if not toks:
                assert (out[t] == 0).all() and (smax[0, t] == 0).all() and (ssum[0, t] == 0).all()
                continue
            rows = torch.stack([key[table[b, x // bs_page], x % bs_page, 0] for x in toks])
            _, v = quant.dequant_kv_rows(rows, 64, torch.bfloat16)
            mean = v.float().mean(0)
            assert testing.standard_close(out[t], mean.expand_as(out[t]).to(out.dtype))
            assert (smax[0, t] == 0).all() and (ssum[0, t] == len(toks)).all()
            assert torch.allclose(smax[0, t] + torch.log(ssum[0, t]), torch.log(torch.tensor(float(len(toks)))))


@pytest.mark.parametrize("rope", [0, 64])
def test_store_then_attend_pipeline(rope, gen):
    """40 §4.8 item 8: write a paged cache through kv_rmsnorm_rope_quant_cache with -1 slots, check
    untouched slots and the scale offsets, then attend over it against a float reference built
    from dequant_kv_rows of the written rows."""
    T, W, bs, H = 40, quant.row_width(512, rope), 16, 4
    kv = randn(gen, T, 512 + rope, dtype=torch.bfloat16)
    gamma = randn(gen, 512, scale=0.2) + 1
    theta = torch.rand(T, rope, generator=gen) * 6
    cos, sin = (torch.cos(theta), torch.sin(theta)) if rope else (None, None)
    cache = torch.full((5, bs, 1, W), -1, dtype=torch.int8)   # 0xFF: NaN scales if ever read
    before = cache.clone()
    table = torch.tensor([[3, 1, 4]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, t // bs]) * bs + t % bs for t in range(T)])
    slots[[5, 17]] = -1
    packed = ops.kv_rmsnorm_rope_quant_cache(kv, gamma, cos, sin, cache, slots, rope_head_dim=rope)
    flat, bflat = cache.view(-1, W), before.view(-1, W)
    for t in (5, 17):
        x = int(table[0, t // bs]) * bs + t % bs
        assert torch.equal(flat[x], bflat[x])                  # slot -1: untouched
    off = 512 + 2 * rope
    assert off == {0: 512, 64: 640}[rope]
    live = slots >= 0
    scales = flat[slots[live]].view(torch.uint8)[:, off:off + 16].contiguous().view(torch.float32)
    assert torch.equal(scales, quant.unpack_kv_rows(packed[live], rope)[2])
    # attention: one batch, 6 queries, indices over written tokens only
    S1 = 6
    q = randn(gen, S1, H, 512 + rope, dtype=torch.bfloat16, scale=0.2)
    written = [t for t in range(T) if t not in (5, 17)]
    idx = torch.tensor([written[i * 5:(i * 5) + 7] for i in range(S1)], dtype=torch.int32)[:, None]
    scale = (512 + rope) ** -0.5
    out, smax, ssum = ops.kv_quant_sparse_flash_attention(
        q, cache, cache, idx, scale, block_table=table, actual_seq_lengths_query=torch.tensor([S1], dtype=torch.int32),
        actual_seq_lengths_kv=torch.tensor([T], dtype=torch.int32), layout_query="TND", layout_kv="PA_BSND",
        sparse_mode=3, rope_head_dim=rope, return_softmax_lse=True)
    k_all, v_all = quant.dequant_kv_rows(packed, rope, torch.bfloat16)
    for i in range(S1):
        thr = T - S1 + i + 1
        toks = [x for x in idx[i, 0].tolist() if x < thr]
        s = (q[i].float() @ k_all[toks].float().T) * scale
        e = torch.exp(s - s.amax(-1, keepdim=True))
        want = ((e.bfloat16().float() @ v_all[toks].float()) / e.sum(-1, keepdim=True)).to(torch.bfloat16)
        assert testing.compare(out[i], want), testing.compare(out[i], want)


def _err_case():
    return cases.qsfa_case("TND", "PA_BSND", torch.bfloat16, seed=3)


@pytest.mark.parametrize("rope", [-1, 32, 128])
def test_invalid_rope_head_dim(rope):
    with pytest.raises(ValueError, match="^rope_head_dim"):
        _run(_err_case(), rope_head_dim=rope)


def test_query_and_row_width_must_match_rope_head_dim():
    c64 = _err_case()
    c0 = cases.qsfa_case("TND", "PA_BSND", torch.bfloat16, rope_head_dim=0, seed=3)
    key0, key64 = c0.extra["key"], c64.extra["key"]
    idx = c64.extra["sparse_indices"]
    kw0, kw64 = c0.kwargs, c64.kwargs
    f = ops.kv_quant_sparse_flash_attention
    with pytest.raises(ValueError, match="^query"):           # rope 0, 576-wide query, 528-byte rows
        f(c64.q, key0, key0, idx, **dict(kw0, block_table=kw0["block_table"]))
    with pytest.raises(ValueError, match="^key"):             # rope 0, 512-wide query, 656-byte rows
        f(c0.q, key64, key64, idx, **dict(kw0, block_table=kw64["block_table"]))
    with pytest.raises(ValueError, match="^key"):             # rope 64, 576-wide query, 528-byte rows
        f(c64.q, key0, key0, idx, **dict(kw64, block_table=kw0["block_table"]))
    with pytest.raises(ValueError, match="^query"):           # rope 64, 512-wide query, 656-byte rows
        f(c0.q, key64, key64, idx, **kw64)


@pytest.mark.parametrize("attr,value", [("key_quant_mode", 1), ("value_quant_mode", 1), ("attention_mode", 1),
                                        ("quant_scale_repo_mode", 0), ("tile_size", 64), ("pre_tokens", 100),
                                        ("next_tokens", 0), ("sparse_mode", 1), ("sparse_block_size", 3),
                                        ("sparse_block_size", 256), ("layout_query", "BNSD"),
                                        ("layout_kv", "BSND")])
def test_fixed_attributes_rejected(attr, value):
    with pytest.raises(ValueError, match=f"^{attr}"):
        _run(_err_case(), **{attr: value})


def test_other_errors():
    c = _err_case()
    key, idx, kw = c.extra["key"], c.extra["sparse_indices"], c.kwargs
    f = ops.kv_quant_sparse_flash_attention
    with pytest.raises(TypeError, match="^query"):
        f(c.q.float(), key, key, idx, **kw)
    with pytest.raises(TypeError, match="^key"):
        f(c.q, key.view(torch.uint8), key.view(torch.uint8), idx, **kw)
    with pytest.raises(TypeError, match="^value"):
        f(c.q, key, key.view(torch.float8_e4m3fn), idx, **kw)
    with pytest.raises(ValueError, match="^value"):
        f(c.q, key, key[..., :600], idx, **kw)
    with pytest.raises(ValueError, match="key_dequant_scale"):
        f(c.q, key, key, idx, **dict(kw, key_dequant_scale=torch.ones(1)))
    with pytest.raises(ValueError, match="^block_table"):
        f(c.q, key, key, idx, **{k: v for k, v in kw.items() if k != "block_table"})
    with pytest.raises(ValueError, match="^actual_seq_lengths_query"):
        f(c.q, key, key, idx, **{k: v for k, v in kw.items() if k != "actual_seq_lengths_query"})
    with pytest.raises(ValueError, match="^sparse_indices"):
        f(c.q, key, key, idx[..., :0], **kw)
    with pytest.raises(ValueError, match="^sparse_block_size"):   # must divide the page size 16
        f(c.q, key, key, idx, **dict(kw, sparse_block_size=32))
    bad = kw["block_table"].clone()
    bad[0, 0] = 99
    with pytest.raises(ValueError, match="^block_table"):
        f(c.q, key, key, idx, **dict(kw, block_table=bad))
    with pytest.raises(ValueError, match="^actual_seq_lengths_kv"):
        f(c.q, key, key, idx, **dict(kw, actual_seq_lengths_kv=kw["actual_seq_lengths_kv"][:1]))


@pytest.mark.parametrize("path", ["compiled", "torch"])
@pytest.mark.parametrize("payload", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_compiled_kernel_reads_the_packed_cache_in_place(path, payload, monkeypatch):
    """On the CPU the compiled kernel runs QSFA over the packed cache as it lies (each listed token
    decoded as it is gathered, no dequantised copy): it receives the cache's bytes and their format.
    Both the compiled and the PyTorch paths meet the golden on outputs and statistics."""
    from dsattn import native
    from dsattn.kv_quant_attn import fast
    module = native.kernels()
    if path == "compiled" and module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    from dsattn.kv_quant_attn import compiled
    seen = []
    if path == "torch":
        monkeypatch.setattr(fast, "compiled_tokens", lambda P: None)
        monkeypatch.setattr(compiled, "run", lambda *a: None)
    else:
        real, real_step = module.sparse_attention_forward, module.qsfa_paged

        def spy(*args, **kwargs):
            seen.append(kwargs.get("formats"))
            return real(*args, **kwargs)

        def spy_step(*args):                   # the one-step path: the cache's bytes and their format
            taken = real_step(*args)
            if taken:
                seen.append([args[-1]])
            return taken
        monkeypatch.setattr(module, "sparse_attention_forward", spy)
        monkeypatch.setattr(module, "qsfa_paged", spy_step)
    assert_draws(lambda seed: verify.qsfa_rows(cases.qsfa_case("TND", "PA_BSND", torch.bfloat16, payload=payload,
                                                                sparse_block_size=4, seed=seed)))
    if path == "compiled":
        assert seen and all(f and len(f[0]) == 14 for f in seen), seen


@pytest.mark.parametrize("seed_offset", range(3))
def test_one_step_path_gives_the_python_paths_bits(seed_offset, monkeypatch):
    """The paged one-step path (dsattn/native/kv_quant.cpp) on random QSFA calls of the fuzz family (TND /
    BSND with padding rows, sparse blocks 1-16, modes 0 / 3, rope 0 / 64, int8 / fp8, sinks, statistics):
    where it takes a call, outputs and statistics are the Python path's bits; non-paged calls it declines."""
    from dsattn import native
    from dsattn.cases import fuzz
    from dsattn.kv_quant_attn import compiled
    if native.kernels() is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    base = _seed() + 1000 * seed_offset
    taken = 0
    for seed in range(base, base + 12):
        c = fuzz.qsfa_config(seed)
        kw = dict(c.kwargs)
        args = (c.q, c.extra["key"], c.extra["key"], c.extra["sparse_indices"])
        scale = kw.pop("scale_value", 1.0)
        for want in (False, True):
            kw["return_softmax_lse"] = want
            got = ops.kv_quant_sparse_flash_attention(*args, scale, **kw)
            step = compiled.run(*args, scale, {k: v for k, v in kw.items() if k != "return_softmax_lse"}, want)
            with monkeypatch.context() as m:
                m.setattr(compiled, "run", lambda *a: None)
                ref = ops.kv_quant_sparse_flash_attention(*args, scale, **kw)
            if kw.get("layout_kv") == "PA_BSND" and c.q.numel():
                assert step is not None, f"seed {seed}: a paged call was declined"
                taken += 1
            else:
                assert step is None
            for a, b in zip(got, ref):
                assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"seed {seed}"
    assert taken > 0


def _paged_qsfa_call():
    c = cases.qsfa_case("TND", "PA_BSND", torch.bfloat16, seed=_seed())
    return c.q, c.extra["key"], c.extra["sparse_indices"], dict(c.kwargs)


def _bad_qsfa(kw, idx):
    table, s2 = kw["block_table"], kw["actual_seq_lengths_kv"]
    bad_table = table.clone()
    bad_table[0, 0] = 10_000
    cap = table.size(1) * 16
    return {
        "a block number past the cache": dict(block_table=bad_table),
        "a length past the table": dict(actual_seq_lengths_kv=torch.tensor([cap + 1] + s2[1:].tolist(), dtype=torch.int32)),
        "a negative length": dict(actual_seq_lengths_kv=torch.tensor([-1] + s2[1:].tolist(), dtype=torch.int32)),
        "decreasing query ends": dict(actual_seq_lengths_query=kw["actual_seq_lengths_query"].flip(0)),
        "sinks float16": dict(sinks=torch.zeros(4, dtype=torch.float16)),
        "int64 indices": dict(sparse_indices=idx.long()),
        "int64 block table": dict(block_table=table.long()),
        "no block table": dict(block_table=None),
    }


@pytest.mark.parametrize("what", list(_bad_qsfa(_paged_qsfa_call()[3], _paged_qsfa_call()[2])))
def test_one_step_path_declines_what_the_checks_refuse(what):
    from dsattn import native
    from dsattn.kv_quant_attn import compiled
    if native.kernels() is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    q, key, idx, kw = _paged_qsfa_call()
    kw.pop("return_softmax_lse", None)
    change = _bad_qsfa(kw, idx)[what]
    idx = change.pop("sparse_indices", idx)
    kw.update(change)
    scale = kw.pop("scale_value", 1.0)
    assert compiled.run(q, key, key, idx, scale, kw, False) is None
    with pytest.raises((ValueError, TypeError)):
        ops.kv_quant_sparse_flash_attention(q, key, key, idx, scale, **{k: v for k, v in kw.items() if v is not None})
