"""Validation and length resolution of the two-branch sparse attention (20-sparse-flash-mla §1-3).

:func:`parse_mla` checks every argument of ``sparse_flash_mla`` / ``sparse_flash_mla_grad``
(00 §10 error rules) and returns an :class:`MlaProblem`: the query rows, the ori and cmp
key sources, the per-batch bounds and attributes.  The golden reference walks it row by row;
the fast kernels ask it for vectorised key lists of a block of rows (:meth:`MlaProblem.keys`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.checks import (check_batch_vector, check_choice, check_dtype, check_float, check_int32,
                             check_same_device, content_checks_enabled, fail, host_ints,
                             stat_dtype)
from ..common.layout import PAGED, KVSource, QueryRows, check_batch_agreement, kv_source, query_rows
from ..common.masks import cmp_threshold_t, ori_range_t, sparse_walk_t

Q_LAYOUTS = ("BSND", "TND")
KV_LAYOUTS = ("BSND", "TND", PAGED)


@dataclass
class RowKeys:
    """Key addresses of a block of query rows: ori keys then cmp keys, ``W = Wo + Wc`` wide."""

    valid: torch.Tensor       # [R] valid (non-padding, non-invalid) rows
    ori_x: torch.Tensor       # [R, Wo] logical ori positions
    ori_mask: torch.Tensor    # [R, Wo]
    ori_addr: tuple           # physical (i0, i1), each [R, Wo]
    cmp_x: torch.Tensor | None
    cmp_mask: torch.Tensor | None
    cmp_addr: tuple | None
    batch: torch.Tensor | None = None   # [R, 1] batch of each row (for addresses computed later)

    @property
    def mask(self) -> torch.Tensor:
        if self.cmp_mask is None:
            return self.ori_mask
        return torch.cat([self.ori_mask, self.cmp_mask], dim=1)


@dataclass
class MlaProblem:
    q: torch.Tensor
    rows: QueryRows
    ori: KVSource
    cmp: KVSource | None
    cmp_idx: torch.Tensor | None      # [R, K] flattened cmp_sparse_indices
    ori_idx: torch.Tensor | None      # [R, Ko] flattened ori_sparse_indices
    Lc: torch.Tensor | None           # [B] int64 compressed causal bound
    sinks: torch.Tensor | None
    scale: float
    r: int
    om: int
    cm: int
    wl: int
    wr: int
    content: bool
    cmp_len: torch.Tensor | None = None  # [R] int64 cap of the compressed walk (cmp_topk_length), or None

    @property
    def positional(self) -> bool:
        return self.om in (3, 4) or (self.cmp is not None and self.cm == 3)

    @property
    def ori_width(self) -> int:
        cap = self.ori.capacity
        if self.om == 4 and self.wl != -1 and self.wr != -1:
            return min(self.wl + self.wr + 1, cap)
        return cap

    @property
    def cmp_width(self) -> int:
        if self.cmp is None:
            return 0
        if self.cmp_idx is None:
            return self.cmp.capacity
        # The walk examines at most min(K, thr) slots and thr <= S2c, so later slots never count.
        return min(self.cmp_idx.size(1), self.cmp.capacity)

    def walk_limit(self, thr: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """Slots the compressed walk of rows ``[t0, t1)`` examines: ``min(thr, cmp_topk_length)``
        (K is the list's own width)."""
        return thr if self.cmp_len is None else torch.minimum(thr, self.cmp_len[t0:t1])

    def keys(self, t0: int, t1: int, addresses: bool = True) -> RowKeys:
        """Vectorised key selection (§1.2) for flattened query rows ``[t0, t1)``.  ``addresses=False``
        leaves the physical addresses (and the block-table checks) to the caller, which turns the
        positions into flat row numbers itself (:meth:`KVSource.rows_index` with ``check=content``)."""
        rows, dev = self.rows, self.q.device
        b = rows.batch[t0:t1]
        i = rows.local[t0:t1]
        S1e = rows.extent[b]
        S2o = self.ori.lengths[b]
        p = S2o - S1e + i
        valid = rows.used[t0:t1]
        if self.positional:
            valid = valid & (p >= 0)
        lo, hi = ori_range_t(p, S2o, self.om, self.wl, self.wr)
        ox = lo[:, None] + torch.arange(self.ori_width, device=dev)[None, :]
        om = valid[:, None] & (ox < hi[:, None])
        oaddr = self.ori.locate(b[:, None], ox, om, check=self.content) if addresses else None
        if self.cmp is None:
            return RowKeys(valid, ox, om, oaddr, None, None, None, b[:, None])
        pc = self.Lc[b] - S1e + i
        thr = cmp_threshold_t(pc, S2o, self.cmp.lengths[b], self.r, self.cm)
        if self.cmp_idx is None:
            cx = torch.arange(self.cmp_width, device=dev)[None, :].expand(t1 - t0, -1)
            cm = cx < thr[:, None]
        else:
            cx = self.cmp_idx[t0:t1, : self.cmp_width].to(torch.int64)
            cm = sparse_walk_t(cx, self.walk_limit(thr, t0, t1), thr)
        cm = cm & valid[:, None]
        caddr = self.cmp.locate(b[:, None], cx, cm, check=self.content) if addresses else None
        return RowKeys(valid, ox, om, oaddr, cx, cm, caddr, b[:, None])

    def key_tables(self, module, t0: int, t1: int) -> list[torch.Tensor]:
        """The keys :meth:`keys` selects for rows ``[t0, t1)`` as row numbers of each source's
        :meth:`KVSource.flat_rows` (ori ``[r, Wo]``, then cmp ``[r, Wc]``; -1 = no key), from one call
        of the compiled layer ``module`` (CPU tensors): the same numbers and the same block-table
        errors as :meth:`keys` followed by :meth:`KVSource.rows_index` per source."""
        rows, ori, cmp = self.rows, self.ori, self.cmp
        kind, table, page, blocks = ori.key_map()
        extra = {}
        if cmp is not None:
            c_kind, c_table, c_page, c_blocks = cmp.key_map()
            extra = dict(cmp_lengths=cmp.lengths.contiguous(), cmp_bound=self.Lc.contiguous(), cmp_kind=c_kind,
                         cmp_map=c_table, cmp_page=c_page, cmp_blocks=c_blocks, cmp_width=self.cmp_width,
                         cmp_mask_mode=self.cm, ratio=self.r, cmp_indices=self.cmp_idx,
                         walk_cap=None if self.cmp_len is None else self.cmp_len.contiguous())
        tables, bad = module.key_tables(t0, t1, rows.batch, rows.local, rows.used, rows.extent.contiguous(),
                                        ori.lengths.contiguous(), kind, table, page, blocks, self.ori_width, self.om,
                                        self.wl, self.wr, self.positional, **extra)
        if self.content:
            for src, first in zip((ori, cmp), bad):
                if first:
                    src._table_error(*first)
        return tables if cmp is not None else tables[:1]

    def gather(self, k: RowKeys, dtype: torch.dtype) -> torch.Tensor:
        """Key rows ``[R, W, D]`` in ``dtype``; rows of masked slots are exactly zero (whatever
        the cache holds there, NaN included)."""
        parts = [(self.ori, k.ori_addr, k.ori_mask)]
        if self.cmp is not None:
            parts.append((self.cmp, k.cmp_addr, k.cmp_mask))
        R = k.valid.size(0)
        out = torch.empty(R, sum(m.size(1) for _, _, m in parts), self.ori.D, dtype=dtype, device=self.q.device)
        col = 0
        for src, addr, mask in parts:
            w = mask.size(1)
            block = out[:, col:col + w]
            block.copy_(src.gather(*addr))
            block.masked_fill_(~mask[..., None], 0.0)             # assignment: NaN rows become exact 0
            col += w
        return out

    def rows_per_block(self, extra_per_key: int = 0, budget_bytes: int = 32 << 20) -> int:
        """Query rows per block so that the gathered keys and scores stay within a budget."""
        W = max(1, self.ori_width + self.cmp_width)
        H, D = self.q.size(-2), self.q.size(-1)
        per_row = W * (D + 3 * H + extra_per_key) * 4
        return max(1, min(self.rows.R, budget_bytes // per_row))


def _leading(q: torch.Tensor, layout_q: str) -> tuple:
    return tuple(q.shape[:2] if layout_q == "BSND" else q.shape[:1])


def check_index_list(name: str, idx: torch.Tensor | None, q: torch.Tensor, layout_q: str) -> None:
    if idx is None:
        return
    check_int32(name, idx)
    lead = _leading(q, layout_q)
    if tuple(idx.shape[:-2]) != lead or idx.dim() != len(lead) + 2 or idx.size(-2) != 1:
        fail(name, f"expected shape {list(lead) + [1, 'K']}, got {tuple(idx.shape)}")


def parse_mla(q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, cmp_sparse_indices=None,
              ori_block_table=None, cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
              cu_seqlens_cmp_kv=None, seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None,
              cmp_residual_kv=None, ori_topk_length=None, cmp_topk_length=None, sinks=None,
              metadata=None, softmax_scale=1.0, cmp_ratio=1, ori_mask_mode=4, cmp_mask_mode=3,
              ori_win_left=127, ori_win_right=0, layout_q="BSND", layout_kv="BSND", topk_value_mode=1,
              content=None, packed=None) -> MlaProblem:
    """Validate a sparse_flash_mla(_grad) call; ``content=None`` decides by the tensors.

    ``packed`` (a :class:`dsattn.quant.PackedKV`) says that ``ori_kv`` / ``cmp_kv`` hold packed
    quantised rows, dequantised to the query dtype as they are gathered."""
    # -- attributes
    check_choice("layout_q", layout_q, Q_LAYOUTS)
    check_choice("layout_kv", layout_kv, KV_LAYOUTS)
    if layout_kv in ("BSND", "TND") and layout_kv != layout_q:
        fail("layout_kv", f"{layout_kv!r} cannot be combined with layout_q={layout_q!r}; allowed pairs: "
             "(BSND, BSND), (TND, TND), (BSND, PA_BBND), (TND, PA_BBND)")
    check_choice("ori_mask_mode", ori_mask_mode, (0, 3, 4))
    check_choice("cmp_mask_mode", cmp_mask_mode, (0, 3))
    for name, w in (("ori_win_left", ori_win_left), ("ori_win_right", ori_win_right)):
        if w < -1:
            fail(name, f"value {w} must be >= -1 (-1 = unbounded)")
    check_choice("topk_value_mode", topk_value_mode, (0, 1, 2))
    if topk_value_mode == 2:
        fail("topk_value_mode", "value 2 is not supported (0 and 1 are)", NotImplementedError)
    if ori_topk_length is not None:
        fail("ori_topk_length", "is not supported (the ori branch is positional: band / causal); pass None",
             NotImplementedError)
    if cmp_kv is not None and not (1 <= cmp_ratio <= 128):
        fail("cmp_ratio", f"value {cmp_ratio} is not in [1, 128]")
    # -- tensors: dtypes
    check_float("q", q, allow_f64=True)
    if ori_kv is None:
        fail("ori_kv", "is required (every scenario has the ori branch)")
    if q.dtype == torch.float64 and packed is None and ori_kv.dtype != torch.float64:
        # float64 is dsattn's extension for gradient checks, whole-call: the query is the odd one out
        fail("q", f"dtype torch.float64 needs float64 ori_kv and cmp_kv too (dsattn's float64 extension for "
             f"gradient checks), got ori_kv {ori_kv.dtype}; with {ori_kv.dtype} caches pass q as "
             f"{ori_kv.dtype}", TypeError)
    if packed is None:
        check_dtype("ori_kv", ori_kv, q.dtype, "must match q")
        check_dtype("cmp_kv", cmp_kv, q.dtype, "must match q")
    else:
        packed.check_dtype("ori_kv", ori_kv)
        check_dtype("cmp_kv", cmp_kv, ori_kv.dtype, "both packed caches hold one payload type, ori_kv's")
    check_dtype("sinks", sinks, stat_dtype(q))
    for name, t in (("ori_sparse_indices", ori_sparse_indices), ("cmp_sparse_indices", cmp_sparse_indices),
                    ("ori_block_table", ori_block_table), ("cmp_block_table", cmp_block_table),
                    ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_ori_kv", cu_seqlens_ori_kv),
                    ("cu_seqlens_cmp_kv", cu_seqlens_cmp_kv), ("seqused_q", seqused_q),
                    ("seqused_ori_kv", seqused_ori_kv), ("seqused_cmp_kv", seqused_cmp_kv),
                    ("cmp_residual_kv", cmp_residual_kv), ("metadata", metadata), ("cmp_topk_length", cmp_topk_length)):
        check_int32(name, t)
    if cmp_kv is None:
        for name, t in (("cmp_sparse_indices", cmp_sparse_indices), ("cmp_block_table", cmp_block_table),
                        ("cu_seqlens_cmp_kv", cu_seqlens_cmp_kv), ("seqused_cmp_kv", seqused_cmp_kv),
                        ("cmp_topk_length", cmp_topk_length)):
            if t is not None:
                fail(name, "is given but cmp_kv is None")
    check_same_device(q=q, ori_kv=ori_kv, cmp_kv=cmp_kv, ori_sparse_indices=ori_sparse_indices,
                      cmp_sparse_indices=cmp_sparse_indices, ori_block_table=ori_block_table,
                      cmp_block_table=cmp_block_table, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_ori_kv=cu_seqlens_ori_kv, cu_seqlens_cmp_kv=cu_seqlens_cmp_kv,
                      seqused_q=seqused_q, seqused_ori_kv=seqused_ori_kv, seqused_cmp_kv=seqused_cmp_kv,
                      cmp_residual_kv=cmp_residual_kv, sinks=sinks, cmp_topk_length=cmp_topk_length)
    # -- shapes
    rank = 4 if layout_q == "BSND" else 3
    if q.dim() != rank:
        fail("q", f"expected a {rank}-D tensor for layout {layout_q}, got shape {tuple(q.shape)}")
    N1, D = q.size(-2), q.size(-1)
    if N1 < 1 or D < 1:
        fail("q", f"head count and head dim must be >= 1, got shape {tuple(q.shape)}")
    for name, kv in (("ori_kv", ori_kv), ("cmp_kv", cmp_kv)):
        if packed is not None:
            packed.check(name, kv, D)
        elif kv is not None and kv.size(-1) != D:
            fail(name, f"head dim {kv.size(-1)} does not match q's head dim {D}")
    if sinks is not None and tuple(sinks.shape) != (N1,):
        fail("sinks", f"expected shape [N1]=[{N1}], got {tuple(sinks.shape)}")
    check_index_list("ori_sparse_indices", ori_sparse_indices, q, layout_q)
    check_index_list("cmp_sparse_indices", cmp_sparse_indices, q, layout_q)
    if content is None:
        content = content_checks_enabled(q, cu_seqlens_q)
    if layout_q == "TND":
        check_batch_agreement("cu_seqlens_q", cu_seqlens_q, cu_seqlens_ori_kv=(cu_seqlens_ori_kv, 1),
                              cu_seqlens_cmp_kv=(cu_seqlens_cmp_kv, 1), seqused_q=(seqused_q, 0),
                              seqused_ori_kv=(seqused_ori_kv, 0), seqused_cmp_kv=(seqused_cmp_kv, 0),
                              ori_block_table=(ori_block_table, 0), cmp_block_table=(cmp_block_table, 0),
                              cmp_residual_kv=(cmp_residual_kv, 0))
    rows = query_rows(q, layout_q, cu_seqlens_q, seqused_q, content=content)
    B = rows.B
    paged = layout_kv == PAGED
    ori = kv_source("ori_kv", ori_kv, layout_kv, B, cu=cu_seqlens_ori_kv, cu_name="cu_seqlens_ori_kv",
                    seqused=seqused_ori_kv, used_name="seqused_ori_kv", block_table=ori_block_table,
                    table_name="ori_block_table", content=content)
    cmp, Lc = None, None
    r = cmp_ratio
    check_batch_vector("cmp_residual_kv", cmp_residual_kv, B)
    if cmp_kv is not None:
        cmp = kv_source("cmp_kv", cmp_kv, layout_kv, B, cu=cu_seqlens_cmp_kv, cu_name="cu_seqlens_cmp_kv",
                        seqused=seqused_cmp_kv, used_name="seqused_cmp_kv", block_table=cmp_block_table,
                        table_name="cmp_block_table", content=content,
                        paged_default=torch.div(ori.lengths, r, rounding_mode="floor") if paged else None)
        if cmp_residual_kv is None:
            Lc = ori.lengths
        else:
            if content:
                for b, v in enumerate(host_ints(cmp_residual_kv)):
                    if not (0 <= v < r):
                        fail("cmp_residual_kv", f"value {v} at batch {b} is not in [0, cmp_ratio={r})")
            Lc = cmp.lengths * r + cmp_residual_kv.to(torch.int64)
    if packed is not None:
        for src in (ori, cmp):
            if src is not None:
                src.decode, src.decoded_dim, src.packed = packed.decoder(q.dtype), D, packed
    cmp_len = _cmp_topk_length(cmp_topk_length, cmp_sparse_indices, q, rows, layout_q, content)
    return MlaProblem(q, rows, ori, cmp,
                      None if cmp_sparse_indices is None else rows.flat(cmp_sparse_indices)[:, 0],
                      None if ori_sparse_indices is None else rows.flat(ori_sparse_indices)[:, 0],
                      Lc, sinks, float(softmax_scale), r, ori_mask_mode, cmp_mask_mode,
                      ori_win_left, ori_win_right, content, cmp_len)


def _cmp_topk_length(length, idx, q, rows: QueryRows, layout_q: str, content: bool):
    """20 §2.8: ``cmp_topk_length`` ``[B]`` (per request) or one per query row (``[T]`` TND,
    ``[B, S1]`` BSND), values in ``[0, K]`` -> the per-row cap ``[R]`` int64 of the compressed walk
    (None without it).  A TND call with ``T == B`` reads it per row: the more general form (a
    per-request cap is its expansion to rows), and the same thing when every request has one
    query row (decode)."""
    if length is None:
        return None
    if idx is None:
        fail("cmp_topk_length", "caps the sparse compressed walk but cmp_sparse_indices is None")
    per_row = tuple(q.shape[:2] if layout_q == "BSND" else q.shape[:1])
    shape = tuple(length.shape)
    if shape == per_row:
        cap = rows.flat(length.unsqueeze(-1))[:, 0].to(torch.int64)
    elif shape == (rows.B,):
        cap = length.to(torch.int64)[rows.batch]
    else:
        fail("cmp_topk_length", f"expected shape [B]=[{rows.B}] or one per query row {list(per_row)}, got {shape}")
    K = idx.size(-1)
    if content:
        v = host_ints(length.reshape(-1))
        bad = next((x for x in v if not 0 <= x <= K), None)
        if bad is not None:
            fail("cmp_topk_length", f"value {bad} is not in [0, K={K}] (K: cmp_sparse_indices' last dim)")
    return cap


def check_grad_inputs(q, dout, attn_out, softmax_lse, layout_q, layout_kv) -> None:
    """The extra rules of sparse_flash_mla_grad (20 §3.6)."""
    if layout_kv == PAGED:
        fail("layout_kv", "the gradient does not support a paged KV layout; use BSND or TND")
    for name, t in (("dout", dout), ("attn_out", attn_out)):
        check_dtype(name, t, q.dtype, "must match q")
        if tuple(t.shape) != tuple(q.shape):
            fail(name, f"expected the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
    check_dtype("softmax_lse", softmax_lse, stat_dtype(q))
    expected = lse_shape(q, layout_q)
    if tuple(softmax_lse.shape) != expected:
        fail("softmax_lse", f"expected the forward LSE layout {expected}, got {tuple(softmax_lse.shape)}"
             + (" (a placeholder: call the forward with return_softmax_lse=True)" if softmax_lse.dim() == 0 else ""))


def lse_shape(q: torch.Tensor, layout_q: str) -> tuple:
    """[B, N2=1, S1, G] for BSND queries, [N2=1, T1, G] for TND."""
    if layout_q == "BSND":
        return (q.size(0), 1, q.size(1), q.size(2))
    return (1, q.size(0), q.size(1))


def lse_to_rows(lse: torch.Tensor, rows: QueryRows) -> torch.Tensor:
    """Forward LSE layout -> ``[R, H]``."""
    return lse.reshape(rows.R, lse.size(-1)) if rows.layout == "TND" else lse[:, 0].reshape(rows.R, lse.size(-1))


def lse_from_rows(lse: torch.Tensor, q: torch.Tensor, layout_q: str) -> torch.Tensor:
    """``[R, H]`` -> the forward LSE layout."""
    return lse.reshape(lse_shape(q, layout_q))


# ---- results shared by every backend ----


def l1_outputs(P: MlaProblem, k, Pmean: torch.Tensor, t0: int, t1: int, cmp_l1, ori_l1) -> None:
    """Write the L1-norm outputs of rows ``[t0, t1)`` from ``Pmean [r, W]`` (P averaged over heads,
    per key column): cmp slot s is column ``Wo + s``; an ori slot is its listed position's column
    in the row's window (0 where not inside it or past the list's first -1)."""
    Wo = P.ori_width
    sdt, dev = stat_dtype(P.q), P.q.device
    if cmp_l1 is not None:
        cmp_l1[t0:t1, : P.cmp_width] = Pmean[:, Wo:].to(sdt)
    if ori_l1 is not None and Wo > 0:                                   # Wo = 0: no ori key, l1 stays 0
        x = P.ori_idx[t0:t1].to(torch.int64)
        walk = (torch.cumsum((x < 0).to(torch.int32), -1) == 0) & k.valid[:, None]
        col = x - k.ori_x[:, :1]
        inside = walk & (col >= 0) & (col < Wo)
        colc = torch.where(inside, col, torch.zeros_like(col))
        hit = inside & torch.gather(k.ori_mask, 1, colc)
        ori_l1[t0:t1] = torch.where(hit, torch.gather(Pmean[:, :Wo], 1, colc),
                                    torch.zeros((), dtype=Pmean.dtype, device=dev)).to(sdt)


def grad_results(P: MlaProblem, dq, dori, dcmp, dsinks, ori_l1, cmp_l1) -> tuple:
    """The op's outputs from flattened-row gradients (fp32 KV gradients cast to the KV dtype; empty
    tensors for absent parts)."""
    q, rows = P.q, P.rows
    sdt, dev = stat_dtype(q), q.device
    empty = torch.zeros(0, dtype=sdt, device=dev)
    return (rows.unflat(dq, q),
            dori.to(P.ori.tensor.dtype),
            dcmp.to(P.cmp.tensor.dtype) if dcmp is not None else torch.zeros(0, dtype=q.dtype, device=dev),
            dsinks.to(sdt) if dsinks is not None else empty,
            rows.unflat(ori_l1, q).unsqueeze(-2) if ori_l1 is not None else empty,
            rows.unflat(cmp_l1, q).unsqueeze(-2) if cmp_l1 is not None else empty)
