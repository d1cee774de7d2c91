"""Layouts and per-batch lengths (00-overview §5).

Two views are built from the user's tensors, once per call, and reused by the golden
references and the fast kernels alike:

* :class:`QueryRows` flattens BSND ``[B, S1, ...]`` or TND ``[T1, ...]`` query tensors to
  ``R`` rows and tells, per row, its batch, its index inside the batch's extent, and whether
  it is a used row (not padding).
* :class:`KVSource` addresses key rows of one batch by logical position through the
  BSND, TND or paged (``PA_BBND``: ``[num_blocks, block_size, 1, D]`` + ``block_table``)
  layout, without ever copying a cache.

All per-batch quantities are int64 tensors on the tensors' device, so the fast kernels can
use them without reading them back to the host.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .checks import check_batch_vector, check_int32, content_checks_enabled, fail, host_ints

PAGED = "PA_BBND"


def width_bound(static: int, lengths: torch.Tensor, clamp: bool = True) -> int:
    """Static upper bound of a per-batch length, tightened from the data on the CPU.

    On a CPU tensor reading the maximum costs nothing (no device sync); on an accelerator
    the static bound (a tensor extent) keeps shapes independent of tensor contents.
    """
    if lengths.numel() == 0:
        return 0
    if lengths.device.type == "cpu" and content_checks_enabled(lengths):
        longest = int(lengths.max())
        return max(0, min(static, longest) if clamp else longest)
    return max(0, static)


def _check_cu_seqlens(arg: str, cu: torch.Tensor | None, total: int, content: bool) -> int:
    """Shape-check ``cu_seqlens`` and return B; content: starts at 0, monotone, ends <= total."""
    if cu is None:
        fail(arg, "is required for layout TND")
    check_int32(arg, cu)
    if cu.dim() != 1 or cu.size(0) < 2:
        fail(arg, f"expected shape [B+1] with B >= 1, got {tuple(cu.shape)}")
    if content:
        v = host_ints(cu)
        if v[0] != 0:
            fail(arg, f"must start at 0, got {v[0]}")
        for b in range(len(v) - 1):
            if v[b + 1] < v[b]:
                fail(arg, f"must be non-decreasing, got {v[b]} then {v[b + 1]} at batch {b}")
        if v[-1] > total:
            fail(arg, f"last value {v[-1]} exceeds the tensor's {total} rows")
    return cu.size(0) - 1


def _check_used(arg: str, used: torch.Tensor | None, extent: torch.Tensor, what: str, content: bool):
    if used is None or not content:
        return
    u, e = host_ints(used), host_ints(extent)
    for b, (ub, eb) in enumerate(zip(u, e)):
        if ub < 0 or ub > eb:
            fail(arg, f"value {ub} at batch {b} is not in [0, {eb}] ({what})")


def check_batch_agreement(cu_name: str, cu: torch.Tensor | None, **per_batch) -> None:
    """A TND query's batch size comes from its ``cu_seqlens`` (``B + 1`` entries).  When two or more
    other per-batch arguments all agree on another B, the ``cu_seqlens`` is the odd one out: name it, rather
    than the first argument that disagrees with it.  ``per_batch``: name -> (tensor or None,
    entries minus B: 1 for cu_seqlens, 0 for [B] vectors and block-table rows)."""
    if cu is None or cu.dim() != 1:
        return
    Bq = cu.size(0) - 1
    others = {name: t.size(0) - extra for name, (t, extra) in per_batch.items() if t is not None and t.dim() >= 1}
    if len(others) >= 2 and len(set(others.values())) == 1:              # one other argument: ambiguous
        (Bo,) = set(others.values())
        if Bo != Bq and Bo >= 1:
            fail(cu_name, f"has {Bq + 1} entries (B={Bq}) but {', '.join(others)} describe B={Bo} "
                 f"(expected {Bo + 1} entries)")


@dataclass
class QueryRows:
    """Flattened query rows of a BSND or TND tensor."""

    layout: str
    B: int
    R: int
    batch: torch.Tensor      # [R] int64, batch of each row (clamped for TND rows past cu[B])
    local: torch.Tensor      # [R] int64, row index i inside the batch's extent
    extent: torch.Tensor     # [B] int64, S1e(b)
    used: torch.Tensor       # [R] bool, row is a used (non-padding) row
    max_extent: int          # static bound of S1e

    def host_used_rows(self):
        """Yield ``(b, i, t, S1e)`` for every used row (t = flattened index); reads the data on
        the host, so it is for the golden references only."""
        extent, batch, local = host_ints(self.extent), host_ints(self.batch), host_ints(self.local)
        for t, used in enumerate(self.used.tolist()):
            if used:
                yield batch[t], local[t], t, extent[batch[t]]

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, S1, ...]`` or ``[T1, ...]`` -> ``[R, ...]`` (a view)."""
        return t.reshape(self.R, *t.shape[2:]) if self.layout == "BSND" else t

    def flat_unit_stride(self, t: torch.Tensor) -> torch.Tensor:
        """:meth:`flat` with a unit-stride last dim (copied only when it is not): what a kernel that
        addresses rows and heads by strides reads."""
        t = self.flat(t)
        return t if t.stride(-1) == 1 else t.contiguous()

    def unflat(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t.reshape(like.shape[: 2 if self.layout == "BSND" else 1] + t.shape[1:])


def query_rows(q: torch.Tensor, layout: str, cu_seqlens: torch.Tensor | None,
               seqused: torch.Tensor | None, *, q_name: str = "q", cu_name: str = "cu_seqlens_q",
               used_name: str = "seqused_q", content: bool = True) -> QueryRows:
    """Resolve S1e / S1u (00 §5.2) for a query-like tensor of rank 4 (BSND) or 3 (TND)."""
    dev = q.device
    if layout == "BSND":
        if cu_seqlens is not None:
            fail(cu_name, "must be None for layout BSND")
        B, S1 = q.size(0), q.size(1)
        R = B * S1
        batch = torch.arange(B, device=dev).repeat_interleave(S1)
        local = torch.arange(S1, device=dev).repeat(B)
        extent = torch.full((B,), S1, dtype=torch.int64, device=dev)
        in_range = torch.ones(R, dtype=torch.bool, device=dev)
        max_extent = S1
    else:
        T = q.size(0)
        B = _check_cu_seqlens(cu_name, cu_seqlens, T, content)
        cu = cu_seqlens.to(torch.int64)
        R = T
        rows = torch.arange(T, device=dev)
        raw_batch = torch.searchsorted(cu[1:].contiguous(), rows, right=True)
        in_range = raw_batch < B
        batch = raw_batch.clamp(max=B - 1)
        local = rows - cu[batch]
        extent = cu[1:] - cu[:-1]
        max_extent = width_bound(T, extent)
    check_batch_vector(used_name, seqused, B)
    _check_used(used_name, seqused, extent, "the query extent S1e", content)
    used_len = extent if seqused is None else seqused.to(torch.int64)
    used = in_range & (local < used_len[batch])
    return QueryRows(layout, B, R, batch, local, extent, used, max_extent)


@dataclass
class KVSource:
    """Key rows of one KV tensor, addressed per batch by logical position."""

    name: str
    tensor: torch.Tensor            # BSND [B,S,1,D] | TND [T,1,D] | paged [nb,bs,1,D]
    layout: str
    lengths: torch.Tensor           # [B] int64, resolved key length per batch
    capacity: int                   # static bound of lengths
    cu: torch.Tensor | None = None  # TND segment starts (int64)
    block_table: torch.Tensor | None = None
    table_name: str = "block_table"
    # Packed (quantised) rows: ``decode`` turns gathered rows into keys of width ``decoded_dim``.
    decode: Callable[[torch.Tensor], torch.Tensor] | None = None
    decoded_dim: int | None = None
    packed: object | None = None    # the dsattn.quant.PackedKV layout of the rows (kernels that decode in place)

    @property
    def D(self) -> int:
        return self.tensor.size(-1) if self.decoded_dim is None else self.decoded_dim

    def locate(self, b: torch.Tensor, x: torch.Tensor, mask: torch.Tensor, check: bool = False):
        """Physical (i0, i1) of logical key ``x`` of batch ``b``; entries where ``mask`` is False
        point at a harmless row (never an out-of-range one).  ``check`` raises ValueError when a
        selected (masked-in) position needs a missing or out-of-range block-table entry."""
        x = torch.where(mask, x, torch.zeros_like(x))
        if self.layout == "BSND":
            return b.expand_as(x), x
        if self.layout == "TND":
            return torch.zeros_like(x), torch.where(mask, self.cu[b] + x, torch.zeros_like(x))
        bs = self.tensor.size(1)
        nbt = self.block_table.size(1)
        col = x // bs
        blk = self.block_table[b.expand_as(x), col.clamp(max=max(nbt - 1, 0))].to(torch.int64)
        if check:
            bad = mask & ((col >= nbt) | (blk < 0) | (blk >= self.tensor.size(0)))
            if bool(bad.any()):
                k = tuple(bad.nonzero()[0].tolist())
                self._table_error(int(b.expand_as(x)[k]), int(x[k]))
        blk = torch.where(mask, blk, torch.zeros_like(blk))
        return blk, torch.where(mask, x % bs, torch.zeros_like(x))

    def _table_error(self, b: int, x: int):
        """ValueError naming the block table: batch ``b`` needs position ``x``, whose block column
        is past the table or whose entry is not a block of the cache."""
        bs, nbt, nb = self.tensor.size(1), self.block_table.size(1), self.tensor.size(0)
        if x // bs >= nbt:
            fail(self.table_name, f"too short: batch {b} needs position {x} (block column {x // bs}) but the "
                 f"table has {nbt} columns")
        fail(self.table_name, f"entry [{b}, {x // bs}] = {int(self.block_table[b, x // bs])} is needed for "
             f"position {x} but is not in [0, num_blocks={nb})")

    def check_table_covers(self, needed: torch.Tensor, used_name: str) -> None:
        """ValueError naming the length argument or the block table when batch ``b``'s first
        ``needed[b]`` keys are not all in blocks of the cache (a content check: CPU tensors).  Kernels
        that read a request's keys block by block check this once per call instead of per key."""
        if self.layout != PAGED:
            return
        bs, nbt, nb = self.tensor.size(1), self.block_table.size(1), self.tensor.size(0)
        needed = needed.to(torch.int64).cpu()
        module = None
        if self.block_table.device.type == "cpu" and self.block_table.dtype == torch.int32 and bs > 0:
            from .. import native
            module = native.load()
        if module is not None and not module.table_covers(self.block_table, needed, bs, nb):
            return                           # (one compiled pass; what it finds is worded below)
        cols = (needed + bs - 1) // bs
        over = (cols > nbt).nonzero()
        if over.numel():
            b = int(over[0, 0])
            fail(used_name, f"batch {b} reads {int(needed[b])} keys, past what {self.table_name} maps: {nbt} columns "
                 f"of block_size {bs} ({nbt * bs} keys)")
        table = self.block_table.cpu().to(torch.int64)
        bad = (torch.arange(nbt)[None, :] < cols[:, None]) & ((table < 0) | (table >= nb))
        where = bad.nonzero()
        if where.numel():
            b, c = (int(v) for v in where[0])
            fail(self.table_name, f"entry [{b}, {c}] = {int(table[b, c])} is needed for key {c * bs} of batch {b} "
                 f"({used_name} reads {int(needed[b])} keys) but is not in [0, num_blocks={nb})")

    def rows_index(self, b: torch.Tensor, x: torch.Tensor, mask: torch.Tensor, check: bool = False) -> torch.Tensor:
        """:meth:`flat_index` of :meth:`locate`'s addresses in one step (the same numbers, the same
        errors): for paged CPU caches one compiled call (``dsattn.native``), else those two methods.
        ``b`` is ``[R, 1]``, ``x`` and ``mask`` ``[R, W]``."""
        module = None
        if self.layout == PAGED and x.device.type == "cpu" and self.block_table.dtype == torch.int32:
            from .. import native
            module = native.load()
        if module is None:
            return self.flat_index(*self.locate(b, x, mask, check=check), mask)
        flat, bad = module.paged_rows(self.block_table, b.reshape(-1), x, mask, self.tensor.size(1),
                                      self.tensor.size(0))
        if bad and check:
            self._table_error(int(b.reshape(-1)[bad[0]]), int(x[bad[0], bad[1]]))
        return flat

    def span(self, b: int, k0: int, k1: int, check: bool = False) -> torch.Tensor:
        """Keys ``[k0, k1)`` of batch ``b`` as ``[k1 - k0, D]`` (a host-side batch index: callers on
        the CPU).  BSND / TND rows are a slice of the tensor (no copy); paged rows are gathered."""
        if self.decode is None and self.layout in ("BSND", "TND"):
            if self.layout == "BSND":
                return self.tensor[b, k0:k1, 0]
            start = int(self.cu[b])
            return self.tensor[start + k0:start + k1, 0]
        dev = self.tensor.device
        x = torch.arange(k0, k1, device=dev)[None, :]
        return self.gather(*self.locate(torch.full((1, 1), b, device=dev), x, x >= 0, check=check))[0]

    def gather(self, i0: torch.Tensor, i1: torch.Tensor) -> torch.Tensor:
        """Rows at physical addresses -> ``[..., D]`` in the KV dtype (decoded, for packed rows)."""
        if self.tensor.numel() == 0:      # no row at all, so every address is a masked placeholder
            rows = self.tensor.new_zeros((*i1.shape, self.tensor.size(-1)))
        else:
            rows = self.tensor[i1, 0] if self.layout == "TND" else self.tensor[i0, i1, 0]
        return rows if self.decode is None else self.decode(rows)

    def key_map(self) -> tuple[int, torch.Tensor, int, int]:
        """``(kind, map, page, num_blocks)``: how the compiled key tables (dsattn/native/paged.cpp) number
        key ``x`` of batch ``b`` in :meth:`flat_rows` -- row ``b * page + x`` (BSND, kind 0), ``map[b] + x``
        (TND, kind 1: the segment starts) or ``map[b, x // page] * page + x % page`` (paged, kind 2: the
        block table, whose entries must be in ``[0, num_blocks)``)."""
        t = self.tensor
        if self.layout == "BSND":
            return 0, t.new_empty((0,), dtype=torch.int64), max(t.size(1), 1), 0
        if self.layout == "TND":
            return 1, self.cu.contiguous(), 1, 0
        return 2, self.block_table.contiguous(), t.size(1), t.size(0)

    def flat_rows(self) -> torch.Tensor | None:
        """The tensor's key rows as one ``[rows, D]`` view (no copy), or None where rows are packed
        (decoded as they are read) or not laid out one after another."""
        if self.decode is not None or not self.tensor.is_contiguous():
            return None
        return self.tensor.view(-1, self.tensor.size(-1))

    def flat_index(self, i0: torch.Tensor, i1: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Row numbers of physical addresses in :meth:`flat_rows`, ``-1`` where ``mask`` is False."""
        idx = self._flat(i0, i1)
        return torch.where(mask, idx, torch.full((), -1, dtype=idx.dtype, device=idx.device))

    def _flat(self, i0: torch.Tensor, i1: torch.Tensor) -> torch.Tensor:
        return i1 if self.layout == "TND" else i0 * self.tensor.size(1) + i1

    def pages(self) -> tuple[torch.Tensor, int]:
        """``(starts [B, P] int64, page)``: key ``j`` of batch ``b`` is row ``starts[b, j // page] +
        j % page`` of :meth:`flat_rows` (BSND / TND: one page per batch; paged: the blocks)."""
        t = self.tensor
        if self.layout == "BSND":
            S = t.size(1)
            return (torch.arange(t.size(0), device=t.device, dtype=torch.int64) * S)[:, None], max(S, 1)
        if self.layout == "TND":
            return self.cu[:-1, None].contiguous(), max(t.size(0), 1)
        return (self.block_table.to(torch.int64) * t.size(1)).contiguous(), t.size(1)

    def scatter_add(self, grad: torch.Tensor, i0, i1, values: torch.Tensor) -> None:
        """``grad`` (shaped like the KV tensor, fp32) += values at (i0, i1), as one ``index_add_``
        over the flattened rows (faster on the CPU than an accumulating ``index_put_``)."""
        flat = grad.view(-1, grad.size(-1))
        idx = self._flat(i0, i1).reshape(-1)                      # (grad is shaped like the tensor)
        flat.index_add_(0, idx, values.reshape(-1, values.size(-1)))

    def row(self, b: int, x: int) -> torch.Tensor:
        """One key row (reference path): scalar addressing with the same checks."""
        row = self._row(b, x)
        return row if self.decode is None else self.decode(row)

    def _row(self, b: int, x: int) -> torch.Tensor:
        if self.layout == "BSND":
            return self.tensor[b, x, 0]
        if self.layout == "TND":
            return self.tensor[int(self.cu[b]) + x, 0]
        bs, nbt, nb = self.tensor.size(1), self.block_table.size(1), self.tensor.size(0)
        if x // bs >= nbt:
            fail(self.table_name, f"too short: batch {b} needs position {x} (block column {x // bs}) "
                 f"but the table has {nbt} columns")
        blk = int(self.block_table[b, x // bs])
        if blk < 0 or blk >= nb:
            fail(self.table_name, f"entry [{b}, {x // bs}] = {blk} is needed for position {x} "
                 f"but is not in [0, num_blocks={nb})")
        return self.tensor[blk, x % bs, 0]


def kv_source(name: str, kv: torch.Tensor, layout: str, B: int, *, cu: torch.Tensor | None,
              cu_name: str, seqused: torch.Tensor | None, used_name: str,
              block_table: torch.Tensor | None, table_name: str, content: bool,
              paged_default: torch.Tensor | None = None, cls: type = KVSource) -> KVSource:
    """Validate a single-head KV tensor in ``layout`` and resolve its per-batch length.

    ``paged_default`` is the length used for a paged tensor without ``seqused`` (e.g. the
    compressed branch's ``floor(S2o / r)``); without it, a paged tensor requires ``seqused``.
    """
    rank = 3 if layout == "TND" else 4
    if kv.dim() != rank:
        fail(name, f"expected a {rank}-D tensor for layout {layout}, got shape {tuple(kv.shape)}")
    if kv.size(-2) != 1:
        fail(name, f"KV head count must be 1, got {kv.size(-2)}")
    check_batch_vector(used_name, seqused, B)
    dev = kv.device
    cu64 = None
    if layout == "BSND":
        if cu is not None:
            fail(cu_name, "must be None for layout BSND")
        if block_table is not None:
            fail(table_name, "must be None unless the KV layout is PA_BBND")
        if kv.size(0) != B:
            fail(name, f"batch size {kv.size(0)} does not match the query batch size {B}")
        extent = torch.full((B,), kv.size(1), dtype=torch.int64, device=dev)
        capacity = kv.size(1)
    elif layout == "TND":
        if block_table is not None:
            fail(table_name, "must be None unless the KV layout is PA_BBND")
        Bk = _check_cu_seqlens(cu_name, cu, kv.size(0), content)
        if Bk != B:
            fail(cu_name, f"has {Bk + 1} entries but the batch size is {B} (expected {B + 1})")
        cu64 = cu.to(torch.int64)
        extent = cu64[1:] - cu64[:-1]
        capacity = kv.size(0)
    else:
        if cu is not None:
            fail(cu_name, "must be None for a paged KV layout")
        if block_table is None:
            fail(table_name, f"is required for the paged layout {PAGED}")
        check_int32(table_name, block_table)
        if kv.size(1) < 1:
            fail(name, f"block size (dim 1) must be >= 1 for the paged layout {PAGED}, got shape {tuple(kv.shape)}")
        if block_table.dim() != 2 or block_table.size(0) != B:
            fail(table_name, f"expected shape [B={B}, max_blocks], got {tuple(block_table.shape)}")
        if seqused is None and paged_default is None:
            fail(used_name, f"is required for the paged layout {PAGED}")
        extent = None
        capacity = block_table.size(1) * kv.size(1)
    if extent is not None:
        _check_used(used_name, seqused, extent, f"the rows available in {name}", content)
    if seqused is not None:
        lengths = seqused.to(torch.int64)
        if extent is None and content:
            for b, v in enumerate(host_ints(seqused)):
                if v < 0:
                    fail(used_name, f"value {v} at batch {b} is negative")
    elif extent is not None:
        lengths = extent
    else:
        lengths = paged_default
    # A paged length beyond the table is not clamped: the walk then reaches the missing column
    # and the dereference check reports the table as too short.
    return cls(name, kv, layout, lengths, width_bound(capacity, lengths, clamp=layout != PAGED), cu64,
                    block_table, table_name)
