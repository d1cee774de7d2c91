"""FlashMLA's own test families through ``dsattn.flashmla``: its case lists (sparse prefill, sparse
decode with FP8 / bf16 main and extra caches, dense decode with several KV heads), its generators'
features (sinks drawn with ±inf, rows whose indices are all invalid, ``topk_length`` 0, zero-length
and ragged caches, odd block sizes, non-contiguous inputs, invalid indices of every kind FlashMLA
draws) and its tolerances, against an independent float64 transcription of FlashMLA's reference
formulas (its ``tests/ref.py`` and the dense test's reference):

* scores ``P = sm_scale · q·k`` over the gathered keys, ``-inf`` at invalid slots;
* ``lse = logsumexp(P)`` without the sink, ``+inf`` for a query with no valid key;
* ``out = Σ exp(P - lse_o) · v`` with ``lse_o = logaddexp(lse, sink)`` (the sink is one more
  logit with a zero value: ``+inf`` takes all the weight, ``-inf`` none), 0 for a query with no key;
* dense decode: query head ``i`` reads KV head ``i // (h_q / h_kv)``; causal aligns the ``s_q``
  queries to the end of the cache (query ``i`` sees keys ``j <= i + s_k - s_q``).

Cache tokens no index (or length) reads are NaN (bf16) or 0xFF bytes (FP8), so a stray read shows.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch

from dsattn import flashmla, testing
from dsattn.quant import flashmla as F

BF16 = torch.bfloat16
INF = float("inf")
# FlashMLA's generator draws these as invalid prefill indices (negative, or at / past s_kv)
INVALID_CANDIDATES = (-2147483648, -123456, -1, None, 114514, 1919810, 2147480000, 2147483647)   # None: s_kv


# ----------------------------------------------------------------------------- the reference, float64
def reference(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, scale: float, d_v: int,
              sink: Optional[torch.Tensor]):
    """FlashMLA's formulas.  ``q [s, h_q, d]``; ``kv [s or 1, h_kv, W, d]`` (per query row, or shared by
    all rows) with every invalid slot holding finite values; ``valid [s, W]``.  Returns float64
    ``(out [s, h_q, d_v], lse [s, h_q], max_logits [s, h_q])``."""
    s, h_q, d = q.shape
    h_kv = kv.size(1)
    qg = q.double().reshape(s, h_kv, h_q // h_kv, d)
    k = kv.double()
    logits = scale * torch.matmul(qg, k.transpose(-1, -2))                          # [s, h_kv, g, W]
    logits = logits.masked_fill(~valid[:, None, None, :], -INF).reshape(s, h_q, -1)
    lse = torch.logsumexp(logits, -1)                                                # -inf: no valid key
    max_logits = logits.amax(-1) if logits.size(-1) else torch.full_like(lse, -INF)
    lse_o = lse if sink is None else torch.logaddexp(lse, sink.double()[None])
    lse_o = torch.where(lse_o == -INF, torch.full_like(lse_o, INF), lse_o)           # so that out is 0
    p = torch.exp(logits - lse_o[..., None]).reshape(s, h_kv, h_q // h_kv, -1)
    out = torch.matmul(p, k[..., :d_v]).reshape(s, h_q, d_v)
    lse = torch.where(lse == -INF, torch.full_like(lse, INF), lse)
    return out, lse, max_logits


def test_reference_on_the_sink_and_empty_row_grid():
    """The transcription itself on {empty, finite row} x {+inf, -inf, finite, no sink}."""
    q = torch.randn(2, 3, 8, dtype=torch.float64)
    kv = torch.randn(2, 1, 4, 8, dtype=torch.float64)
    valid = torch.tensor([[False] * 4, [True, True, False, True]])
    sink = torch.tensor([INF, -INF, 0.3], dtype=torch.float64)
    out, lse, mx = reference(q, kv, valid, 0.5, 8, sink)
    plain, plain_lse, _ = reference(q, kv, valid, 0.5, 8, None)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == INF).all())
    assert bool((mx[0] == -INF).all())
    assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))                   # +inf sink: all the weight
    assert torch.allclose(out[1, 1], plain[1, 1])                                # -inf sink: none
    assert torch.allclose(out[1, 2], plain[1, 2] / (1 + math.exp(0.3) / torch.exp(plain_lse[1, 2])))
    assert torch.equal(lse, plain_lse)                                           # the LSE excludes the sink


def check(name, actual, expected, abs_tol, rel_tol, cos_tol=None):
    res = testing.flashmla_close(actual, expected, abs_tol=abs_tol, rel_tol=rel_tol, max_cos_diff=cos_tol)
    assert res, f"{name}: {res}"


# ----------------------------------------------------------------------------- generators
def draw_sinks(h: int, g: torch.Generator) -> torch.Tensor:
    """FlashMLA's sinks: normal, a third of the heads ``-inf``, a third ``+inf``."""
    sink = torch.randn(h, generator=g)
    mask = torch.randn(h, generator=g)
    sink[mask < -0.5] = -INF
    sink[mask > 0.5] = INF
    sink[0], sink[-1] = INF, -INF                                  # both kinds in every case
    return sink


