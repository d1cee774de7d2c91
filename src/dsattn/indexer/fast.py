"""Vectorised PyTorch kernels of the indexer operators, for any torch device.

``lightning_indexer`` on the CPU takes the compiled kernel where it is built (:func:`native_indexer`:
dsattn/native/indexer.cpp scores every row against its request's keys in place, BSND / TND / paged,
and keeps a running top-k in the golden's order; no host reads).  Without it, the CPU path scores
the rows of one request against their shared keys with
one GEMM per key block and keeps a running top-k (:func:`_shared_key_indexer`: memory bounded
whatever the context); it reads the lengths on the host, so it runs where content checks are on
(host reads allowed).  On other devices, and in steps that forbid host reads, query rows are
processed in blocks; each block gathers
its rows' candidate keys (``[rows, W, D]``, zero where masked) and scores them, with shapes that
depend only on tensor extents, never on tensor values.  Both select in the golden's order
(descending, ties: lower key index first: :func:`topk_positions`), so results match the golden
exactly whenever the scores do.
"""
from __future__ import annotations

import torch

from ..common.memory import empty_output
from ..common.softmax import round_q
from .problem import IndexerProblem, finish_topk, kl_valid_slots, select_topk, topk_positions


def _masked_keys(P: IndexerProblem, t0: int, t1: int, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    b = P.rows.batch[t0:t1, None]
    rows = P.k.gather(*P.k.locate(b, x, mask, check=P.content)).float()
    return torch.where(mask[..., None], rows, torch.zeros((), device=rows.device))


def _zero_rows(x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    return torch.where(ok.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), dtype=x.dtype, device=x.device))


KEY_BLOCK = 4096                 # keys scored per GEMM in the shared-key path (at least)
SCORE_BUDGET = 64 << 20          # bytes of [rows, heads, keys] scores per step


def _cpu_kernels(P):
    """The compiled layer where a call's query suits it: a CPU tensor of a dtype its kernels take (a
    quantised query's codes arrive as bf16), the extension built.  Else None."""
    if P.q.device.type != "cpu" or P.q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    from .. import native
    return native.kernels()


def native_indexer(P: IndexerProblem):
    """The compiled top-k (dsattn/native/indexer.cpp) where it applies: plain keys lying one after
    another (not coded, not strided) and :func:`_cpu_kernels`.  Else None."""
    return _cpu_kernels(P) if P.k.flat_rows() is not None else None


def native_quant_indexer(P):
    """The compiled top-k over a quantised pool where it applies (any pool the op accepts)."""
    return _cpu_kernels(P)


def quant_indexer_native(P, topk: int, offset: torch.Tensor | None):
    """The compiled top-k over a quantised pool read in place (no dequantised copy): every row in one call."""
    module = native_quant_indexer(P)
    n = P.valid_counts().to(torch.int64).contiguous()
    pages, page = P.k.pages()
    pool = P.pool
    scales = pool.scales if pool.scales.dtype == torch.float32 else pool.scales.float()   # (fp16: [blocks, bs])
    vals, idx = module.indexer_topk_quant(P.rows.flat(P.q).contiguous(), pool.values, scales,
                                          pool.dtype == torch.float8_e4m3fn, pages, page,
                                          P.rows.batch.to(torch.int64).contiguous(), n, P.w.contiguous(), topk,
                                          None if offset is None else offset.contiguous(),
                                          None if P.q_scale is None else P.q_scale.contiguous())
    return idx, vals


def _native_topk(P: IndexerProblem, module, topk: int, offset: torch.Tensor | None):
    """Every row in one call: the kernel scores each row against its request's keys in place (no
    gather, no [rows, keys] buffer) and keeps a running top-k; nothing is read on the host here."""
    R = P.rows.R
    n = P.valid_counts().to(torch.int64).contiguous()                   # 0 for padding rows: not read
    pages, page = P.k.pages()
    vals, idx = module.indexer_topk(P.rows.flat(P.q).contiguous(), P.k.flat_rows(), pages, page,
                                    P.rows.batch.to(torch.int64).contiguous(), n, P.w.contiguous(), topk,
                                    None if offset is None else offset.contiguous())
    return idx, vals


