"""Random test cases shared by the test suite, ``dsattn verify`` and ``dsattn demo``.

Inputs are drawn fresh from a seeded generator (never zeros); lengths are ragged (a
length-0 sequence in TND, chunked-prefill and prefill batches, padding query rows); every
tensor row that no length, window or index can reach is filled with NaN, so a stray read
shows up as a NaN in the output.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

NAN = float("nan")
SCENARIOS = {1: "SWA", 4: "CSA", 128: "HCA"}


@dataclass
class Case:
    name: str
    q: torch.Tensor
    kwargs: dict
    extra: dict = field(default_factory=dict)


def _i32(*v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int32)


def _randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _pack_rows(per_batch: list[torch.Tensor], layout: str, pad_to: int | None, tail: int = 0, fill=NAN):
    """Stack per-batch row tensors ``[n_b, ...]`` as BSND ``[B, pad_to, ...]`` or TND
    ``[sum n_b + tail, ...]``; rows beyond each batch's own rows are ``fill`` (NaN)."""
    dtype, rest = per_batch[0].dtype, per_batch[0].shape[1:]
    if layout == "BSND":
        out = torch.full((len(per_batch), pad_to, *rest), fill, dtype=dtype)
        for b, x in enumerate(per_batch):
            out[b, : x.size(0)] = x
        return out, None
    total = sum(x.size(0) for x in per_batch)
    out = torch.full((total + tail, *rest), fill, dtype=dtype)
    cu = [0]
    for x in per_batch:
        out[cu[-1]: cu[-1] + x.size(0)] = x
        cu.append(cu[-1] + x.size(0))
    return out, torch.tensor(cu, dtype=torch.int32)