def strided(x: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous view (FlashMLA's tests pass non-contiguous inputs)."""
    wide = torch.empty(*x.shape[:-1], x.size(-1) + 8, dtype=x.dtype)
    wide[..., :x.size(-1)] = x
    return wide[..., :x.size(-1)]


def random_rows(n: int, ranges: torch.Tensor, k: int, g: torch.Generator) -> torch.Tensor:
    """``[n, k]`` int64: row ``i`` holds distinct values of ``[0, ranges[i])`` in random order, as many as
    fit, then ``-1``."""
    hi = max(int(ranges.max()) if n else 0, k, 1)
    r = torch.rand(n, hi, generator=g)
    r[torch.arange(hi)[None] >= ranges[:, None]] = -1.0                          # out of range: drawn last
    vals, pos = r.topk(k, -1)
    return torch.where(vals >= 0, pos, torch.full_like(pos, -1))


def poison_fp8(cache: torch.Tensor, unread: torch.Tensor) -> None:
    """0xFF bytes (fp8 NaN) in the payload of every unread token ``unread [nb, bs]``."""
    layout = F.layout_of(cache)
    u8 = cache.view(torch.uint8)
    if not layout.block_major:
        u8[unread] = 0xFF
        return
    nb, bs = unread.shape
    body = layout.d_nope + 2 * layout.d_rope
    blocks = u8.reshape(nb, bs * layout.row_bytes)
    tokens = blocks[:, :bs * body].view(nb, bs, body)
    tokens[unread] = 0xFF


# ----------------------------------------------------------------------------- sparse prefill
@dataclasses.dataclass
class Prefill:
    s_q: int
    s_kv: int
    topk: int
    h_q: int = 64
    d_qk: int = 512
    sink: bool = False
    topk_length: bool = False
    all_invalid: bool = False


PREFILL = [
    Prefill(1, 128, 128, 128, 576),
    Prefill(62, 592, 128, 64, 512),
    Prefill(13, 95, 128, 128, 576),                                     # topk past s_kv: padded with invalid slots
    Prefill(62, 153, 256, 64, 512, sink=True),
    Prefill(21, 1840, 256, 128, 576, sink=True, topk_length=True),
    Prefill(62, 114, 384, 64, 512, sink=True, topk_length=True),
    Prefill(1, 256, 256, 64, 576, sink=True, topk_length=True, all_invalid=True),
    Prefill(40, 300, 256, 64, 512, sink=True, topk_length=True, all_invalid=True),
    Prefill(16, 32, 512, 64, 576, sink=True, topk_length=True),        # most slots invalid
]


@pytest.mark.parametrize("p", PREFILL, ids=lambda p: f"sq{p.s_q}-skv{p.s_kv}-k{p.topk}-h{p.h_q}-d{p.d_qk}"
                         f"{'-sink' if p.sink else ''}{'-len' if p.topk_length else ''}{'-invalid' if p.all_invalid else ''}")
def test_sparse_prefill(p: Prefill, gen):
    g = gen
    off_q, off_kv = (torch.rand(2, generator=g) - 0.5) / 10
    q = (torch.randn(p.s_q, p.h_q, p.d_qk, generator=g) / 10 + off_q).to(BF16)
    kv = (torch.randn(p.s_kv, 1, p.d_qk, generator=g) / 10 + off_kv).to(BF16)
    idx = random_rows(p.s_q, torch.full((p.s_q,), p.s_kv), p.topk, g)
    fillers = torch.tensor([p.s_kv if c is None else c for c in INVALID_CANDIDATES])
    pick = fillers[torch.randint(0, len(fillers), idx.shape, generator=g)]
    idx = torch.where(idx >= 0, idx, pick)
    idx[torch.rand(idx.shape, generator=g) < 0.05] = -1                              # -1 inside a list masks a slot
    if p.all_invalid:
        rows = torch.randn(p.s_q, generator=g) < -1
        rows[0] = True
        idx[rows] = int(fillers[int(torch.randint(0, len(fillers), (), generator=g))])
    idx = idx.to(torch.int32)[:, None, :]
    sink = draw_sinks(p.h_q, g) if p.sink else None
    length = None
    if p.topk_length:
        length = torch.randint(0, max(p.topk + 1, 64), (p.s_q,), generator=g, dtype=torch.int32).clamp_max(p.topk)
        length[-1] = 0
    valid = (idx[:, 0] >= 0) & (idx[:, 0] < p.s_kv)
    if length is not None:
        valid &= torch.arange(p.topk)[None] < length[:, None]
    read = torch.zeros(p.s_kv, dtype=torch.bool)
    read[idx[:, 0][valid].long()] = True
    kv[~read] = float("nan")
    scale = 0.5
    out, mx, lse = flashmla.flash_mla_sparse_fwd(strided(q), strided(kv), strided(idx), scale, d_v=512,
                                                 attn_sink=sink, topk_length=length)
    keys = kv[torch.where(valid, idx[:, 0], 0).long(), 0].double()
    keys = torch.where(valid[..., None], keys, torch.zeros((), dtype=torch.float64))
    want, want_lse, want_mx = reference(q, keys[:, None], valid, scale, 512, sink)
    assert out.dtype == BF16 and out.shape == (p.s_q, p.h_q, 512)
    check("out", out.float(), want.float(), 8e-4, 3.01 / 128, 7e-6)
    check("max_logits", mx, want_mx, 1e-6, 2.01 / 65536)
    check("lse", lse, want_lse, 1e-6, 2.01 / 65536)


# ----------------------------------------------------------------------------- sparse decode
@dataclasses.dataclass
class Scope:
    s_k: int
    topk: int
    block_size: int
    topk_length: bool = False


@dataclasses.dataclass
class Decode:
    b: int
    s_q: int
    h_q: int
    d_qk: int
    main: Scope
    extra: Optional[Scope] = None
    fp8: bool = True
    varlen: bool = True
    zero_seqlen: bool = False
    all_invalid: bool = False
    sink: bool = True


DECODE = [
    Decode(4, 1, 64, 576, Scope(512, 64, 2)),
    Decode(4, 3, 128, 576, Scope(1024, 576, 61)),
    Decode(3, 2, 64, 576, Scope(2046, 2048, 576), varlen=False),
    Decode(4, 3, 64, 576, Scope(650, 576, 53), zero_seqlen=True, all_invalid=True),
    Decode(4, 3, 64, 576, Scope(512, 64, 61), zero_seqlen=True, sink=False),
    Decode(4, 1, 64, 576, Scope(512, 64, 69), fp8=False),
    Decode(4, 1, 64, 512, Scope(512, 64, 64, topk_length=True)),
    Decode(4, 3, 128, 512, Scope(512, 64, 69), Scope(1024, 576, 2, topk_length=True)),
    Decode(4, 3, 64, 512, Scope(1024, 576, 61, topk_length=True), Scope(512, 64, 64, topk_length=True),
           fp8=False),
    Decode(4, 3, 64, 512, Scope(650, 576, 53, topk_length=True), Scope(512, 64, 61, topk_length=True),
           zero_seqlen=True, all_invalid=True),
    Decode(4, 3, 64, 512, Scope(512, 64, 61), Scope(650, 576, 53), zero_seqlen=True, fp8=False),
    Decode(2, 2, 64, 512, Scope(2046, 2048, 2), Scope(512, 64, 576)),
]


def decode_id(c: Decode) -> str:
    def sc(s):
        return f"{s.s_k}-{s.topk}-bs{s.block_size}{'-len' if s.topk_length else ''}"
    return (f"b{c.b}-sq{c.s_q}-h{c.h_q}-d{c.d_qk}-{sc(c.main)}" + (f"+extra{sc(c.extra)}" if c.extra else "")
            + ("-fp8" if c.fp8 else "-bf16") + ("-zero" if c.zero_seqlen else "")
            + ("-invalid" if c.all_invalid else "") + ("" if c.sink else "-nosink"))


def make_scope(c: Decode, s: Scope, g: torch.Generator):
    """One cache and its index lists: ``(cache as passed, dequantised bf16 pool [nb, bs, 1, d], indices
    [b, s_q, topk] int32, topk_length [b] or None)``, unread tokens poisoned."""
    b, bs = c.b, s.block_size
    seqlens = torch.full((b,), s.s_k, dtype=torch.int64)
    if c.varlen:
        seqlens = (torch.randn(b, generator=g) * s.s_k / 2 + s.s_k).long().clamp(min=c.s_q)
    if c.zero_seqlen:
        zero = torch.randn(b, generator=g) > 0
        zero[0] = True
        seqlens[zero] = 0
    pad = max(-(-int(seqlens.max()) // (4 * bs)), 1) * 4 * bs
    table = torch.randperm(b * pad // bs, generator=g).view(b, pad // bs)
    pool = (torch.randn(b * pad // bs, bs, 1, c.d_qk, generator=g) / 10).clamp(-1, 1).to(BF16)
    absolute = random_rows(b * c.s_q, seqlens.repeat_interleave(c.s_q), s.topk, g).view(b, c.s_q, s.topk)
    if c.all_invalid:
        absolute.fill_(-1)
    flat = table.gather(1, absolute.clamp(min=0).view(b, -1) // bs).view_as(absolute) * bs + absolute.clamp(min=0) % bs
    idx = torch.where(absolute >= 0, flat, -1).to(torch.int32)
    length = torch.randint(0, s.topk + 1, (b,), generator=g, dtype=torch.int32) if s.topk_length else None
    if length is not None:
        length[-1] = 0
    read = idx >= 0
    if length is not None:
        read &= torch.arange(s.topk)[None, None] < length[:, None, None]
    unread = torch.ones(pool.size(0) * bs, dtype=torch.bool)
    unread[idx[read].long()] = False
    unread = unread.view(-1, bs)
    if c.fp8:
        cache = F.quantize_cache(pool, F.V32 if c.d_qk == 576 else F.V4)
        pool = F.dequantize_cache(cache)                                        # the values FlashMLA reads
        poison_fp8(cache, unread)
    else:
        pool[unread] = float("nan")
        cache = pool
    return cache, pool, idx, length


def gathered(pool, idx, length):
    """``(keys [b·s_q, W, d] float64 with 0 at invalid slots, valid [b·s_q, W])``."""
    b, s_q, K = idx.shape
    valid = idx >= 0
    if length is not None:
        valid &= torch.arange(K)[None, None] < length[:, None, None]
    bs = pool.size(1)
    safe = torch.where(valid, idx, 0).long()
    keys = pool[safe // bs, safe % bs, 0].double()
    keys = torch.where(valid[..., None], keys, torch.zeros((), dtype=torch.float64))
    return keys.view(b * s_q, K, -1), valid.view(b * s_q, K)


@pytest.mark.parametrize("c", DECODE, ids=decode_id)
def test_sparse_decode(c: Decode, gen):
    g = gen
    q = torch.randn(c.b, c.s_q, c.h_q, c.d_qk, generator=g).clamp(-1, 1).to(BF16)
    sink = draw_sinks(c.h_q, g) if c.sink else None
    cache, pool, idx, length = make_scope(c, c.main, g)
    extra = make_scope(c, c.extra, g) if c.extra is not None else None
    scale = c.d_qk ** -0.55
    meta, _ = flashmla.get_mla_metadata()
    out, lse = flashmla.flash_mla_with_kvcache(
        strided(q), cache, None, None, 512, meta, None, scale, False, c.fp8, strided(idx), sink,
        extra[0] if extra else None, strided(extra[2]) if extra else None, length, extra[3] if extra else None)
    keys, valid = gathered(pool, idx, length)
    if extra is not None:
        ekeys, evalid = gathered(extra[1], extra[2], extra[3])
        keys, valid = torch.cat([keys, ekeys], 1), torch.cat([valid, evalid], 1)
    R = c.b * c.s_q
    want, want_lse, _ = reference(q.view(R, c.h_q, c.d_qk), keys[:, None], valid, scale, 512, sink)
    assert out.shape == (c.b, c.s_q, c.h_q, 512) and lse.shape == (c.b, c.h_q, c.s_q) and out.dtype == BF16
    check("out", out, want.view(c.b, c.s_q, c.h_q, 512).to(BF16), 1e-3, 2.01 / 128, 5e-6)
    check("lse", lse, want_lse.view(c.b, c.s_q, c.h_q).transpose(1, 2), 1e-6, 8.01 / 65536)
    if c.all_invalid or c.zero_seqlen:
        empty = ~valid.any(-1).view(c.b, c.s_q)
        assert bool(empty.any())
        assert torch.equal(out[empty], torch.zeros_like(out[empty])) and bool((lse.transpose(1, 2)[empty] == INF).all())


# ----------------------------------------------------------------------------- dense decode
@dataclasses.dataclass
class Dense:
    b: int
    s_q: int
    s_k: int
    h_q: int
    h_kv: int
    block_size: int = 64
    varlen: bool = False
    causal: bool = False
    zero_seqlen: bool = False
    dtype: torch.dtype = BF16


DENSE = [
    Dense(2, 1, 20, 1, 1),
    Dense(2, 2, 140, 3, 3, causal=True),
    Dense(6, 4, 140, 9, 3, varlen=True, causal=True, block_size=53),
    Dense(2, 2, 140, 64, 2, varlen=True, block_size=2),
    Dense(1, 4, 4096, 8, 8, causal=True, dtype=torch.float16),
    Dense(6, 1, 140, 126, 2, varlen=True, block_size=61, dtype=torch.float16),
    Dense(2, 2, 140, 128, 8, causal=True, block_size=69),
    Dense(3, 4, 20, 63, 3, varlen=True, causal=True, block_size=576),
    Dense(8, 2, 140, 24, 8, varlen=True, causal=True, zero_seqlen=True),
    Dense(8, 2, 20, 128, 1, varlen=True, zero_seqlen=True, dtype=torch.float16),
    Dense(4, 4, 3, 16, 2, causal=True, block_size=2),                        # s_k < s_q: early queries see no key
]


def dense_id(c: Dense) -> str:
    return (f"b{c.b}-sq{c.s_q}-sk{c.s_k}-hq{c.h_q}-hkv{c.h_kv}-bs{c.block_size}" + ("-varlen" if c.varlen else "")
            + ("-causal" if c.causal else "") + ("-zero" if c.zero_seqlen else "")
            + ("-fp16" if c.dtype == torch.float16 else "-bf16"))


@pytest.mark.parametrize("c", DENSE, ids=dense_id)
def test_dense_decode(c: Dense, gen):
    g, d, dv, bs = gen, 576, 512, c.block_size
    seqlens = torch.full((c.b,), c.s_k, dtype=torch.int32)
    if c.varlen:
        seqlens = (torch.randn(c.b, generator=g) * c.s_k / 2 + c.s_k).clamp(min=c.s_q).to(torch.int32)
    if c.zero_seqlen:
        zero = torch.randn(c.b, generator=g) > 0
        zero[0] = True
        seqlens[zero] = 0
    columns = -(-max(-(-int(seqlens.max()) // 256) * 256, 256) // bs)
    table = torch.randperm(c.b * columns, generator=g).view(c.b, columns).to(torch.int32)
    q = (torch.randn(c.b, c.s_q, c.h_q, d, generator=g) / 10).clamp(-1, 1).to(c.dtype)
    cache = (torch.randn(table.numel(), bs, c.h_kv, d, generator=g) / 10).clamp(-1, 1).to(c.dtype)
    for i in range(c.b):                                       # unused blocks and tails NaN, as FlashMLA's test
        n = int(seqlens[i])
        used = -(-n // bs)
        cache[table[i, used:].long()] = float("nan")
        if n % bs:
            cache[int(table[i, used - 1]), n % bs:] = float("nan")
        table[i, used:] = 2147480000                           # FlashMLA's test: never read
    meta, _ = flashmla.get_mla_metadata()
    out, lse = flashmla.flash_mla_with_kvcache(strided(q), cache, table, seqlens, dv, meta, causal=c.causal)
    assert out.shape == (c.b, c.s_q, c.h_q, dv) and lse.shape == (c.b, c.h_q, c.s_q) and out.dtype == c.dtype
    scale = d ** -0.5
    for i in range(c.b):
        n = int(seqlens[i])
        kv = cache[table[i, :-(-n // bs)].long()].reshape(-1, c.h_kv, d)[:n].transpose(0, 1)   # [h_kv, n, d]
        pos = torch.arange(n)[None]
        valid = pos <= torch.arange(c.s_q)[:, None] + n - c.s_q if c.causal else pos.expand(c.s_q, n) >= 0
        want, want_lse, _ = reference(q[i], kv[None], valid, scale, dv, None)
        check(f"out[{i}]", out[i], want.to(c.dtype), 8e-4, 2.01 / 128, 5e-6)
        check(f"lse[{i}]", lse[i], want_lse.transpose(0, 1), 1e-6, 8.01 / 65536)


def test_dense_decode_errors():
    q = torch.randn(1, 1, 6, 576).to(BF16)
    table = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="^k_cache: num_heads_k 4 must divide q's num_heads_q 6"):
        flashmla.flash_mla_with_kvcache(q, torch.randn(1, 4, 4, 576).to(BF16), table, lens, 512,
                                        flashmla.get_mla_metadata()[0])
    fp8 = F.quantize_cache(torch.randn(1, 4, 1, 576).to(BF16), F.V32)
    with pytest.raises(ValueError, match="^k_cache: an FP8 cache holds one KV head"):
        flashmla.flash_mla_with_kvcache(q, fp8.expand(1, 4, 2, 656), table, lens, 512,
                                        flashmla.get_mla_metadata()[0], is_fp8_kvcache=True)
