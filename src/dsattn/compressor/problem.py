"""Validation and index bookkeeping of ``compressor`` / ``compressor_inference`` (30-compressor).

:func:`parse_compressor` checks every argument (§6) and resolves, as int64 tensors on the
inputs' device, where every new token lives in ``x``, which groups each batch emits, which
output row each group lands in (§1.3 packing), and where each position's state row lives
(§2.3).  The golden reference and the vectorised kernel both start from this object.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.checks import (check_batch_vector, check_choice, check_dtype, check_float, check_int32,
                             content_checks_enabled, fail, host_ints, stat_dtype)
from ..common.layout import _check_cu_seqlens

CACHE_BY_POSITION = 1   # paged by position, block id 0 = not backed
CACHE_EXPLICIT = 2      # explicit flat rows, -1 = not backed


@dataclass
class CompressorProblem:
    x: torch.Tensor
    x_rows: torch.Tensor        # [Rx, H] view of x
    wkv: torch.Tensor
    wgate: torch.Tensor
    ape: torch.Tensor
    state: torch.Tensor         # [num_blocks, block_size, 2·coff·D]
    table: torch.Tensor | None
    cache_mode: int
    coff: int
    r: int
    D: int
    B: int
    packed: bool                # 2-D x (TND-like packing of the output)
    out_rows_per_batch: int     # 3-D: ceil(S / r)
    N_out: int                  # total output rows
    sp: torch.Tensor            # [B] start_pos
    su: torch.Tensor            # [B] new tokens
    base: torch.Tensor          # [B] x row of batch b's first new token
    g0: torch.Tensor            # [B] first emitted group
    n: torch.Tensor             # [B] emitted groups
    out_start: torch.Tensor     # [B] first output row of batch b
    content: bool
    seg_end: torch.Tensor | None = None   # 2-D x: cu_seqlens[1:] (int64)

    @property
    def compute_dtype(self) -> torch.dtype:
        return stat_dtype(self.x)

    @property
    def out_shape(self):
        if self.packed:
            return (self.N_out, self.D)
        return (self.B, self.out_rows_per_batch, self.D)

    # ---- per-row views (vectorised kernel) ---------------------------------------------
    def x_row_info(self):
        """For every row of ``x_rows``: (batch, absolute position, is-a-new-token)."""
        dev = self.x.device
        Rx = self.x_rows.size(0)
        rows = torch.arange(Rx, device=dev)
        if self.packed:
            b = torch.searchsorted(self.seg_end, rows, right=True)
            inside = b < self.B
            b = b.clamp(max=self.B - 1)
        else:
            S = self.x.size(1)
            b, inside = rows // S, torch.ones(Rx, dtype=torch.bool, device=dev)
        t = rows - self.base[b]
        used = inside & (t >= 0) & (t < self.su[b])
        return b, self.sp[b] + t, used

    def out_row_info(self):
        """For every output row: (batch, group k, row holds an entry)."""
        dev = self.x.device
        o = torch.arange(self.N_out, device=dev)
        if self.packed:
            ends = self.out_start + self.n
            b = torch.searchsorted(ends, o, right=True)
            valid = b < self.B
            b = b.clamp(max=self.B - 1)
        else:
            b = o // max(self.out_rows_per_batch, 1)
            valid = torch.ones_like(o, dtype=torch.bool)
        j = o - self.out_start[b]
        valid = valid & (j < self.n[b])
        return b, self.g0[b] + j, valid

    # ---- state addressing (§2.3) -------------------------------------------------------
    def state_location(self, b: torch.Tensor, p: torch.Tensor, need: torch.Tensor, *, reading: bool):
        """Flat state row of position ``p`` of batch ``b`` and whether it is backed.

        Entries where ``need`` is False get a harmless address.  Content checks (when on) raise
        ValueError naming ``state_block_table`` for a table too short, an entry out of range, or
        (``reading``) a needed read from a location that is not backed."""
        rows_total = self.state.size(0) * self.state.size(1)
        if self.table is None:
            if reading and self.content and bool(need.any()):
                bad = need.nonzero()[0].tolist()
                fail("state_block_table", f"is None but batch {int(b[tuple(bad)])} needs the state row of "
                     f"position {int(p[tuple(bad)])} (written by an earlier call)")
            z = torch.zeros_like(p)
            return z, torch.zeros_like(need)
        bb = b.expand_as(p)
        width = self.table.size(1)
        if self.cache_mode == CACHE_BY_POSITION:
            bs = self.state.size(1)
            col = torch.where(need, p // bs, torch.zeros_like(p))
            entry = self.table[bb, col.clamp(max=width - 1)].to(torch.int64)
            in_table = col < width
            backed = need & (entry != 0)
            flat = entry * bs + p % bs
            nb = self.state.size(0)
            bad_entry = need & in_table & ((entry < 0) | (entry >= nb))
            what = f"not in [0, num_blocks={nb})"
        else:
            col = torch.where(need, p - self.sp[bb] + self.coff * self.r, torch.zeros_like(p))
            in_table = col < width
            entry = self.table[bb, col.clamp(max=width - 1)].to(torch.int64)
            backed = need & (entry != -1)
            flat = entry
            bad_entry = need & in_table & ((entry < -1) | (entry >= rows_total))
            what = f"not -1 or in [0, {rows_total}) (rows of state_cache)"
        if self.content:
            self._check_table(bb, p, col, entry, need & ~in_table, bad_entry, need & in_table & ~backed & reading,
                              what)
        backed = backed & in_table & ~bad_entry
        return torch.where(backed, flat, torch.zeros_like(flat)), backed

    def _check_table(self, b, p, col, entry, short, bad_entry, unbacked_read, what):
        for mask, kind in ((short, "short"), (bad_entry, "entry"), (unbacked_read, "read")):
            if not bool(mask.any()):
                continue
            k = tuple(mask.nonzero()[0].tolist())
            bb, pp, cc, ee = int(b[k]), int(p[k]), int(col[k]), int(entry[k])
            if kind == "short":
                fail("state_block_table", f"too short: batch {bb} needs column {cc} (position {pp}) but the "
                     f"table has {self.table.size(1)} columns")
            if kind == "entry":
                fail("state_block_table", f"entry [{bb}, {cc}] = {ee} (position {pp}) is {what}")
            fail("state_block_table", f"entry [{bb}, {cc}] = {ee} marks position {pp} of batch {bb} as not "
                 f"backed, but this call must read it (the head of a group started by an earlier call)")


def parse_compressor(x, wkv, wgate, state_cache, ape, cmp_ratio=4, *, state_block_table=None,
                     cu_seqlens=None, seqused=None, start_pos=None, coff=1, cache_mode=1,
                     content=None) -> CompressorProblem:
    """Check the arguments of 30 §6 and build the problem."""
    check_float("x", x, allow_f64=True)
    if x.dim() not in (2, 3):
        fail("x", f"expected a 3-D [B, S, H] or 2-D [T, H] tensor, got shape {tuple(x.shape)}")
    check_choice("coff", coff, (1, 2))
    if cmp_ratio < 1:
        fail("cmp_ratio", f"value {cmp_ratio} must be >= 1")
    check_choice("cache_mode", cache_mode, (CACHE_BY_POSITION, CACHE_EXPLICIT))
    H = x.size(-1)
    if x.dtype == torch.float64 and isinstance(wkv, torch.Tensor) and wkv.dtype != torch.float64:
        # float64 is dsattn's extension for gradient checks, whole-call: x is the odd one out
        fail("x", f"dtype torch.float64 needs float64 wkv, wgate, state_cache and ape too (dsattn's float64 "
             f"extension for gradient checks), got wkv {wkv.dtype}; with {wkv.dtype} weights pass x as {wkv.dtype}",
             TypeError)
    for name, w in (("wkv", wkv), ("wgate", wgate)):
        check_dtype(name, w, x.dtype, "the dtype of x")
        if w.dim() != 2 or w.size(1) != H or w.size(0) % coff or w.size(0) == 0:
            fail(name, f"expected shape [coff·D, H={H}] with coff={coff} dividing the first dim, got {tuple(w.shape)}")
    if wgate.shape != wkv.shape:
        fail("wgate", f"shape {tuple(wgate.shape)} differs from wkv {tuple(wkv.shape)}")
    D = wkv.size(0) // coff
    fdt = stat_dtype(x)
    why = "float64 with float64 x" if fdt == torch.float64 else ""
    check_dtype("state_cache", state_cache, fdt, why)
    check_dtype("ape", ape, fdt, why)
    if tuple(ape.shape) != (cmp_ratio, coff * D):
        fail("ape", f"expected shape [cmp_ratio={cmp_ratio}, coff·D={coff * D}], got {tuple(ape.shape)}")
    if state_cache.dim() != 3 or state_cache.size(-1) != 2 * coff * D:
        fail("state_cache", f"expected shape [num_blocks, block_size, 2·coff·D={2 * coff * D}], "
             f"got {tuple(state_cache.shape)}")
    if content is None:
        content = content_checks_enabled(x, state_cache, state_block_table, cu_seqlens, seqused, start_pos)
    dev = x.device
    packed = x.dim() == 2
    if packed:
        B = _check_cu_seqlens("cu_seqlens", cu_seqlens, x.size(0), content)
        cu = cu_seqlens.to(torch.int64)
        base, avail = cu[:-1], cu[1:] - cu[:-1]
        T = x.size(0)
        N_out = min(T, T // cmp_ratio + B)
        per_batch = 0
        seg_end = cu[1:]
    else:
        if cu_seqlens is not None:
            fail("cu_seqlens", "must be None for 3-D x")
        B, S = x.size(0), x.size(1)
        base = torch.arange(B, device=dev) * S
        avail = torch.full((B,), S, dtype=torch.int64, device=dev)
        per_batch = -(-S // cmp_ratio)
        N_out = B * per_batch
        seg_end = None
    check_batch_vector("seqused", seqused, B)
    check_batch_vector("start_pos", start_pos, B)
    check_int32("state_block_table", state_block_table)
    if state_block_table is not None and (state_block_table.dim() != 2 or state_block_table.size(0) != B):
        fail("state_block_table", f"expected shape [B={B}, columns], got {tuple(state_block_table.shape)}")
    su = avail.clone() if seqused is None else seqused.to(torch.int64)
    sp = torch.zeros(B, dtype=torch.int64, device=dev) if start_pos is None else start_pos.to(torch.int64)
    if content:
        for b, (s, a) in enumerate(zip(host_ints(su), host_ints(avail))):
            if s < 0 or s > a:
                fail("seqused", f"value {s} at batch {b} is not in [0, {a}] (the rows of x for that batch)")
        for b, s in enumerate(host_ints(sp)):
            if s < 0:
                fail("start_pos", f"value {s} at batch {b} is negative")
        if state_block_table is not None and cache_mode == CACHE_EXPLICIT:
            need = coff * cmp_ratio + (max(host_ints(su)) if B else 0)
            if state_block_table.size(1) < need:
                fail("state_block_table", f"has {state_block_table.size(1)} columns; cache_mode 2 needs at least "
                     f"coff·r + max(seqused) = {need}")
    g0 = sp // cmp_ratio
    n = (sp + su) // cmp_ratio - g0
    out_start = torch.cumsum(n, 0) - n if packed else torch.arange(B, device=dev) * per_batch
    return CompressorProblem(x, x.reshape(-1, H), wkv, wgate, ape, state_cache, state_block_table, cache_mode,
                             coff, cmp_ratio, D, B, packed, per_batch, N_out, sp, su, base, g0, n, out_start,
                             content, seg_end)
