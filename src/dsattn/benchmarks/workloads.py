"""Input builders for the benchmark workloads (V4-Flash: N1 64, D 512, window 128, CSA ratio 4
top-512, HCA ratio 128; V4-Pro: N1 128, top-1024).  Paged caches map only what a step reads
to distinct blocks (the window's blocks); compressed caches alias a fixed pool of physical
blocks, which keeps memory small while the gather pattern stays random."""
from __future__ import annotations

import torch

WINDOW = 128
D = 512


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, dtype=torch.bfloat16, scale=1.0):
    """Drawn directly in ``dtype`` (no fp32 temporary: the fresh-process memory figures would
    otherwise include it)."""
    x = torch.randn(*shape, generator=g, dtype=dtype)
    return x.mul_(scale) if scale != 1.0 else x


def _paged_pool(g, lengths, block, pool_blocks, dtype, read_from=None):
    """A pool ``[pool_blocks, block, 1, D]`` and a table mapping every logical block to a random
    physical block (aliasing); blocks at or past ``read_from[b] // block`` get distinct blocks."""
    nbt = max(1, max(-(-L // block) for L in lengths))
    table = torch.randint(0, pool_blocks, (len(lengths), nbt), generator=g, dtype=torch.int32)
    pool = _randn(g, pool_blocks, block, 1, D, dtype=dtype)
    return pool, table


def topk_indices(g, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """Per query row ``topk`` compressed indices among its ``visible`` entries (all of them, then
    -1, when fewer are visible)."""
    R = visible.numel()
    v = visible.reshape(R, 1).to(torch.int64)
    slot = torch.arange(topk)[None]
    rand = torch.rand(R, topk, generator=g).mul_(v).to(torch.int64)
    idx = torch.where(v > topk, rand, torch.where(slot < v, slot, torch.full_like(slot, -1)))
    return idx.to(torch.int32)


def decode(B=32, heads=64, ratio=4, topk=512, lo=8192, hi=131072, seed=0, dtype=torch.bfloat16, fixed=None):
    """One decode step: B requests, one query each, ragged contexts in [lo, hi] (or all ``fixed``)."""
    g = _g(seed)
    S2o = torch.full((B,), fixed) if fixed else torch.randint(lo, hi + 1, (B,), generator=g)
    q = _randn(g, B, 1, heads, D, dtype=dtype, scale=0.5)
    block = 64
    ori, ori_table = _paged_pool(g, S2o.tolist(), block, 4 * B, dtype)
    # the window's blocks are distinct physical blocks (the rest is never read)
    for b in range(B):
        last = int(S2o[b]) - 1
        for j, col in enumerate(range(max(0, last - WINDOW + 1) // block, last // block + 1)):
            ori_table[b, col] = 4 * b + j
    kw = dict(ori_kv=ori, ori_block_table=ori_table, seqused_ori_kv=S2o.to(torch.int32),
              sinks=_randn(g, heads, dtype=torch.float32), softmax_scale=D ** -0.5, ori_mask_mode=4,
              ori_win_left=WINDOW - 1, ori_win_right=0, layout_q="BSND", layout_kv="PA_BBND")
    keys = torch.clamp(S2o, max=WINDOW)
    if ratio > 1:
        S2c = S2o // ratio
        cmp, cmp_table = _paged_pool(g, S2c.tolist(), 64, 2048, dtype)
        kw.update(cmp_kv=cmp, cmp_block_table=cmp_table, seqused_cmp_kv=S2c.to(torch.int32),
                  cmp_residual_kv=(S2o % ratio).to(torch.int32), cmp_ratio=ratio, cmp_mask_mode=3)
        if ratio == 4:
            kw["cmp_sparse_indices"] = topk_indices(g, S2c, topk).reshape(B, 1, 1, topk)
            keys = keys + torch.clamp(S2c, max=topk)
        else:
            keys = keys + S2c
    flops = 2 * heads * keys.sum().item() * 2 * D
    return q, kw, flops, S2o


def prefill(L=8192, heads=64, ratio=4, topk=512, seed=0, dtype=torch.bfloat16):
    """One prefill request of L tokens (BSND), window 128, compressed branch of ``ratio``."""
    g = _g(seed)
    q = _randn(g, 1, L, heads, D, dtype=dtype, scale=0.5)
    kw = dict(ori_kv=_randn(g, 1, L, 1, D, dtype=dtype), sinks=_randn(g, heads, dtype=torch.float32),
              softmax_scale=D ** -0.5, ori_mask_mode=4, ori_win_left=WINDOW - 1, ori_win_right=0,
              layout_q="BSND", layout_kv="BSND")
    pos = torch.arange(L)
    keys = torch.clamp(pos + 1, max=WINDOW)
    if ratio > 1:
        S2c = L // ratio
        kw.update(cmp_kv=_randn(g, 1, S2c, 1, D, dtype=dtype), cmp_ratio=ratio, cmp_mask_mode=3,
                  cmp_residual_kv=torch.tensor([L % ratio], dtype=torch.int32))
        visible = (pos + 1) // ratio
        if ratio == 4:
            kw["cmp_sparse_indices"] = topk_indices(g, visible, topk).reshape(1, L, 1, topk)
            keys = keys + torch.clamp(visible, max=topk)
        else:
            keys = keys + visible
    flops = 2 * heads * keys.sum().item() * 2 * D
    return q, kw, flops


def row_bytes(kv: torch.Tensor) -> int:
    """Bytes of one stored key row: its last dim (packed rows: bytes already)."""
    return kv.size(-1) * kv.element_size()


def decode_bytes(q: torch.Tensor, kw: dict) -> float:
    """The bytes one decode step must move at least, for the roofline: every key row it reads (the
    window's raw rows, up to 128 per request, and its compressed rows: the listed top-k for CSA,
    every one for HCA) at its storage width, the queries read and the outputs written (as wide as
    the queries).  Rows two requests share are counted per request (each reads them)."""
    S2o = kw["seqused_ori_kv"].to(torch.int64)
    rows = torch.clamp(S2o, max=WINDOW).sum().item() * row_bytes(kw["ori_kv"])
    if "cmp_kv" in kw:
        if "cmp_sparse_indices" in kw:
            n = (kw["cmp_sparse_indices"] >= 0).sum().item()
        else:
            n = kw["seqused_cmp_kv"].to(torch.int64).sum().item()
        rows += n * row_bytes(kw["cmp_kv"])
    return float(rows + 2 * q.numel() * q.element_size())


def sharedkv_args(q: torch.Tensor, kw: dict, ori_kv=None, cmp_kv=None) -> tuple[torch.Tensor, dict]:
    """A :func:`decode` step as ``sparse_attn_sharedkv`` arguments (TND queries, PA_ND caches):
    ``(q [B, H, D], kwargs)``; ``ori_kv`` / ``cmp_kv`` replace the caches (e.g. packed rows)."""
    B = q.size(0)
    args = dict(ori_kv=kw["ori_kv"] if ori_kv is None else ori_kv, ori_block_table=kw["ori_block_table"],
                seqused_kv=kw["seqused_ori_kv"], cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32),
                sinks=kw["sinks"], softmax_scale=kw["softmax_scale"], ori_win_left=kw["ori_win_left"],
                layout_q="TND", layout_kv="PA_ND")
    if "cmp_kv" in kw:
        args.update(cmp_kv=kw["cmp_kv"] if cmp_kv is None else cmp_kv, cmp_block_table=kw["cmp_block_table"],
                    cmp_ratio=kw["cmp_ratio"])
        if "cmp_sparse_indices" in kw:
            args["cmp_sparse_indices"] = kw["cmp_sparse_indices"].reshape(B, 1, -1)
    return q.reshape(B, *q.shape[2:]), args


def step_positions(kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The logical key positions a :func:`decode` step reads, -1 padded: ``(window [B, 128] raw
    positions, compressed [B, K]: the listed top-k for CSA, every entry for HCA)``."""
    S2o = kw["seqused_ori_kv"].to(torch.int64)
    win = S2o[:, None] - WINDOW + torch.arange(WINDOW)[None]
    win = torch.where(win >= 0, win, torch.full_like(win, -1))
    if "cmp_sparse_indices" in kw:
        cmp = kw["cmp_sparse_indices"].reshape(S2o.numel(), -1).to(torch.int64)
    else:
        n = kw["seqused_cmp_kv"].to(torch.int64)
        slot = torch.arange(max(1, int(n.max())))[None]
        cmp = torch.where(slot < n[:, None], slot, torch.full_like(slot, -1))
    return win, cmp
