"""The one-step compiled path of ``sparse_attn_sharedkv`` (dsattn/sharedkv/compiled.py): where it takes a
call its output is the Python path's, bit for bit; where an argument is off it declines (writes nothing,
returns None) and the operator raises the Python path's error."""
from __future__ import annotations

import pytest
import torch

from dsattn import native, ops
from dsattn.cases import fuzz
from dsattn.quant.rows import PackedKV
from dsattn.sharedkv import compiled

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="the compiled layer is not built here")


def _python_path(monkeypatch, op, q, kw):
    with monkeypatch.context() as m:
        m.setattr(compiled, "run", lambda *a: None)
        return op(q, **kw)[0]


def _packed_of(kw):
    return PackedKV(kw.get("kv_rope_dim", 64), kw.get("kv_tile_size", 64))


@pytest.mark.parametrize("family", ["sharedkv", "packed"])
def test_same_bits_as_the_python_path(family, monkeypatch):
    """Random calls of the fuzz families (layouts, ratios 1 / 4 / 128, mask modes, windows, ragged and
    empty requests, -1 padded lists, cmp_topk_length, sinks, dtypes, int8 / fp8 rows), their plan
    dropped: the paged ones with query rows are taken, and give the Python path's bits; the others are
    declined."""
    make = fuzz.sharedkv_config if family == "sharedkv" else fuzz.packed_config
    op = ops.sparse_attn_sharedkv if family == "sharedkv" else ops.sparse_attn_sharedkv_packed
    base = int(torch.randint(0, 2**31 - 1000, ()))
    taken = 0
    for seed in range(base, base + 40):
        c = make(seed)
        kw = dict(c.kwargs)
        packed = _packed_of(kw) if family == "packed" else None
        step_kw = {k: v for k, v in kw.items() if k not in ("kv_rope_dim", "kv_tile_size")}
        got = compiled.run(c.q, packed, step_kw)
        if kw.get("layout_kv") == "PA_ND" and c.q.dtype != torch.float64 and c.q.numel():
            assert got is not None, f"{c.name} (seed {seed}): a paged call was declined"
            taken += 1
            want = _python_path(monkeypatch, op, c.q, kw)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{c.name} (seed {seed})"
            assert torch.equal(op(c.q, **kw)[0].view(torch.uint8), want.view(torch.uint8))
        else:
            assert got is None, c.name
    assert taken > 0, "no paged call drawn"


def _decode_call(ratio=4, dtype=torch.bfloat16, B=3):
    """A paged decode call: B requests, one query row each (TND), every cache row NaN but the ones the
    block tables map."""
    from dsattn.cases import sharedkv_case
    c = sharedkv_case("TND", ratio, dtype, paged=True, seed=int(torch.randint(0, 2**31 - 1, ())),
                      lengths=[(1, 70 + 9 * b) for b in range(B)])
    return c.q, dict(c.kwargs)


def test_a_decode_call_takes_one_step(monkeypatch):
    module = native.kernels()
    calls = []
    real = module.sharedkv_paged
    monkeypatch.setattr(module, "sharedkv_paged", lambda *a: calls.append(1) or real(*a))
    q, kw = _decode_call()
    ops.sparse_attn_sharedkv(q, **kw)
    assert calls == [1]


def _bad_calls(q, kw):
    """(what, the changed arguments) that the Python checks refuse."""
    table, s2o = kw["ori_block_table"], kw["seqused_kv"]
    cu = kw["cu_seqlens_q"]
    bad_table = table.clone()
    bad_table[1, (int(s2o[1]) - 1) // kw["ori_kv"].size(1)] = 10_000       # the block of batch 1's last key
    short = table[:, :1].contiguous()
    idx = kw["cmp_sparse_indices"]
    return [
        ("negative seqused_kv", dict(seqused_kv=torch.tensor([-1] + s2o[1:].tolist(), dtype=torch.int32))),
        ("seqused_kv int64", dict(seqused_kv=s2o.long())),
        ("seqused_kv of another batch", dict(seqused_kv=s2o[:-1])),
        ("a block number past the cache", dict(ori_block_table=bad_table)),
        ("a table too short", dict(ori_block_table=short)),
        ("cu_seqlens_q decreasing", dict(cu_seqlens_q=torch.tensor([0, 2, 1, 3], dtype=torch.int32))),
        ("cu_seqlens_q not from 0", dict(cu_seqlens_q=cu + 1)),
        ("sinks float16", dict(sinks=torch.zeros(q.size(-2), dtype=torch.float16))),
        ("sinks of another head count", dict(sinks=torch.zeros(q.size(-2) + 1))),
        ("cmp_topk_length past K", dict(cmp_topk_length=torch.full((3,), idx.size(-1) + 1, dtype=torch.int32))),
        ("cmp_topk_length of another shape", dict(cmp_topk_length=torch.zeros(q.size(0) + 1, dtype=torch.int32))),
        ("cmp indices int64", dict(cmp_sparse_indices=idx.long())),
        ("cmp indices of another shape", dict(cmp_sparse_indices=idx[:, :, None])),
        ("cmp_ratio 0", dict(cmp_ratio=0)),
        ("ori_mask_mode 2", dict(ori_mask_mode=2)),
        ("ori_win_left -2", dict(ori_win_left=-2)),
        ("ori_kv of another dtype", dict(ori_kv=kw["ori_kv"].float())),
        ("ori_kv of another head dim", dict(ori_kv=kw["ori_kv"][..., :-1].contiguous())),
        ("no ori_block_table", dict(ori_block_table=None)),
        ("no seqused_kv", dict(seqused_kv=None)),
        ("cmp indices without cmp_kv", dict(cmp_kv=None, cmp_block_table=None, cmp_topk_length=None)),
    ]


@pytest.mark.parametrize("what", [w for w, _ in _bad_calls(*_decode_call())])
def test_bad_arguments_are_declined_and_raised_by_the_python_path(what):
    q, kw = _decode_call()
    changes = dict(_bad_calls(q, kw))[what]
    kw.update(changes)
    kw = {k: v for k, v in kw.items() if v is not None or k in changes}
    assert compiled.run(q, None, kw) is None
    with pytest.raises((ValueError, TypeError, IndexError)):
        ops.sparse_attn_sharedkv(q, **{k: v for k, v in kw.items() if v is not None})


def test_other_shapes_are_declined():
    """A plan, non-contiguous caches, float64, the flash opt-in: the Python path runs them."""
    q, kw = _decode_call()
    assert compiled.run(q, None, kw) is not None
    plan = torch.zeros(1024, dtype=torch.int32)
    assert compiled.run(q, None, dict(kw, metadata=plan)) is None
    strided = kw["ori_kv"].transpose(0, 1).contiguous().transpose(0, 1)
    assert compiled.run(q, None, dict(kw, ori_kv=strided)) is None
    assert compiled.run(q.double(), None, kw) is None
    assert compiled.run(q, None, dict(kw, layout_kv="TND")) is None


def test_reasons_name_why_a_call_is_declined():
    """What ``dsattn bench --which`` prints: no reason for a paged bf16 CPU call, the reason otherwise."""
    from dsattn.which import describe
    q, kw = _decode_call()
    assert compiled.reasons(q, kw) == []
    assert any("paged" in r for r in compiled.reasons(q, dict(kw, layout_kv="TND")))
    assert any("float64" in r for r in compiled.reasons(q.double(), kw))
    assert any("plan" in r for r in compiled.reasons(q, dict(kw, metadata=torch.zeros(1024, dtype=torch.int32))))
    assert "sparse_attn_sharedkv over paged caches, a bf16 CPU call: one compiled step" in describe()
