"""Seeded random configurations for the fuzz suite (``tests/test_fuzz.py``, ``dsattn verify --fuzz N``).

One seed gives one configuration of one operator family, drawn by :class:`random.Random(seed)`
and a seeded torch generator, so ``draw(family, seed)`` rebuilds it exactly anywhere.  Every
configuration is checked against the family's golden by the spec's rules (00 §11) through the
row functions of :mod:`dsattn.verify`.

What is drawn: layouts (BSND, TND, paged), ratios (1..8, 128), mask modes, windows (including
unbounded), sinks (none, normal, large magnitudes, ``±inf``), ragged lengths including 0, rows
with no key, whole calls with no key, -1 index lists of random fill (ends anywhere, all -1 rows,
duplicates, indices past the visible range), ``seqused_q`` padding, residuals.

The poison rule: every KV / cache row that no valid query row may read is NaN (0xFF bytes for
packed rows), computed from the scalar visibility rules of :mod:`dsattn.common.masks`; padding
query rows (and their ``dout``) are NaN too.  A stray read anywhere shows up as a NaN, and NaN
never passes a comparison.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from ..common.masks import cmp_threshold, indexer_num_valid, ori_range, sparse_walk
from ..testing import StatisticsPool
from .attention import NAN, Case, _i32

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class Names:
    """Argument names of one KV source in an operator's signature."""

    kv: str
    table: str
    used: str
    cu: str


ORI = Names("ori_kv", "ori_block_table", "seqused_ori_kv", "cu_seqlens_ori_kv")
CMP = Names("cmp_kv", "cmp_block_table", "seqused_cmp_kv", "cu_seqlens_cmp_kv")
IDX_K = Names("k", "block_table", "seqused_k", "cu_seqlens_k")


def _dname(dtype) -> str:
    return str(dtype).split(".")[-1]


# ----------------------------------------------------------------------------- placement


def _rows(g, lengths, needed, width, dtype, scale=1.0):
    """Per-batch logical rows ``[n_b, 1, width]``: random where ``needed``, NaN elsewhere."""
    out = []
    for n, need in zip(lengths, needed):
        x = torch.full((n, 1, width), NAN)
        for j in need:
            if j < n:
                x[j, 0] = torch.randn(width, generator=g) * scale
        out.append(x.to(dtype))
    return out


