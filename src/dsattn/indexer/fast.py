"""Vectorised PyTorch kernels of the indexer operators, for any torch device.

Query rows are processed in blocks; each block gathers its rows' candidate keys
(``[rows, W, D]``, zero where masked), scores them, and selects with a stable descending
sort (ties: lower key index first), so results match the golden bit for bit whenever the
scores do.  Shapes depend only on tensor extents, never on tensor values.
"""
from __future__ import annotations

import torch

from ..backend import use_triton
from ..common.softmax import round_q
from .problem import IndexerProblem, kl_valid_slots


def _masked_keys(P: IndexerProblem, t0: int, t1: int, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    b = P.rows.batch[t0:t1, None]
    rows = P.k.gather(*P.k.locate(b, x, mask, check=P.content)).float()
    return torch.where(mask[..., None], rows, torch.zeros((), device=rows.device))


def _zero_rows(x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    return torch.where(ok.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), dtype=x.dtype, device=x.device))


def select_topk(score: torch.Tensor, n: torch.Tensor, topk: int, offset: torch.Tensor | None):
    """The ``topk`` best of each row's scores ``[r, W]`` (-inf past its ``n`` selectable keys) by a
    stable descending sort (ties: lower key index first) -> ``(indices int32, values float32)``,
    -1 / -inf past ``min(n, topk)``; ``offset`` ``[r]`` is added to the kept indices."""
    dev = score.device
    if score.size(1) < topk:
        score = torch.nn.functional.pad(score, (0, topk - score.size(1)), value=float("-inf"))
    sv, si = torch.sort(score, dim=-1, descending=True, stable=True)
    keep = torch.arange(topk, device=dev)[None, :] < torch.clamp(n, max=topk)[:, None]
    si = si[:, :topk]
    if offset is not None:
        si = si + offset[:, None]
    return (torch.where(keep, si, torch.full((), -1, device=dev)).to(torch.int32),
            torch.where(keep, sv[:, :topk], torch.full((), float("-inf"), device=dev)))


def lightning_indexer(P: IndexerProblem, topk: int, offset: torch.Tensor | None):
    """Returns ``(indices [R, topk] int32, values [R, topk] float32)`` over flattened rows."""
    if use_triton(P.q.device):
        from . import triton as triton_kernels                # imported only when Triton runs
        if triton_kernels.supports(P):
            return triton_kernels.lightning_indexer(P, topk, offset)
    dev = P.q.device
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
    dq = torch.empty(R, H, D, dtype=q.dtype, device=dev)
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