def _page(per_batch: list[torch.Tensor], block_size: int, g, first_needed: list[int] | None = None, fill=NAN):
    """Paged pool ``[num_blocks, bs, 1, D]`` + int32 block table.  Blocks that hold only rows
    before ``first_needed[b]`` are left unmapped (-1); spare pool blocks are ``fill`` (NaN)."""
    D, dtype = per_batch[0].size(-1), per_batch[0].dtype
    nblk = [max(1, -(-x.size(0) // block_size)) for x in per_batch]
    total = sum(nblk) + 3
    perm = torch.randperm(total, generator=g).tolist()
    pool = torch.full((total, block_size, 1, D), fill, dtype=dtype)
    table = torch.full((len(per_batch), max(nblk) + 1), -1, dtype=torch.int32)
    k = 0
    for b, x in enumerate(per_batch):
        for j in range(nblk[b]):
            blk = perm[k]
            k += 1
            lo, hi = j * block_size, min((j + 1) * block_size, x.size(0))
            if first_needed is not None and hi <= first_needed[b]:
                continue                                       # never read: unmapped
            table[b, j] = blk
            if hi > lo:
                pool[blk, : hi - lo, 0] = x[lo:hi, 0]
    return pool, table


def _kv_branch(kw: dict, branch: str, rows, lengths, layout, paged, g, *, block_size, pad, first_needed=None):
    """Put one KV branch (``ori`` or ``cmp``) into ``kw``: paged pool + table + seqused, or a
    BSND / TND tensor with seqused / cu_seqlens."""
    if paged:
        kw[f"{branch}_kv"], kw[f"{branch}_block_table"] = _page(rows, block_size, g, first_needed)
        kw[f"seqused_{branch}_kv"] = torch.tensor(lengths, dtype=torch.int32)
        return
    kw[f"{branch}_kv"], cu = _pack_rows(rows, layout, max(lengths) + pad, tail=pad)
    if layout == "TND":
        kw[f"cu_seqlens_{branch}_kv"] = cu
    else:
        kw[f"seqused_{branch}_kv"] = torch.tensor(lengths, dtype=torch.int32)


def mla_case(layout: str = "BSND", ratio: int = 4, dtype=torch.float16, *, paged: bool = False, seed: int = 0,
             H: int = 4, D: int = 32, window: int = 16, topk: int = 8, sinks: bool = True,
             lengths: list[tuple[int, int]] | None = None) -> Case:
    """A sparse_flash_mla case.  ``ratio`` 1 = SWA (ori only), 4 = CSA (sparse cmp), 128 = HCA
    (dense cmp).  ``lengths`` = per batch (S1e, S2o); default: ragged chunked/prefill mixes."""
    g = torch.Generator().manual_seed(seed)
    r = ratio
    if lengths is None:
        if r == 128:
            lengths = [(12, 300), (0, 140), (20, 20 + 128 * 2 + 5)] if layout == "TND" else [(12, 300), (12, 140), (12, 389)]
        else:
            lengths = [(13, 37), (0, 9), (29, 29), (6, 5)] if layout == "TND" else [(14, 37), (14, 14), (14, 26)]
    B = len(lengths)
    S1e = [a for a, _ in lengths]
    S2o = [b for _, b in lengths]
    wl = window - 1
    q_rows = [_randn(g, s, H, D, dtype=dtype) for s in S1e]
    seqused_q = None
    if layout == "BSND":
        S1 = S1e[0]
        assert all(s == S1 for s in S1e), "BSND cases need one query extent"
        used = [S1, max(S1 - 3, 0)] + [S1] * (B - 2)
        seqused_q = torch.tensor(used[:B], dtype=torch.int32)
        for b in range(B):
            q_rows[b][used[b]:] = NAN                          # padding rows: never read
    q, cu_q = _pack_rows(q_rows, layout, max(S1e), tail=2)
    ori_rows = [_randn(g, s, 1, D, dtype=dtype) for s in S2o]
    first_needed = [max(0, s2 - s1 - wl) for s1, s2 in zip(S1e, S2o)]
    for b in range(B):
        ori_rows[b][: first_needed[b]] = NAN                   # older than every window
    kw: dict = dict(softmax_scale=D ** -0.5, ori_mask_mode=4, ori_win_left=wl, ori_win_right=0,
                    layout_q=layout, layout_kv="PA_BBND" if paged else layout)
    if layout == "TND":
        kw["cu_seqlens_q"] = cu_q
    else:
        kw["seqused_q"] = seqused_q
    _kv_branch(kw, "ori", ori_rows, S2o, layout, paged, g, block_size=16, pad=3, first_needed=first_needed)
    if sinks:
        kw["sinks"] = _randn(g, H, scale=1.5)
    if r > 1:
        S2c = [s // r for s in S2o]
        kw["cmp_ratio"] = r
        kw["cmp_mask_mode"] = 3
        kw["cmp_residual_kv"] = torch.tensor([s % r for s in S2o], dtype=torch.int32)
        cmp_rows = [_randn(g, c, 1, D, dtype=dtype) for c in S2c]
        if r == 4:                                             # CSA: -1 padded top-k lists
            idx_rows = []
            for b in range(B):
                x = torch.randint(0, S2c[b] + 3, (S1e[b], topk), generator=g, dtype=torch.int32)
                cut = torch.randint(0, topk + 1, (S1e[b],), generator=g)
                x[torch.arange(topk)[None, :] >= cut[:, None]] = -1
                if S1e[b] > 2:
                    x[1] = -1                                  # an all -1 row
                    x[2, 0] = x[2, 1]                          # a duplicate
                idx_rows.append(x[:, None, :])
                seen = set(x[x >= 0].tolist())
                for j in range(S2c[b]):
                    if j not in seen:
                        cmp_rows[b][j] = NAN                   # no list references it
            kw["cmp_sparse_indices"] = _pack_int_rows(idx_rows, layout, max(S1e), tail=2)
        _kv_branch(kw, "cmp", cmp_rows, S2c, layout, paged, g, block_size=4, pad=2)
    name = f"{SCENARIOS.get(r, f'r{r}')}-r{r}-{layout}{'+PA' if paged else ''}-{str(dtype).split('.')[-1]}"
    return Case(name, q, kw, {"dout": _randn(g, *q.shape, dtype=dtype)})


def _pack_int_rows(per_batch, layout, pad_to, tail=0):
    """Like :func:`_pack_rows` for int32 index lists; padding rows are -1."""
    K = per_batch[0].size(-1)
    if layout == "BSND":
        out = torch.full((len(per_batch), pad_to, 1, K), -1, dtype=torch.int32)
        for b, x in enumerate(per_batch):
            out[b, : x.size(0)] = x
        return out
    total = sum(x.size(0) for x in per_batch)
    return torch.cat(per_batch + [torch.full((tail, 1, K), -1, dtype=torch.int32)]) if total + tail else \
        torch.full((0, 1, K), -1, dtype=torch.int32)


def indexer_case(layout: str = "BSND", ratio: int = 4, dtype=torch.float16, *, paged: bool = False, seed: int = 0,
                 H: int = 4, D: int = 32, topk: int = 8, integer: bool = False, lengths: list[int] | None = None,
                 query_rows: list[int] | None = None, page: int = 4) -> Case:
    """A lightning_indexer case (mask_mode 3).  ``integer=True`` draws small integers so every
    score is exact and ties are real: fast and golden must then agree exactly.  ``lengths`` (the
    sequence lengths before compression) and ``query_rows`` (rows per batch) replace the defaults
    together; ``page`` is the block size of a paged cache."""
    g = torch.Generator().manual_seed(seed)
    r = ratio
    if (lengths is None) != (query_rows is None) or (lengths is not None and len(lengths) != len(query_rows)):
        raise ValueError(f"lengths, query_rows: give both, one entry per batch, or neither; got {lengths} and "
                         f"{query_rows}")
    if lengths is not None:
        Ls, S1s = list(lengths), list(query_rows)
    elif r == 128:
        Ls, S1s = ([300, 130, 389], [12, 0, 3]) if layout == "TND" else ([300, 130, 389], [5, 5, 5])
    else:
        Ls, S1s = ([42, 9, 30, 7], [42, 0, 5, 9]) if layout == "TND" else ([42, 19, 30], [12, 12, 12])
    Kc = [L // r for L in Ls]

    def draw(*shape, dt=dtype):
        if integer:
            return torch.randint(-3, 4, shape, generator=g).to(dt)
        return _randn(g, *shape, dtype=dt)

    q_rows = [draw(s, H, D) for s in S1s]
    w_rows = [draw(s, H, dt=torch.float32).abs() + (0 if integer else 0.1) for s in S1s]
    k_rows = [draw(c, 1, D) for c in Kc]
    q, cu_q = _pack_rows(q_rows, layout, max(S1s), tail=2)
    w, _ = _pack_rows(w_rows, layout, max(S1s), tail=2)
    kw: dict = dict(mask_mode=3, cmp_ratio=r, layout_q=layout, layout_k="PA_BBND" if paged else layout,
                    cmp_residual_k=torch.tensor([L % r for L in Ls], dtype=torch.int32), return_value=1)
    if layout == "TND":
        kw["cu_seqlens_q"] = cu_q
    if paged:
        k, kw["block_table"] = _page(k_rows, page, g)
        kw["seqused_k"] = torch.tensor(Kc, dtype=torch.int32)
    else:
        k, cu_k = _pack_rows(k_rows, layout, max(Kc) + 2, tail=2)
        if layout == "TND":
            kw["cu_seqlens_k"] = cu_k
        else:
            kw["seqused_k"] = torch.tensor(Kc, dtype=torch.int32)
    name = f"indexer-r{r}-{layout}{'+PA' if paged else ''}-{str(dtype).split('.')[-1]}"
    return Case(name, q, kw, {"k": k, "w": w, "topk": topk})


def kl_case(layout: str = "BSND", ratio: int = 4, dtype=torch.float16, *, seed: int = 0, H: int = 4, D: int = 32,
            topk: int = 8) -> Case:
    """A sparse_lightning_indexer_kl_loss_grad case: index lists from the golden indexer, with
    some -1 ends, skipped (future) indices and duplicates mixed in; a random teacher p."""
    from ..reference import lightning_indexer
    base = indexer_case(layout, ratio, dtype, seed=seed, H=H, D=D, topk=topk)
    kw = {k: v for k, v in base.kwargs.items() if k not in ("return_value", "block_table")}
    g = torch.Generator().manual_seed(seed + 1000)
    k, w = base.extra["k"], base.extra["w"]
    idx, _ = lightning_indexer(base.q, k, w, topk, **base.kwargs)
    idx = idx.clone()
    flat = idx.view(-1, topk)
    n = flat.size(0)
    if n > 3:
        flat[0, topk // 2:] = -1
        flat[1, 1] = flat[1, 0]                               # duplicate
        flat[2, -1] = 10_000                                  # beyond realK: skipped
    p = torch.rand(idx.shape, generator=g) * 0.2
    return Case(f"kl-r{ratio}-{layout}-{str(dtype).split('.')[-1]}", base.q, kw,
                {"k": k, "w": w, "sparse_indices": idx, "p": p})


def sharedkv_case(layout: str = "TND", ratio: int = 4, dtype=torch.float32, *, paged: bool = True, seed: int = 0,
                  topk: int = 512, lengths=None, H: int = 4, D: int = 32, window: int = 16) -> Case:
    """A sparse_attn_sharedkv case built from :func:`mla_case`.  ``kwargs`` are the sharedkv
    arguments; ``extra["mla_kwargs"]`` the equivalent sparse_flash_mla arguments for the golden
    (every row of the extent is computed: sharedkv has no seqused_q)."""
    c = mla_case(layout, ratio, dtype, paged=paged, seed=seed, topk=topk, lengths=lengths, H=H, D=D, window=window)
    q = torch.nan_to_num(c.q, nan=0.0)
    mla = {k: v for k, v in c.kwargs.items() if k != "seqused_q"}
    kw = {k: v for k, v in mla.items() if k not in ("cmp_residual_kv", "seqused_cmp_kv", "seqused_ori_kv")}
    s2o = None
    if paged:
        s2o = mla["seqused_ori_kv"]
        kw["layout_kv"] = "PA_ND"
    elif layout == "BSND":
        s2o = mla.get("seqused_ori_kv")
    if s2o is not None:
        kw["seqused_kv"] = s2o
    if ratio == 1:
        kw.pop("cmp_ratio", None)
    return Case(c.name.replace("+PA", "+PA_ND"), q, kw, {"mla_kwargs": mla})


def sharedkv_plan(case: Case, ratio: int, cores: int, split_kv: bool) -> torch.Tensor:
    """A ``sparse_attn_sharedkv_metadata`` plan of ``cores`` cube cores for a sharedkv case (also a
    packed one), built from the case's own lengths."""
    from .. import ops
    q, kw = case.q, case.kwargs
    s2o = kw.get("seqused_kv")
    if s2o is None:
        s2o = (kw["cu_seqlens_ori_kv"][1:] - kw["cu_seqlens_ori_kv"][:-1]).to(torch.int32) \
            if kw["layout_kv"] == "TND" else torch.full((q.size(0),), kw["ori_kv"].size(1), dtype=torch.int32)
    bsnd = kw["layout_q"] == "BSND"
    return ops.sparse_attn_sharedkv_metadata(
        q.size(-2), 1, q.size(-1), cu_seqlens_q=kw.get("cu_seqlens_q"), seqused_kv=s2o,
        batch_size=q.size(0) if bsnd else 0, max_seqlen_q=q.size(1) if bsnd else 0, layout_q=kw["layout_q"],
        has_cmp_kv=ratio > 1, cmp_ratio=ratio if ratio > 1 else -1, cmp_topk=512 if ratio == 4 else 0,
        ori_win_left=kw["ori_win_left"], aic_core_num=cores, aiv_core_num=max(cores, 8), support_fd=split_kv)


def no_key_case(layout: str, paged: bool, ratio: int, om: int, dtype, S1: int = 5) -> Case:
    """A sparse_flash_mla call in which no row has a key: three batches, every key length 0, ragged
    queries, NaN caches (00 §9 / §12: out 0, LSE 0, gradients 0, never an exception)."""
    H, D, B = 2, 16, 3
    kw = dict(ori_mask_mode=om, ori_win_left=3, ori_win_right=0, sinks=torch.randn(H), softmax_scale=0.25,
              layout_q=layout)
    if layout == "BSND":
        q = torch.randn(B, S1, H, D).to(dtype)
    else:
        q = torch.randn(2 + S1 + 1, H, D).to(dtype)
        kw["cu_seqlens_q"] = _i32(0, 2, 2 + S1, 2 + S1 + 1)
    if paged:
        kw.update(layout_kv="PA_BBND", ori_kv=torch.full((2, 4, 1, D), NAN, dtype=dtype),
                  ori_block_table=torch.full((B, 2), -1, dtype=torch.int32), seqused_ori_kv=_i32(0, 0, 0))
    elif layout == "BSND":
        kw.update(layout_kv="BSND", ori_kv=torch.full((B, 0, 1, D), NAN, dtype=dtype))
    else:
        kw.update(layout_kv="TND", ori_kv=torch.full((3, 1, D), NAN, dtype=dtype),
                  cu_seqlens_ori_kv=_i32(0, 0, 0, 0))
    if ratio > 1:
        kw.update(cmp_ratio=ratio, cmp_mask_mode=3)
        if paged:
            kw.update(cmp_kv=torch.full((2, 4, 1, D), NAN, dtype=dtype),
                      cmp_block_table=torch.full((B, 2), -1, dtype=torch.int32))
        elif layout == "BSND":
            kw["cmp_kv"] = torch.full((B, 0, 1, D), NAN, dtype=dtype)
        else:
            kw.update(cmp_kv=torch.full((2, 1, D), NAN, dtype=dtype), cu_seqlens_cmp_kv=_i32(0, 0, 0, 0))
        if ratio == 4:
            shape = (*q.shape[:-2], 1, 6)
            kw["cmp_sparse_indices"] = torch.randint(-1, 3, shape, dtype=torch.int32)
    name = f"no-key-{layout}{'+PA' if paged else ''}-r{ratio}-om{om}-{str(dtype).split('.')[-1]}"
    return Case(name, q, kw, {"dout": torch.randn(q.shape).to(dtype)})