def _shared_key_indexer(P: IndexerProblem, topk: int, offset: torch.Tensor | None):
    """CPU path: rows of one request share its key prefix, so a block of them is scored with one
    GEMM per key block (``[rows x heads, D] @ [D, KEY_BLOCK]``) over keys gathered once, and the
    top-k is kept as a running selection merged block by block (:func:`topk_positions` over the
    running k and the block: the running entries precede the block's and hold lower keys, so ties
    still go to the lower key).  Peak memory: O(rows x topk) plus ``SCORE_BUDGET``, whatever the
    context length.  The per-request row ranges and key counts are read on the host (CPU tensors)."""
    dev = P.q.device
    R = P.rows.R
    qf = P.rows.flat(P.q)
    H, D = qf.size(1), qf.size(2)
    idx_out = torch.empty(R, topk, dtype=torch.int32, device=dev)
    val_out = torch.empty(R, topk, dtype=torch.float32, device=dev)
    n_all = P.num_valid(0, R)
    ok = P.rows.used
    batch = P.rows.batch
    counts = torch.bincount(batch, minlength=P.rows.B).tolist()
    rows_per_step = max(1, SCORE_BUDGET // (4 * H * KEY_BLOCK))
    ninf = torch.full((), float("-inf"), device=dev)
    t = 0
    for b, count in enumerate(counts):
        for t0 in range(t, t + count, rows_per_step):
            t1 = min(t + count, t0 + rows_per_step)
            n = n_all[t0:t1]
            q = _zero_rows(qf[t0:t1].float(), ok[t0:t1]).reshape(-1, D)              # [r*H, D]
            w = _zero_rows(P.w[t0:t1], ok[t0:t1])[:, None, :]                       # [r, 1, H]
            run_v = torch.full((t1 - t0, topk), float("-inf"), device=dev)
            run_i = torch.zeros(t1 - t0, topk, dtype=torch.int64, device=dev)
            width = int(n.max()) if t1 > t0 else 0
            # few rows (decode): wider key blocks, one GEMM and one merge over the whole context when it fits
            key_block = max(KEY_BLOCK, SCORE_BUDGET // (4 * H * (t1 - t0)))
            for k0 in range(0, width, key_block):
                k1 = min(width, k0 + key_block)
                x = torch.arange(k0, k1, device=dev)[None, :]
                keys = P.k.span(b, k0, k1, check=P.content).float()                 # [kb, D], once per block
                s = torch.relu_(q @ keys.T).view(t1 - t0, H, k1 - k0)
                score = torch.bmm(w, s)[:, 0]                                         # [r, kb]
                score = torch.where(x < n[:, None], score, ninf)
                cand_v = torch.cat([run_v, score], 1)
                cand_i = torch.cat([run_i, x.expand(t1 - t0, -1)], 1)
                pos = topk_positions(cand_v, topk)
                run_v, run_i = cand_v.gather(1, pos), cand_i.gather(1, pos)
            idx_out[t0:t1], val_out[t0:t1] = finish_topk(run_i, run_v, n, topk,
                                                         None if offset is None else offset[t0:t1])
        t += count
    return idx_out, val_out


def lightning_indexer_native(P: IndexerProblem, topk: int, offset: torch.Tensor | None):
    """The compiled top-k -> ``(indices [R, topk] int32, values [R, topk] float32)`` over flattened rows."""
    return _native_topk(P, native_indexer(P), topk, offset)


def lightning_indexer_torch(P: IndexerProblem, topk: int, offset: torch.Tensor | None):
    """The vectorised PyTorch top-k -> ``(indices [R, topk] int32, values [R, topk] float32)``."""
    dev = P.q.device
    if dev.type == "cpu" and P.content and P.rows.R >= 2 * P.rows.B:
        # (it plans on the host from the lengths: only where host reads are allowed, i.e. with content
        # checks on, as width_bound does; a serving step that turns them off keeps the extent-only path.
        # Rows must share keys: with about one row per request (decode) the batched gather below is one
        # call where the shared path would loop over requests -- 469 vs 851 tokens/s in `dsattn demo`)
        return _shared_key_indexer(P, topk, offset)
    R, W = P.rows.R, P.k.capacity
    qf = P.rows.flat(P.q)
    idx_out = torch.empty(R, topk, dtype=torch.int32, device=dev)
    val_out = torch.empty(R, topk, dtype=torch.float32, device=dev)
    step = P.rows_per_block(W)
    for t0 in range(0, R, step):
        t1 = min(R, t0 + step)
        n = P.num_valid(t0, t1)                                          # [r]
        x = torch.arange(W, device=dev)[None, :].expand(t1 - t0, W)
        mask = x < n[:, None]
        keys = _masked_keys(P, t0, t1, x, mask)
        ok = P.rows.used[t0:t1]
        qb = _zero_rows(qf[t0:t1].float(), ok)
        wb = _zero_rows(P.w[t0:t1], ok)
        s = torch.relu(torch.einsum("rhd,rwd->rhw", qb, keys))
        score = torch.einsum("rh,rhw->rw", wb, s)
        score = torch.where(mask, score, torch.full((), float("-inf"), device=dev))
        idx_out[t0:t1], val_out[t0:t1] = select_topk(score, n, topk, None if offset is None else offset[t0:t1])
    return idx_out, val_out


def kl_loss_grad(P: IndexerProblem, sparse_indices: torch.Tensor, attn_softmax_l1_norm: torch.Tensor):
    """Returns ``(dq [R,H,D], dk like k, dw [R,H], softmax_out [R,K])``."""
    q = P.q
    dev = q.device
    rows = P.rows
    qf = rows.flat(q)
    idx_all, p_all = rows.flat(sparse_indices)[:, 0], rows.flat(attn_softmax_l1_norm)[:, 0]
    R, H, D = qf.shape
    K = idx_all.size(1)
    dq = empty_output(R, H, D, dtype=q.dtype, device=dev)
    dk = torch.zeros(P.k.tensor.shape, dtype=torch.float32, device=dev)
    dw = torch.empty(R, H, dtype=torch.float32, device=dev)
    soft = torch.empty(R, K, dtype=torch.float32, device=dev)
    zero = torch.zeros((), device=dev)
    step = P.rows_per_block(K)
    for t0 in range(0, R, step):
        t1 = min(R, t0 + step)
        idx = idx_all[t0:t1].to(torch.int64)
        valid = kl_valid_slots(P, idx, t0, t1)                            # [r, K]
        keys = _masked_keys(P, t0, t1, idx, valid)
        ok = valid.any(-1)
        qb = _zero_rows(qf[t0:t1].float(), ok)
        wb = _zero_rows(P.w[t0:t1], ok)
        S = torch.einsum("rhd,rkd->rhk", qb, keys)
        relu_s = torch.relu(S)
        I = torch.einsum("rh,rhk->rk", wb, relu_s)
        I = torch.where(valid, I, torch.full((), float("-inf"), device=dev))
        M = I.amax(-1, keepdim=True)
        M = torch.where(torch.isfinite(M), M, zero)
        e = torch.exp(I - M)
        den = e.sum(-1, keepdim=True)
        y = torch.where(valid, e / torch.where(den > 0, den, torch.ones((), device=dev)), zero)
        p = torch.where(valid, p_all[t0:t1], zero)
        dI = torch.where(valid, y * p.sum(-1, keepdim=True) - p, zero)
        dw[t0:t1] = torch.einsum("rhk,rk->rh", relu_s, dI)
        dS = round_q(dI[:, None, :] * wb[:, :, None] * (S > 0), q.dtype)
        dq[t0:t1] = torch.einsum("rhk,rkd->rhd", dS, keys).to(q.dtype)
        dK = torch.einsum("rhk,rhd->rkd", dS, qb) * valid[..., None]
        i0, i1 = P.k.locate(rows.batch[t0:t1, None], idx, valid)
        P.k.scatter_add(dk, i0, i1, dK)
        soft[t0:t1] = y
    return dq, dk.to(P.k.tensor.dtype), dw, soft
