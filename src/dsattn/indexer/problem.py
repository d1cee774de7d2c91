"""Validation and length resolution of the indexer operators (10-indexer §1.2, §1.6, §2.2, §2.7)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..common.checks import (check_batch_vector, check_choice, check_dtype, check_float, check_int32,
                             check_int_range, check_same_device, check_tensor, content_checks_enabled, fail,
                             host_ints)
from ..common.layout import PAGED, KVSource, QueryRows, check_batch_agreement, kv_source, query_rows
from ..common.masks import indexer_num_valid_t, sparse_walk_t


@dataclass
class IndexerProblem:
    q: torch.Tensor
    w: torch.Tensor             # [R, N1] float32
    rows: QueryRows
    k: KVSource
    resid: torch.Tensor         # [B] int64 (0 where absent or unused)
    r: int
    mask_mode: int
    content: bool
    _valid: torch.Tensor | None = field(default=None, repr=False)

    def valid_counts(self) -> torch.Tensor:
        """:meth:`num_valid` of every row, computed once per call (the coverage check and the kernels read it)."""
        if self._valid is None:
            self._valid = self.num_valid(0, self.rows.R)
        return self._valid

    def num_valid(self, t0: int, t1: int) -> torch.Tensor:
        """Selectable keys (realK) of rows ``[t0, t1)``, 0 for padding rows."""
        rows = self.rows
        b = rows.batch[t0:t1]
        n = indexer_num_valid_t(self.k.lengths[b], self.r, self.resid[b], rows.extent[b],
                                rows.local[t0:t1], self.mask_mode)
        return torch.where(rows.used[t0:t1], n, torch.zeros_like(n))

    def rows_per_block(self, width: int, budget_bytes: int = 32 << 20) -> int:
        H, D = self.q.size(-2), self.q.size(-1)
        per_row = max(1, width) * (D + 3 * H) * 4
        return max(1, min(self.rows.R, budget_bytes // per_row))


# lightning_indexer's key layouts, and the defaults of its keyword arguments that parse_indexer takes (the
# schema's; quant_lightning_indexer shares both)
K_LAYOUTS = ("BSND", "TND", "PA_BBND")
LIGHTNING_DEFAULTS = dict(cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, cmp_residual_k=None,
                          block_table=None, metadata=None, layout_q="BSND", layout_k="BSND", mask_mode=0, cmp_ratio=1)


def _leading(q, layout_q):
    return tuple(q.shape[:2] if layout_q == "BSND" else q.shape[:1])


def parse_indexer(q, k, w, *, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, cmp_residual_k,
                  block_table, metadata, layout_q, layout_k, mask_mode, cmp_ratio, k_layouts,
                  content=None, problem_cls: type = IndexerProblem, source_cls: type = KVSource,
                  names: tuple[str, str] = ("q", "w")) -> IndexerProblem:
    """Checks shared by lightning_indexer, its KL-loss gradient and quant_lightning_indexer (which
    describes its keys and its problem with subclasses of its own: ``source_cls``, ``problem_cls``, and
    names its query and weights ``names``)."""
    q_name, w_name = names
    check_choice("layout_q", layout_q, ("BSND", "TND"))
    check_choice("layout_k", layout_k, k_layouts)
    if layout_k in ("BSND", "TND") and layout_k != layout_q:
        pairs = "(BSND, BSND), (TND, TND)" + (", (BSND, PA_BBND), (TND, PA_BBND)" if PAGED in k_layouts else "")
        fail("layout_k", f"{layout_k!r} cannot be combined with layout_q={layout_q!r}; allowed pairs: {pairs}")
    check_choice("mask_mode", mask_mode, (0, 3))
    check_int_range("cmp_ratio", cmp_ratio, 1, 128)
    check_float(q_name, q)
    check_dtype("k", k, q.dtype, "must match q")
    check_dtype(w_name, w, torch.float32)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("seqused_q", seqused_q),
                    ("seqused_k", seqused_k), ("cmp_residual_k", cmp_residual_k), ("block_table", block_table),
                    ("metadata", metadata)):
        check_int32(name, t)
    check_same_device(**{q_name: q, "k": k, w_name: w}, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      seqused_q=seqused_q, seqused_k=seqused_k, cmp_residual_k=cmp_residual_k, block_table=block_table)
    rank = 4 if layout_q == "BSND" else 3
    if q.dim() != rank:
        fail(q_name, f"expected a {rank}-D tensor for layout {layout_q}, got shape {tuple(q.shape)}")
    if k.size(-1) != q.size(-1):
        fail("k", f"head dim {k.size(-1)} does not match q's head dim {q.size(-1)}")
    if tuple(w.shape) != tuple(q.shape[:-1]):
        fail(w_name, f"expected the shape of {q_name} without its head dim {tuple(q.shape[:-1])}, got "
             f"{tuple(w.shape)}")
    if content is None:
        content = content_checks_enabled(q, cu_seqlens_q)
    if layout_q == "TND":
        check_batch_agreement("cu_seqlens_q", cu_seqlens_q, cu_seqlens_k=(cu_seqlens_k, 1), seqused_q=(seqused_q, 0),
                              seqused_k=(seqused_k, 0), block_table=(block_table, 0),
                              cmp_residual_k=(cmp_residual_k, 0))
    rows = query_rows(q, layout_q, cu_seqlens_q, seqused_q, content=content)
    B = rows.B
    src = kv_source("k", k, layout_k, B, cu=cu_seqlens_k, cu_name="cu_seqlens_k", seqused=seqused_k,
                    used_name="seqused_k", block_table=block_table, table_name="block_table", content=content,
                    cls=source_cls)
    check_batch_vector("cmp_residual_k", cmp_residual_k, B)
    if cmp_residual_k is not None and content:
        for b, v in enumerate(host_ints(cmp_residual_k)):
            if not (0 <= v < cmp_ratio):
                fail("cmp_residual_k", f"value {v} at batch {b} is not in [0, cmp_ratio={cmp_ratio})")
    if cmp_residual_k is None or cmp_ratio == 1:
        resid = torch.zeros(B, dtype=torch.int64, device=q.device)
    else:
        resid = cmp_residual_k.to(torch.int64)
    return problem_cls(q, rows.flat(w), rows, src, resid, cmp_ratio, mask_mode, content)


def check_index_pair(q, layout_q, sparse_indices, attn_softmax_l1_norm) -> None:
    check_tensor("sparse_indices", sparse_indices)
    check_tensor("attn_softmax_l1_norm", attn_softmax_l1_norm)
    check_int32("sparse_indices", sparse_indices)
    check_dtype("attn_softmax_l1_norm", attn_softmax_l1_norm, torch.float32)
    lead = _leading(q, layout_q)
    if (sparse_indices.dim() != len(lead) + 2 or tuple(sparse_indices.shape[:-2]) != lead
            or sparse_indices.size(-2) != 1):
        fail("sparse_indices", f"expected shape {list(lead) + [1, 'K']}, got {tuple(sparse_indices.shape)}")
    if tuple(attn_softmax_l1_norm.shape) != tuple(sparse_indices.shape):
        fail("attn_softmax_l1_norm", f"expected the shape of sparse_indices {tuple(sparse_indices.shape)}, "
             f"got {tuple(attn_softmax_l1_norm.shape)}")


def check_offset(offset, P: IndexerProblem, layout_q: str):
    """``output_idx_offset``: ``[B]`` per batch or ``[B, S1, 1]`` / ``[T1, 1]`` per row -> ``[R]`` int64."""
    if offset is None:
        return None
    check_int32("output_idx_offset", offset)
    rows = P.rows
    per_row = (P.q.size(0), P.q.size(1), 1) if layout_q == "BSND" else (rows.R, 1)
    if tuple(offset.shape) == (rows.B,):
        return offset.to(torch.int64)[rows.batch]
    if tuple(offset.shape) == per_row:
        return offset.reshape(rows.R).to(torch.int64)
    fail("output_idx_offset", f"expected shape [B]=[{rows.B}] or per row {list(per_row)}, got {tuple(offset.shape)}")


def kl_valid_slots(P: IndexerProblem, idx: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    """Valid slots of the KL-loss walk (10 §2.4): cap = min(realK, K), -1 ends, >= realK skipped."""
    real_k = P.num_valid(t0, t1)
    return sparse_walk_t(idx, real_k, real_k)


# The widest top-k accepted: outputs are [rows, topk] int32 + fp32, so a wider one is a mistake that would
# otherwise reach the allocator (2^40: "can't allocate 8 TB"); no DeepSeek model selects more than 2048.
MAX_TOPK = 1 << 24


def check_lightning_attrs(topk: int, max_seqlen_q: int, return_value: int) -> None:
    if topk < 1 or topk > MAX_TOPK:
        fail("topk", f"value {topk} must be in [1, {MAX_TOPK}] (the output holds topk slots per query row)")
    if max_seqlen_q < -1:
        fail("max_seqlen_q", f"value {max_seqlen_q} must be -1 or >= 0")
    check_choice("return_value", return_value, (0, 1))


def check_offset_results(idx: torch.Tensor, offset, content: bool) -> None:
    """A valid index plus its ``output_idx_offset`` must stay >= 0 (content check)."""
    if offset is not None and content and bool((idx < -1).any()):
        fail("output_idx_offset", "makes an output index negative; every offset index must be >= 0")


# ---- the top-k selection every backend finishes with ----


def topk_positions(score: torch.Tensor, k: int) -> torch.Tensor:
    """Columns of the ``k`` best of each row of ``score [r, W]`` (``W >= k``), ordered as the golden's
    stable descending sort orders them: by score, ties to the lower column.  Selection, not a
    sort: ``topk`` finds each row's k-th value ``v``; every column above ``v`` is kept and the
    columns equal to ``v`` are taken lowest first; only the k kept columns are then sorted.
    No data-dependent shapes (no ``nonzero``): safe on any device."""
    dev = score.device
    W = score.size(1)
    kth = torch.topk(score, k, dim=1).values[:, -1:]
    above = score > kth
    tied = score == kth
    room = k - above.sum(1, keepdim=True)
    keep = above | (tied & (torch.cumsum(tied, 1) <= room))
    # exactly k kept per row: the largest of (W - column) over the kept columns are their columns in order
    rank = torch.where(keep, W - torch.arange(W, device=dev), torch.zeros((), dtype=torch.int64, device=dev))
    cols = torch.topk(rank, k, dim=1).indices                      # kept columns, ascending
    order = torch.sort(score.gather(1, cols), dim=1, descending=True, stable=True).indices
    return cols.gather(1, order)


def select_topk(score: torch.Tensor, n: torch.Tensor, topk: int, offset: torch.Tensor | None):
    """The ``topk`` best of each row's scores ``[r, W]`` (-inf past its ``n`` selectable keys), in the
    golden's order (descending, ties: lower key index first) -> ``(indices int32, values float32)``,
    -1 / -inf past ``min(n, topk)``; ``offset`` ``[r]`` is added to the kept indices."""
    if score.size(1) < topk:
        score = torch.nn.functional.pad(score, (0, topk - score.size(1)), value=float("-inf"))
    si = topk_positions(score, topk)
    sv = score.gather(1, si)
    return finish_topk(si, sv, n, topk, offset)


def finish_topk(si, sv, n, topk: int, offset):
    """-1 / -inf past each row's ``min(n, topk)`` slots; ``offset`` added to the kept indices."""
    dev = si.device
    keep = torch.arange(topk, device=dev)[None, :] < torch.clamp(n, max=topk)[:, None]
    if offset is not None:
        si = si + offset[:, None]
    return (torch.where(keep, si, torch.full((), -1, device=dev)).to(torch.int32),
            torch.where(keep, sv, torch.full((), float("-inf"), device=dev)))