def _paged(rnd, per_batch, lengths, needed, block_size):
    """Pool ``[num_blocks, bs, 1, D]`` (spare blocks NaN) and a table whose blocks without a
    needed row are -1 or point at a NaN block; extra columns are -1."""
    D, dtype = per_batch[0].size(-1), per_batch[0].dtype
    nblk = [-(-n // block_size) for n in lengths]
    total = sum(nblk) + rnd.randint(1, 3)
    perm = list(range(total))
    rnd.shuffle(perm)
    pool = torch.full((total, block_size, 1, D), NAN, dtype=dtype)
    table = torch.full((len(per_batch), max(nblk + [0]) + rnd.randint(0, 2)), -1, dtype=torch.int32)
    if table.size(1) == 0:
        table = torch.full((len(per_batch), 1), -1, dtype=torch.int32)
    for b, x in enumerate(per_batch):
        for j in range(nblk[b]):
            blk = perm.pop()
            lo, hi = j * block_size, min((j + 1) * block_size, x.size(0))
            if not any(lo <= v < hi for v in needed[b]) and rnd.random() < 0.6:
                continue                                   # never read: unmapped
            table[b, j] = blk
            pool[blk, : hi - lo] = x[lo:hi]
    return pool, table


def place_kv(kw, names: Names, rnd, per_batch, lengths, needed, layout, *, explicit_lengths: bool):
    """Put one KV source into ``kw`` in ``layout`` (BSND, TND or paged), NaN wherever no valid
    row reads.  ``explicit_lengths``: pass ``lengths`` as ``seqused`` (required when paged);
    otherwise the tensor extent is the length.  Returns the lengths as the operator sees them."""
    B = len(per_batch)
    D, dtype = per_batch[0].size(-1), per_batch[0].dtype
    if layout == "PA_BBND":
        kw[names.kv], kw[names.table] = _paged(rnd, per_batch, lengths, needed, rnd.choice([1, 2, 4, 16]))
        if explicit_lengths:
            kw[names.used] = _i32(*lengths)
        return lengths
    pad = [rnd.randint(0, 2) if explicit_lengths else 0 for _ in range(B)]
    if layout == "BSND":
        cap = max(n + p for n, p in zip(lengths, pad))
        if not explicit_lengths:
            cap = max(lengths)
            lengths = [cap] * B                            # the extent is every batch's length
        t = torch.full((B, cap, 1, D), NAN, dtype=dtype)
        for b, x in enumerate(per_batch):
            n = min(x.size(0), cap)
            t[b, :n] = x[:n]
    else:
        parts, cu = [], [0]
        for x, n, p in zip(per_batch, lengths, pad):
            parts += [x[:n], torch.full((p, 1, D), NAN, dtype=dtype)]
            cu.append(cu[-1] + n + p)
        parts.append(torch.full((rnd.randint(0, 2), 1, D), NAN, dtype=dtype))
        t = torch.cat(parts)
        kw[names.cu] = _i32(*cu)
    kw[names.kv] = t
    if explicit_lengths:
        kw[names.used] = _i32(*lengths)
    return lengths


def place_queries(rnd, g, B, H, D, dtype, layout, *, scale=1.0, padding=True):
    """Query rows in ``layout`` with random extents S1e (0 included) and optional ``seqused_q``.
    Returns ``(q, kwargs, extents, used)``; rows past ``used`` (padding, TND tail) are NaN."""
    kw: dict = {}
    if layout == "BSND":
        S1 = rnd.choice([0, 1, rnd.randint(1, 6), rnd.randint(4, 14)])
        ext = [S1] * B
    else:
        ext = [rnd.choice([0, 1, rnd.randint(1, 6), rnd.randint(3, 14)]) for _ in range(B)]
    used = list(ext)
    if padding and rnd.random() < 0.5:
        used = [rnd.randint(0, e) if rnd.random() < 0.7 else e for e in ext]
        kw["seqused_q"] = _i32(*used)
    rows = []
    for e, u in zip(ext, used):
        x = torch.full((e, H, D), NAN)
        x[:u] = torch.randn(u, H, D, generator=g) * scale
        rows.append(x)
    if layout == "BSND":
        q = torch.stack(rows) if B else torch.zeros(0)
        if q.dim() != 4:
            q = q.reshape(B, ext[0], H, D)
    else:
        tail = torch.full((rnd.randint(0, 2), H, D), NAN)
        q = torch.cat(rows + [tail])
        cu = [0]
        for e in ext:
            cu.append(cu[-1] + e)
        kw["cu_seqlens_q"] = _i32(*cu)
    return q.to(dtype), kw, ext, used


def index_lists(rnd, g, ext, K, hi):
    """Per-batch int32 lists ``[e, K]``: values in [0, hi_b + 3), -1 anywhere (random fill,
    whole -1 rows, a -1 tail), duplicates."""
    out = []
    for e, h in zip(ext, hi):
        x = torch.randint(0, h + 3, (e, K), generator=g, dtype=torch.int32)
        for r in range(e):
            style = rnd.random()
            if style < 0.15:
                x[r] = -1
            elif style < 0.5:
                x[r, rnd.randint(0, K):] = -1
            elif style < 0.75:
                x[r][torch.rand(K, generator=g) < 0.3] = -1
            if K > 1 and rnd.random() < 0.2:
                x[r, 1] = x[r, 0]
        out.append(x[:, None, :])
    return out


def pack_lists(per_batch, layout, q, K):
    """Index lists in the query layout; padding and tail rows random (they must not matter)."""
    if layout == "BSND":
        out = torch.randint(-1, 5, (q.size(0), q.size(1), 1, K), dtype=torch.int32)
        for b, x in enumerate(per_batch):
            out[b, : x.size(0)] = x
        return out
    out = torch.randint(-1, 5, (q.size(0), 1, K), dtype=torch.int32)
    n = 0
    for x in per_batch:
        out[n: n + x.size(0)] = x
        n += x.size(0)
    return out


def _topk_length_tensor(caps, per_row: bool, layout: str, q, K: int) -> torch.Tensor:
    """``cmp_topk_length`` ``[B]`` (every row of a request shares its cap) or one per query row
    (``[B, S1]`` / ``[T]``; padding and tail rows get random legal values)."""
    T = q.size(0) if layout == "TND" else None
    if not per_row and T != len(caps):                      # (T == B reads per row: spell the caps out)
        return _i32(*[c[0] if c else 0 for c in caps])
    flat = torch.randint(0, K + 1, q.shape[:2] if layout == "BSND" else q.shape[:1], dtype=torch.int32)
    n = 0
    for b, c in enumerate(caps):
        if layout == "BSND":
            flat[b, : len(c)] = _i32(*c) if c else flat[b, :0]
        else:
            flat[n: n + len(c)] = _i32(*c) if c else flat[n:n]
            n += len(c)
    return flat


def _sinks(rnd, g, H):
    kind = rnd.choice(["none", "normal", "normal", "large", "inf"])
    if kind == "none":
        return None
    s = torch.randn(H, generator=g) * 1.5
    if kind == "large":
        s = s * rnd.choice([20.0, 200.0, 1e4])
    elif kind == "inf":
        for h in range(H):
            if rnd.random() < 0.5:
                s[h] = rnd.choice([float("inf"), float("-inf")])
    return s


# ----------------------------------------------------------------------------- sparse_flash_mla / sharedkv


def mla_config(seed: int, *, sharedkv: bool = False, packed_dims: bool = False, plannable: bool = False) -> Case:
    """A random ``sparse_flash_mla`` call (``sharedkv``: one that ``sparse_attn_sharedkv`` can
    express: no ``seqused_q``, no residual, ``S2c = floor(S2o / r)``; ``plannable``: one that a
    ``sparse_attn_sharedkv_metadata`` plan describes: the V4 scenarios SWA / CSA with top-k 512 /
    HCA, a causal band, causal compressed masks)."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    dtype = rnd.choice(DTYPES)
    layout = rnd.choice(["BSND", "TND"])
    paged = rnd.random() < 0.4
    layout_kv = "PA_BBND" if paged else layout
    B = rnd.randint(1, 4)
    H = rnd.choice([1, 2, 4])
    D = rnd.choice([24, 32]) if packed_dims else rnd.choice([8, 16, 24])
    r = rnd.choice([1, 1, 4, 4, 128, 2, 3, 8])
    om = rnd.choice([0, 3, 4, 4])
    wl, wr = rnd.choice([-1, 0, 1, 3, 7, 15]), rnd.choice([-1, 0, 0, 0, 2])
    cm = rnd.choice([0, 3, 3]) if r > 1 else 3
    sparse = r > 1 and rnd.random() < (0.3 if r == 128 else 0.7)
    if plannable or (packed_dims and r not in (1, 4, 128)):
        r = rnd.choice([1, 4, 128])
        sparse = r == 4
    if plannable:
        om, wl, wr, cm = 4, rnd.choice([0, 1, 3, 7, 15]), 0, 3
    q, kw, ext, used = place_queries(rnd, g, B, H, D, dtype, layout, padding=not sharedkv)
    max_s2 = 300 if r == 128 else 40
    no_key_call = rnd.random() < 0.05
    S2o = [0 if no_key_call or rnd.random() < 0.12 else rnd.randint(1, max_s2) for _ in range(B)]
    kw.update(softmax_scale=rnd.choice([D ** -0.5, 1.0, 0.3]), ori_mask_mode=om, ori_win_left=wl,
              ori_win_right=wr, layout_q=layout, layout_kv=layout_kv)
    sinks = _sinks(rnd, g, H)
    if sinks is not None:
        kw["sinks"] = sinks
    positional = om in (3, 4) or (r > 1 and cm == 3)
    # How lengths are passed decides the lengths themselves: without seqused a BSND tensor's extent
    # is every batch's length, and a paged compressed source defaults to floor(S2o / r).
    explicit_o = paged or sharedkv or rnd.random() < 0.75
    if layout_kv == "BSND" and not explicit_o:
        S2o = [max(S2o)] * B
    S2c, Lc, lists, K, topk_len, per_row = None, S2o, None, 0, None, False
    if r > 1:
        explicit_c = not sharedkv and rnd.random() < 0.6
        if sharedkv or (paged and not explicit_c):
            S2c = [s // r for s in S2o]
        else:
            S2c = [s // r if rnd.random() < 0.7 else rnd.randint(0, s // r + 2) for s in S2o]
            if layout_kv == "BSND" and not explicit_c:
                S2c = [max(S2c)] * B
        if no_key_call and explicit_c:
            S2c = [0] * B
        if not sharedkv and rnd.random() < 0.5:
            resid = [rnd.randint(0, r - 1) for _ in range(B)]
            kw["cmp_residual_kv"] = _i32(*resid)
            Lc = [c * r + x for c, x in zip(S2c, resid)]
        if sparse:
            K = 512 if plannable else rnd.randint(1, 12)
            lists = index_lists(rnd, g, ext, K, S2c)
            if rnd.random() < 0.3:                         # 20 §2.8: per request or per row, 0..K
                per_row = rnd.random() < 0.5
                caps = [[rnd.randint(0, K)] * e if not per_row else [rnd.randint(0, K) for _ in range(e)]
                        for e in ext]
                topk_len = caps
    # which key rows a valid row may read (the scalar rules of 20 §1.2)
    need_o = [set() for _ in range(B)]
    need_c = [set() for _ in range(B)]
    for b in range(B):
        for i in range(used[b]):
            p = S2o[b] - ext[b] + i
            if positional and p < 0:
                continue
            lo, hi = ori_range(p, S2o[b], om, wl, wr)
            need_o[b].update(range(lo, hi))
            if r > 1:
                thr = cmp_threshold(Lc[b] - ext[b] + i, S2o[b], S2c[b], r, cm)
                if lists is None:
                    need_c[b].update(range(thr))
                else:
                    limit = thr if topk_len is None else min(thr, topk_len[b][i])
                    need_c[b].update(j for _, j in sparse_walk(lists[b][i, 0].tolist(), limit, thr))
    place_kv(kw, ORI, rnd, _rows(g, S2o, need_o, D, dtype), S2o, need_o, layout_kv, explicit_lengths=explicit_o)
    if r > 1:
        kw["cmp_ratio"], kw["cmp_mask_mode"] = r, cm
        place_kv(kw, CMP, rnd, _rows(g, S2c, need_c, D, dtype), S2c, need_c, layout_kv,
                 explicit_lengths=explicit_c or sharedkv)
        if sharedkv:
            kw.pop(CMP.used, None)                         # sharedkv derives S2c = floor(S2o / r)
        if lists is not None:
            kw["cmp_sparse_indices"] = pack_lists(lists, layout, q, K)
        if topk_len is not None:
            kw["cmp_topk_length"] = _topk_length_tensor(topk_len, per_row, layout, q, K)
    if not sharedkv and rnd.random() < 0.3:
        Ko = rnd.randint(1, 6)
        kw["ori_sparse_indices"] = pack_lists(index_lists(rnd, g, ext, Ko, [max(S2o + [0])] * B), layout, q, Ko)
    dout = torch.randn(q.shape, generator=g).to(dtype)
    dout[q.isnan()] = NAN                                     # padding rows' dout must not be read either
    name = (f"mla[{seed}]-{layout}{'+PA' if paged else ''}-r{r}-om{om}-cm{cm}-w{wl},{wr}-{_dname(dtype)}"
            f"{'-sparse' if sparse else ''}{'' if sinks is None else '-sinks'}")
    return Case(name, q, kw, {"dout": dout, "ratio": r, "seed": seed})


def sharedkv_config(seed: int, packed_dims: bool = False) -> Case:
    """A random ``sparse_attn_sharedkv`` call (``kwargs``) with a random plan in ``extra``."""
    from .attention import sharedkv_plan
    rnd = random.Random(seed + 1)
    planned = rnd.random() < 0.7
    c = mla_config(seed, sharedkv=True, packed_dims=packed_dims, plannable=planned)
    mla, r = c.kwargs, c.extra["ratio"]
    kw = {k: v for k, v in mla.items() if k not in ("cmp_residual_kv", "seqused_cmp_kv", "seqused_ori_kv",
                                                   "ori_sparse_indices")}
    if "cmp_kv" not in kw:
        kw.pop("cmp_ratio", None)
    paged = mla["layout_kv"] == "PA_BBND"
    if paged:
        kw["layout_kv"] = "PA_ND"
    if "seqused_ori_kv" in mla:
        kw["seqused_kv"] = mla["seqused_ori_kv"]
    case = Case(c.name.replace("mla", "sharedkv", 1), c.q, kw, {"ratio": r, "seed": seed})
    if planned:
        case.extra["cores"], case.extra["fd"] = rnd.randint(1, 36), rnd.random() < 0.5
        case.extra["plan"] = sharedkv_plan(case, r if "cmp_kv" in kw else 1, case.extra["cores"], case.extra["fd"])
    return case


# ----------------------------------------------------------------------------- lightning_indexer / KL grad


def indexer_config(seed: int) -> Case:
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    dtype = rnd.choice(DTYPES)
    layout = rnd.choice(["BSND", "TND"])
    paged = rnd.random() < 0.35
    B, H, D = rnd.randint(1, 4), rnd.choice([1, 2, 4]), rnd.choice([8, 16])
    r = rnd.choice([1, 4, 4, 128, 2])
    mode = rnd.choice([0, 3, 3])
    q, kw, ext, used = place_queries(rnd, g, B, H, D, dtype, layout)
    w = torch.rand(q.shape[:-1], generator=g) + 0.05
    w[q.isnan().any(-1)] = NAN
    Kc = [0 if rnd.random() < 0.1 else rnd.randint(1, 300 // r if r == 128 else 30) for _ in range(B)]
    resid = [rnd.randint(0, r - 1) for _ in range(B)]
    if rnd.random() < 0.6:
        kw["cmp_residual_k"] = _i32(*resid)
    else:
        resid = [0] * B
    lay_k = "PA_BBND" if paged else layout
    explicit = paged or rnd.random() < 0.7
    if lay_k == "BSND" and not explicit:
        Kc = [max(Kc)] * B                                 # the tensor extent is every batch's length
    need = [set() for _ in range(B)]
    for b in range(B):
        for i in range(used[b]):
            need[b].update(range(indexer_num_valid(Kc[b], r, resid[b], ext[b], i, mode)))
    rows = _rows(g, Kc, need, D, dtype)
    kk: dict = {}
    place_kv(kk, IDX_K, rnd, rows, Kc, need, lay_k, explicit_lengths=explicit)
    k = kk.pop("k")
    kw.update(kk)
    kw.update(mask_mode=mode, cmp_ratio=r, layout_q=layout, layout_k=lay_k, return_value=1)
    topk = rnd.choice([1, 3, 8, 40])
    name = f"indexer[{seed}]-{layout}{'+PA' if paged else ''}-r{r}-mode{mode}-k{topk}-{_dname(dtype)}"
    return Case(name, q, kw, {"k": k, "w": w, "topk": topk, "seed": seed})


def qindexer_config(seed: int) -> Case:
    """An indexer configuration with its keys quantised: int8 or FP8, scales in their own tensor, in each
    row or (paged) in each block of a padded block stride, a float or a quantised query."""
    from .kv_quant import quant_indexer_case
    rnd = random.Random(seed + 11)
    base = indexer_config(seed)
    paged = base.kwargs["layout_k"] == "PA_BBND"
    scale_layout = rnd.choice(("separate", "row", "block") if paged else ("separate", "row"))
    return quant_indexer_case(base, rnd.choice((torch.int8, torch.float8_e4m3fn)), scale_layout,
                              rnd.choice(("float", "quant")), block_pad=4 * rnd.randint(0, 3),
                              scale_dtype=rnd.choice((torch.float32, torch.float32, torch.float16)))


def kl_config(seed: int) -> Case:
    """A KL-loss-gradient call built on a non-paged indexer configuration: the golden indexer's
    lists with -1 ends, duplicates and skipped indices mixed in, a random teacher."""
    from ..reference import lightning_indexer
    rnd = random.Random(seed + 7)
    base = indexer_config(seed)
    while base.kwargs["layout_k"] == "PA_BBND":
        seed += 100_003
        base = indexer_config(seed)
    k, w, topk = base.extra["k"], base.extra["w"], base.extra["topk"]
    kw = {n: v for n, v in base.kwargs.items() if n not in ("return_value", "block_table")}
    idx, _ = lightning_indexer(base.q, k, w, topk, **base.kwargs)
    idx = idx.clone()
    flat = idx.view(-1, topk)
    for row in range(flat.size(0)):
        u = rnd.random()
        if u < 0.15:
            flat[row, rnd.randint(0, topk - 1):] = -1
        elif u < 0.25 and topk > 1:
            flat[row, 1] = flat[row, 0]
        elif u < 0.35:
            flat[row, -1] = 10_000
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(idx.shape, generator=g) * 0.2
    return Case(base.name.replace("indexer", "kl", 1), base.q, kw,
                {"k": k, "w": w, "sparse_indices": idx, "p": p, "seed": seed})


# ----------------------------------------------------------------------------- quantised ops and compressor


def packed_config(seed: int) -> Case:
    """A sharedkv configuration over packed int8 / fp8 rows (unread rows 0xFF bytes)."""
    from .kv_quant import pack_sharedkv_caches
    rnd = random.Random(seed + 11)
    c = sharedkv_config(seed, packed_dims=True)
    D = c.q.size(-1)
    rope = rnd.choice([0, 8])
    tile = rnd.choice([t for t in (8, 16) if (D - rope) % t == 0])
    payload = rnd.choice([torch.int8, torch.float8_e4m3fn])
    args = pack_sharedkv_caches(c.kwargs, rope, payload, tile)
    return Case(c.name.replace("sharedkv", "packed", 1) + f"-{_dname(payload)}-rope{rope}-t{tile}", c.q, args,
                dict(c.extra))


def qsfa_config(seed: int) -> Case:
    from .kv_quant import qsfa_case
    rnd = random.Random(seed)
    lq, lk = rnd.choice([("BSND", "PA_BSND"), ("TND", "PA_BSND"), ("TND", "TND"), ("BSND", "BSND")])
    B = rnd.randint(1, 3)
    sb = rnd.choice([1, 2, 4, 16])
    lengths = [(rnd.randint(1, 4) if lq == "BSND" else rnd.randint(0, 4), rnd.choice([0, 1, rnd.randint(2, 40)]))
               for _ in range(B)]
    if all(s1 == 0 for s1, _ in lengths):
        lengths[0] = (1, lengths[0][1])
    return qsfa_case(lq, lk, rnd.choice([torch.float16, torch.bfloat16]), rope_head_dim=rnd.choice([0, 64]),
                     payload=rnd.choice([torch.int8, torch.float8_e4m3fn]),
                     sparse_block_size=sb, sparse_mode=rnd.choice([0, 3]),
                     sinks=rnd.random() < 0.6, lengths=lengths, H=rnd.choice([1, 2]), K=rnd.randint(2, 10),
                     block_size=max(sb, rnd.choice([4, 16])), seed=seed, lse=rnd.random() < 0.6)


def compressor_config(seed: int):
    from .compressor import compressor_case
    rnd = random.Random(seed)
    D, coff, r = rnd.choice([(16, 2, 4), (8, 2, 4), (16, 1, 8), (8, 1, 16)])
    B = rnd.randint(1, 3)
    lengths = [rnd.choice([0, rnd.randint(1, 3 * r)]) for _ in range(B)]
    starts = [rnd.randint(0, 3 * r) for _ in range(B)]
    c = compressor_case(D=D, coff=coff, r=r, H=rnd.choice([4, 8]), dtype=rnd.choice(DTYPES),
                        packed=rnd.random() < 0.5, starts=starts, lengths=lengths, cache_mode=rnd.choice([1, 2]),
                        block_size=rnd.choice([2, 4, 8]), seed=seed, rope_head_dim=rnd.choice([4, 8]),
                        rotary_mode=rnd.choice([1, 2]), skip_writes=rnd.random() < 0.5)
    c.name = f"compressor[{seed}]-" + c.name
    return c


# ----------------------------------------------------------------------------- checks


def _check_mla(c: Case):
    from ..verify import mla_rows
    # unit-scale data (fp32_math_close); softmax scales up to 1 with one- or two-key rows make some
    # sums cancel beyond fp32's 1e-5: those fall back to the spec's fp32 rule (verify.output_rule)
    rows = mla_rows(c, "ops", grad=True, grad_abs_floor=1e-6, standard_fallback=True)
    if "seqused_q" in c.kwargs and c.kwargs["layout_kv"] != "PA_BBND":   # (pages only padding rows need are unmapped)
        rows.append(_seqused_identity(c))
    return rows


def _seqused_identity(c: Case):
    """00 §11: the valid rows are bit-identical with and without ``seqused_q`` (the padding rows
    then hold real values, and the keys only they see are finite)."""
    from .. import ops
    from ..testing import Comparison
    from ..verify import Row
    kw = dict(c.kwargs)
    used = kw.pop("seqused_q")
    out, lse = ops.sparse_flash_mla(c.q, return_softmax_lse=True, **c.kwargs)
    g = torch.Generator().manual_seed(c.extra["seed"])
    fill = lambda t: torch.where(t.isnan(), torch.randn(t.shape, generator=g).to(t.dtype), t)  # noqa: E731
    for name in ("ori_kv", "cmp_kv"):
        if name in kw:
            kw[name] = fill(kw[name])
    full, full_lse = ops.sparse_flash_mla(fill(c.q), return_softmax_lse=True, **kw)
    if kw["layout_q"] == "BSND":
        valid = torch.arange(c.q.size(1))[None, :] < used[:, None].long()
        same = torch.equal(out[valid], full[valid]) and torch.equal(lse.transpose(1, 2)[valid],
                                                                    full_lse.transpose(1, 2)[valid])
    else:
        rows = torch.cat([torch.arange(int(a), int(a) + int(u)) for a, u in zip(kw["cu_seqlens_q"][:-1], used)])
        same = torch.equal(out[rows], full[rows]) and torch.equal(lse[:, rows], full_lse[:, rows])
    return Row(c.name, "valid rows with / without seqused_q",
               Comparison("bit-identical", same, 0.0, 1.0 if same else 0.0))


def _check_sharedkv(c: Case):
    from .. import ops, reference, testing
    from ..verify import Row, output_rule
    plan = c.extra.get("plan")
    out, _ = ops.sparse_attn_sharedkv(c.q, metadata=plan, **c.kwargs)
    want, _ = reference.sparse_attn_sharedkv(c.q, **c.kwargs)
    if c.q.dtype == torch.float32:
        want64, _ = reference.sparse_attn_sharedkv(c.q, compute_dtype=torch.float64, **c.kwargs)
        res = output_rule(out, want, want64, abs_floor=1e-6, standard_fallback=True)
    else:
        res = testing.split_row_close(out, want) if plan is not None and c.extra["fd"] else testing.compare(out, want)
    what = "no plan" if plan is None else f"plan {c.extra['cores']} cores{' +FD' if c.extra['fd'] else ''}"
    return [Row(c.name, f"attn_out ({what})", res)]


def _check_packed(c: Case):
    from .. import ops, reference, testing
    from ..verify import Row
    plan = c.extra.get("plan")
    got, _ = ops.sparse_attn_sharedkv_packed(c.q, metadata=plan, **c.kwargs)
    want, _ = reference.sparse_attn_sharedkv_packed(c.q, **c.kwargs)
    res = testing.split_row_close(got, want) if plan is not None and c.extra["fd"] else testing.compare(got, want)
    return [Row(c.name, "attn_out", res)]


def _check_indexer(c: Case):
    from ..verify import indexer_rows
    return indexer_rows(c, "ops")


def _check_qindexer(c: Case):
    from ..verify import quant_indexer_rows
    return quant_indexer_rows(c, "ops")


def _check_kl(c: Case):
    from ..verify import kl_rows
    return kl_rows(c, "ops")


def _check_qsfa(c: Case):
    from ..verify import qsfa_rows
    return qsfa_rows(c, "ops")


def _check_compressor(c):
    from ..verify import compressor_rows
    return compressor_rows(c, "ops")


def _quant_linear_config(seed: int):
    from .weights import quant_linear_config
    return quant_linear_config(seed)


def _check_quant_linear(c):
    from .weights import check_rows
    return check_rows(c)


FAMILIES: dict[str, tuple[Callable, Callable]] = {
    "mla": (mla_config, _check_mla),                  # sparse_flash_mla forward and gradient
    "sharedkv": (sharedkv_config, _check_sharedkv),
    "packed": (packed_config, _check_packed),
    "indexer": (indexer_config, _check_indexer),
    "qindexer": (qindexer_config, _check_qindexer),
    "kl": (kl_config, _check_kl),
    "qsfa": (qsfa_config, _check_qsfa),
    "compressor": (compressor_config, _check_compressor),
    "weights": (_quant_linear_config, _check_quant_linear),   # fp8_block_linear, mxfp4_linear
}


def draw(family: str, seed: int):
    return FAMILIES[family][0](seed)


def run(family: str, seed: int):
    """Draw and check one configuration -> ``(case name, failing rows, all rows)``."""
    make, check = FAMILIES[family]
    case = make(seed)
    rows = check(case)
    return case.name, [r for r in rows if not r.result.passed], rows


def repro(family: str, seed: int) -> str:
    """The one-line reproduction of a configuration."""
    return f"dsattn verify --fuzz 1 --family {family} --seed {seed}"


@dataclass
class FuzzReport:
    family: str
    configs: int = 0
    compared: int = 0                                 # output tensors compared
    failures: list = None                             # one line each: reproduction -> what failed
    pool: StatisticsPool = None                       # the small tensors' statistics, judged together

    def __post_init__(self):
        self.failures = [] if self.failures is None else self.failures
        self.pool = StatisticsPool() if self.pool is None else self.pool


def check_seeds(family: str, seeds, into: FuzzReport | None = None, pooled: bool = True) -> FuzzReport:
    """Run ``family`` on every seed.  A configuration fails on an exception, a NaN / inf mismatch,
    a bound every element must meet, or a statistical rule on a tensor of ``POOL_BELOW`` elements
    or more.  The statistical rules of 00 §11 (99.5 % / 99.9 % of elements within a bound, cos_diff
    <= 7e-6) are applied to the pooled elements of all configurations of the run for smaller
    tensors instead: one flipped bf16 ulp in a 16-element row is not a failure of the kernel.

    ``into``: add to that report (a caller running seeds one at a time); ``pooled=False`` leaves the
    pooled rules to a later :func:`check_pooled` over all of them."""
    rep = FuzzReport(family) if into is None else into
    for seed in seeds:
        rep.configs += 1
        try:
            _, _, rows = run(family, seed)
        except Exception as e:                                   # noqa: BLE001 - reported with its seed
            rep.failures.append(f"{repro(family, seed)}  -> {type(e).__name__}: {e}")
            continue
        for r in rows:
            rep.compared += 1
            if not rep.pool.admit(r.result):
                rep.failures.append(f"{repro(family, seed)}  -> {r.case} {r.output}: {r.result}")
    return check_pooled(rep) if pooled else rep


def check_pooled(rep: FuzzReport) -> FuzzReport:
    """The pooled statistical rules of the report's small tensors (``StatisticsPool.failures``); a pool
    smaller than ``POOL_BELOW`` leaves its share to a longer run (``dsattn verify --fuzz N``, ``-m slow``)."""
    rep.failures += rep.pool.failures(f"{rep.family}: ")
    return rep
