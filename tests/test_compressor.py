"""compressor / compressor_inference (30-compressor): golden parity for every supported
combination, start_pos continuation, the fused variant against separate ops, gradients."""
import pytest
import torch

from dsattn import cases, ops, reference, testing, verify
from dsattn.common.rope import rotary

from conftest import assert_draws, randn

COMBOS = [(512, 2, 4), (128, 2, 4), (512, 1, 128)]          # C4A, C4Li, C128A (30 §1.2)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _seed():
    return int(torch.randint(0, 2**31 - 1, ()).item())


@pytest.mark.parametrize("cache_mode", [1, 2])
@pytest.mark.parametrize("packed", [False, True], ids=["3D", "2D"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"D{c[0]}-coff{c[1]}-r{c[2]}")
def test_golden_parity_real_combinations(combo, dtype, packed, cache_mode):
    """Real D / coff / r; ragged batches starting mid-group, a tail that does not fill a group,
    an empty batch; output, state rows, gradients and the fused variant against the golden."""
    D, coff, r = combo
    if r == 128:
        starts, lengths = (0, 200, 130), (300, 70, 0)
    else:
        starts, lengths = (0, 5, 3, 9), (13, 7, 0, 4)
    assert_draws(lambda seed: verify.compressor_rows(cases.compressor_case(
        D=D, coff=coff, r=r, H=32, dtype=dtype, packed=packed, cache_mode=cache_mode, starts=starts, lengths=lengths,
        rope_head_dim=64, seed=seed, block_size=16)))


def _weights(D, coff, r, H, total, g):
    """One sequence of ``total`` tokens and the layer's compressor weights (fp32)."""
    return (randn(g, total, H), randn(g, coff * D, H, scale=H ** -0.5), randn(g, coff * D, H, scale=H ** -0.5),
            randn(g, r, coff * D))


def _run_chunks(x_all, wkv, wgate, ape, r, coff, chunks, packed, block_size=8):
    total = x_all.size(0)
    nblk = -(-total // block_size)
    state = torch.full((nblk + 1, block_size, ape.size(1) * 2), float("nan"))
    table = torch.arange(1, nblk + 1, dtype=torch.int32)[None]
    outs, pos = [], 0
    for c in chunks:
        x = x_all[pos:pos + c]
        kw = dict(start_pos=torch.tensor([pos], dtype=torch.int32), coff=coff, state_block_table=table)
        if packed:
            out = ops.compressor(x, wkv, wgate, state, ape, r, cu_seqlens=torch.tensor([0, c], dtype=torch.int32),
                                 **kw)
            n = (pos + c) // r - pos // r
            outs.append(out[:n])
        else:
            out = ops.compressor(x[None], wkv, wgate, state, ape, r, **kw)[0]
            n = (pos + c) // r - pos // r
            assert (out[n:] == 0).all()                        # padding rows exactly zero
            outs.append(out[:n])
        pos += c
    return torch.cat(outs), state


def _split(total, parts):
    cuts = sorted(set(int(x) for x in torch.linspace(0, total, parts + 1).round().tolist()))
    return [b - a for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("packed", [False, True], ids=["3D", "2D"])
@pytest.mark.parametrize("combo", [(64, 2, 4), (32, 1, 16)], ids=["coff2-r4", "coff1-r16"])
def test_start_pos_continuation(combo, packed, gen):
    """Prefill in 1, 2 and 7 chunks and token-by-token decode leave the same compressed rows and
    the same state cache as one-shot compression (30 §2.5)."""
    D, coff, r = combo
    total, H = 4 * r + 3, 24
    x_all, wkv, wgate, ape = _weights(D, coff, r, H, total, gen)
    ref_out, ref_state = _run_chunks(x_all, wkv, wgate, ape, r, coff, [total], packed)
    assert ref_out.size(0) == total // r
    for chunks in (_split(total, 2), _split(total, 7), [1] * total):
        out, state = _run_chunks(x_all, wkv, wgate, ape, r, coff, chunks, packed)
        assert testing.fp32_math_close(out, ref_out), f"chunks {chunks}"
        assert torch.equal(state.isnan(), ref_state.isnan())
        assert testing.fp32_math_close(state.nan_to_num(0), ref_state.nan_to_num(0)), f"chunks {chunks}"


@pytest.mark.parametrize("rotary_mode", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_equals_composed_separate_ops(dtype, rotary_mode):
    """compressor_inference == compressor -> torch RMSNorm -> RoPE, each rounded to x's dtype."""
    case = cases.compressor_case(D=128, coff=2, r=4, dtype=dtype, packed=True, rope_head_dim=64,
                                 rotary_mode=rotary_mode, seed=_seed())
    args, kw = case.inference_args()
    fused = ops.compressor_inference(*args, **kw)
    x, wkv, wgate, state, ape, r = case.clone_args()
    c = ops.compressor(x, wkv, wgate, state, ape, r, **case.kwargs)
    inf = case.inference
    y = torch.nn.functional.rms_norm(c.float(), (c.size(-1),), inf["norm_weight"], inf["norm_eps"]).to(dtype)
    R = inf["rope_head_dim"]
    rope = rotary(y[:, -R:].float(), inf["rope_cos"], inf["rope_sin"], rotary_mode).to(dtype)
    composed = torch.cat([y[:, :-R], rope], dim=1)
    live = (c != 0).any(-1)
    composed[~live] = 0
    assert testing.compare(fused, composed), testing.compare(fused, composed)
    assert (fused[~live] == 0).all()


def test_rotary_matches_literal_formula(gen):
    from dsattn.compressor.ref import rotary_literal
    u, cs, sn = (torch.randn(3, 16, generator=gen) for _ in range(3))
    for mode in (1, 2):
        want = torch.stack([rotary_literal(u[i], cs[i], sn[i], mode) for i in range(3)])
        assert torch.equal(rotary(u, cs, sn, mode), want)


@pytest.mark.parametrize("packed", [False, True], ids=["3D", "2D"])
@pytest.mark.parametrize("combo", [(6, 2, 4), (5, 1, 3), (4, 2, 1)], ids=["coff2-r4", "coff1-r3", "coff2-r1"])
def test_gradcheck_float64(combo, packed):
    D, coff, r = combo
    case = cases.compressor_case(D=D, coff=coff, r=r, H=7, dtype=torch.float64, packed=packed, starts=(0, 5, 3),
                                 lengths=(9, 7, 2), block_size=4, seed=_seed())
    x, wkv, wgate, state, ape, rr = case.args
    state, ape = state.double(), ape.double()
    x = torch.nan_to_num(x, nan=0.0)                           # gradcheck perturbs padding rows too
    ins = [t.clone().requires_grad_() for t in (x, wkv, wgate, ape)]

    def f(x, wkv, wgate, ape):
        return ops.compressor(x, wkv, wgate, state.clone(), ape, rr, **case.kwargs)
    assert torch.autograd.gradcheck(f, ins, eps=1e-6, atol=1e-7)


def test_backward_ignores_padding_rows_and_nan_padding(gen):
    case = cases.compressor_case(D=16, coff=2, r=4, dtype=torch.float32, seed=_seed())
    x, wkv, wgate, state, ape, r = case.clone_args()
    assert x.isnan().any()                                      # padding rows are NaN
    leaves = [t.requires_grad_() for t in (x, wkv, wgate, ape)]
    out = ops.compressor(x, wkv, wgate, state, ape, r, **case.kwargs)
    grads = torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in grads)


def test_empty_and_tail_only_calls_write_but_do_not_emit(gen):
    case = cases.compressor_case(D=16, coff=2, r=4, dtype=torch.float32, starts=(1, 0), lengths=(2, 0),
                                 skip_writes=False, seed=_seed())
    x, wkv, wgate, state, ape, r = case.clone_args()
    out = ops.compressor(x, wkv, wgate, state, ape, r, **case.kwargs)
    assert (out == 0).all()
    changed = ~(state.view(torch.int32) == case.args[3].view(torch.int32)).all(-1)
    assert int(changed.sum()) == 2                              # the two tail tokens, nothing else


def test_no_state_table_prefill_from_zero(gen):
    """Without a table nothing is written; a call that needs history is an error."""
    x = torch.randn(1, 9, 8, generator=gen)
    w = torch.randn(8, 8, generator=gen)
    state = torch.zeros(2, 4, 16)
    ape = torch.randn(4, 8, generator=gen)
    out = ops.compressor(x, w, w.clone(), state, ape, 4, coff=1)
    assert out.shape == (1, 3, 8) and (out[0, 2] == 0).all() and (state == 0).all()
    want = reference.compressor(x, w, w.clone(), state.clone(), ape, 4, coff=1)
    assert testing.compare(out, want)
    with pytest.raises(ValueError, match="state_block_table"):
        ops.compressor(x, w, w.clone(), state, ape, 4, coff=1, start_pos=torch.tensor([2], dtype=torch.int32))


def test_torch_compile_and_export():
    case = cases.compressor_case(D=16, coff=2, r=4, dtype=torch.float32, packed=True, seed=1)
    args, kw = case.inference_args()
    want = ops.compressor_inference(*args, **kw)

    def step(*a):
        return torch.ops.dsattn.compressor_inference(*a, **kw)
    args2, _ = case.inference_args()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args2)
    assert torch.equal(got, want)
    assert torch.equal(args2[3].view(torch.int32), args[3].view(torch.int32))   # the state was written


def _err_args(**over):
    case = cases.compressor_case(D=16, coff=2, r=4, dtype=torch.float32, seed=4, cache_mode=over.pop("mode", 1))
    x, wkv, wgate, state, ape, r = case.clone_args()
    args = dict(x=x, wkv=wkv, wgate=wgate, state_cache=state, ape=ape, cmp_ratio=r)
    kw = dict(case.kwargs)
    for k, v in over.items():
        (args if k in args else kw)[k] = v
    return args, kw


def _call(**over):
    args, kw = _err_args(**over)
    return ops.compressor(*args.values(), **kw)


@pytest.mark.parametrize("over,exc,arg", [
    (dict(x=torch.zeros(3, 5, 8, dtype=torch.int32)), TypeError, "x"),
    (dict(wkv=torch.zeros(32, 24, dtype=torch.float16)), TypeError, "wkv"),
    (dict(state_cache=torch.zeros(4, 8, 64, dtype=torch.float16)), TypeError, "state_cache"),
    (dict(ape=torch.zeros(4, 32, dtype=torch.float16)), TypeError, "ape"),
    (dict(start_pos=torch.tensor([0, 5, 3, 9], dtype=torch.int64)[:3]), TypeError, "start_pos"),
    (dict(x=torch.zeros(2, 3, 4, 24)), ValueError, "x"),
    (dict(wkv=torch.zeros(32, 23)), ValueError, "wkv"),
    (dict(wgate=torch.zeros(31, 24)), ValueError, "wgate"),
    (dict(ape=torch.zeros(3, 32)), ValueError, "ape"),
    (dict(state_cache=torch.zeros(4, 8, 63)), ValueError, "state_cache"),
    (dict(cu_seqlens=torch.tensor([0, 3], dtype=torch.int32)), ValueError, "cu_seqlens"),
    (dict(seqused=torch.tensor([1, 2], dtype=torch.int32)), ValueError, "seqused"),
    (dict(coff=3), ValueError, "coff"),
    (dict(cmp_ratio=0), ValueError, "cmp_ratio"),
    (dict(cache_mode=3), ValueError, "cache_mode"),
    (dict(start_pos=torch.tensor([0, -1, 3], dtype=torch.int32)), ValueError, "start_pos"),
    (dict(seqused=torch.tensor([13, 7, 99], dtype=torch.int32)), ValueError, "seqused"),
])
def test_errors(over, exc, arg):
    with pytest.raises(exc, match=f"^{arg}"):
        _call(**over)


def test_state_table_content_errors():
    args, kw = _err_args()
    table = kw["state_block_table"]
    bad = table.clone()
    bad[1, 0] = 999                                             # out of range
    with pytest.raises(ValueError, match="^state_block_table"):
        ops.compressor(*args.values(), **dict(kw, state_block_table=bad))
    bad = table.clone()
    bad[1, 0] = 0                                               # batch 1 starts at 5: reads positions 0..4
    with pytest.raises(ValueError, match="^state_block_table: .*not backed"):
        ops.compressor(*args.values(), **dict(kw, state_block_table=bad))
    with pytest.raises(ValueError, match="^state_block_table: too short"):
        ops.compressor(*args.values(), **dict(kw, state_block_table=table[:, :1].contiguous()))
    args, kw = _err_args(mode=2)
    with pytest.raises(ValueError, match="^state_block_table: has"):
        ops.compressor(*args.values(), **dict(kw, state_block_table=kw["state_block_table"][:, :9].contiguous()))


def test_inference_errors():
    case = cases.compressor_case(D=16, coff=2, r=4, dtype=torch.bfloat16, seed=4, rope_head_dim=8)
    args, kw = case.inference_args()
    f = ops.compressor_inference
    with pytest.raises(ValueError, match="^rope_head_dim"):
        f(*args[:8], 7, args[9], **kw)
    with pytest.raises(ValueError, match="^rope_head_dim"):
        f(*args[:8], 18, args[9], **kw)
    with pytest.raises(ValueError, match="^rotary_mode"):
        f(*args, **dict(kw, rotary_mode=3))
    with pytest.raises(ValueError, match="^norm_eps"):
        f(*args, **dict(kw, norm_eps=0.0))
    with pytest.raises(ValueError, match="^norm_weight"):
        f(*args[:5], torch.ones(15), *args[6:], **kw)
    with pytest.raises(TypeError, match="^norm_weight"):
        f(*args[:5], torch.ones(16, dtype=torch.float16), *args[6:], **kw)
    with pytest.raises(ValueError, match="^rope_sin"):
        f(*args[:6], args[6][:, :2], *args[7:], **kw)
    with pytest.raises(TypeError, match="^rope_cos"):
        f(*args[:7], args[7].double(), *args[8:], **kw)
