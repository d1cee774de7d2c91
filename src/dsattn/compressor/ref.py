"""Golden references of ``compressor`` and ``compressor_inference`` (30-compressor §2-§3).

A literal transcription of the spec's per-batch pseudocode: one projection per batch, one
softmax pooling per emitted group, scalar state addressing.  Written with differentiable
torch ops, so autograd through :func:`compressor` is the reference for the backward (§4),
with state reads as constants.  ``compute_dtype`` (default fp32; float64 allowed) is the
arithmetic dtype.
"""
from __future__ import annotations

import torch

from ..common.checks import fail
from .problem import CACHE_BY_POSITION, parse_compressor, CompressorProblem
from .postprocess import check_inference_args


def _location(pb: CompressorProblem, b: int, p: int, sp: int):
    """Flat state row of position p of batch b, or None when not backed (§2.3)."""
    if pb.table is None:
        return None
    if pb.cache_mode == CACHE_BY_POSITION:
        bs = pb.state.size(1)
        if p // bs >= pb.table.size(1):
            fail("state_block_table", f"too short: batch {b} needs column {p // bs} (position {p})")
        blk = int(pb.table[b, p // bs])
        if blk < 0 or blk >= pb.state.size(0):
            fail("state_block_table", f"entry [{b}, {p // bs}] = {blk} (position {p}) is out of range")
        return None if blk == 0 else blk * bs + p % bs
    col = p - sp + pb.coff * pb.r
    row = int(pb.table[b, col])
    if row < -1 or row >= pb.state.size(0) * pb.state.size(1):
        fail("state_block_table", f"entry [{b}, {col}] = {row} (position {p}) is out of range")
    return None if row == -1 else row


def _compress(pb: CompressorProblem, compute_dtype):
    """Return ([(b, k, C_k)] in output order, state writes [(flat_row, values)])."""
    cd = compute_dtype or pb.compute_dtype
    r, coff, D = pb.r, pb.coff, pb.D
    flat_state = pb.state.view(-1, pb.state.size(-1))
    wkv, wgate, ape = pb.wkv.to(cd), pb.wgate.to(cd), pb.ape.to(cd)
    entries, writes = [], []
    for b in range(pb.B):
        sp, su, base = int(pb.sp[b]), int(pb.su[b]), int(pb.base[b])
        X = pb.x_rows[base:base + su].to(cd)
        kv_new = X @ wkv.T
        sc_new = X @ wgate.T + ape[(sp + torch.arange(su, device=X.device)) % r]
        for t in range(su):
            loc = _location(pb, b, sp + t, sp)
            if loc is not None:
                writes.append((loc, torch.cat([kv_new[t], sc_new[t]]).detach()))

        def row(p):
            if p >= sp:
                return kv_new[p - sp], sc_new[p - sp]
            loc = _location(pb, b, p, sp)
            if loc is None:
                fail("state_block_table", f"position {p} of batch {b} must be read from the state cache "
                     f"but its location is not backed")
            st = flat_state[loc].to(cd)
            return st[:coff * D], st[coff * D:]

        for k in range(sp // r, (sp + su) // r):
            kv, sc = [], []
            if coff == 2:
                for j in range(r):
                    if k == 0:
                        kv.append(X.new_zeros(D))
                        sc.append(X.new_full((D,), float("-inf")))
                    else:
                        a, s = row((k - 1) * r + j)
                        kv.append(a[:D])
                        sc.append(s[:D])
            for j in range(r):
                a, s = row(k * r + j)
                kv.append(a[(coff - 1) * D:coff * D])
                sc.append(s[(coff - 1) * D:coff * D])
            W = torch.softmax(torch.stack(sc), dim=0)
            entries.append((b, k, (W * torch.stack(kv)).sum(0)))
    return entries, writes


def _emit(pb: CompressorProblem, entries, post=None):
    """Pack entries into the output (§1.3): row k - g0 of batch b (3-D) or packed (2-D)."""
    rows = []
    out_row = 0
    for b, k, C in entries:
        o = out_row if pb.packed else b * pb.out_rows_per_batch + k - int(pb.g0[b])
        out_row += 1
        rows.append((o, C if post is None else post(o, C)))
    out = pb.x.new_zeros(pb.out_shape).reshape(-1, pb.D)
    if rows:
        idx = torch.tensor([o for o, _ in rows], device=out.device)
        out = out.index_put((idx,), torch.stack([v.to(pb.x.dtype) for _, v in rows]))
    return out.reshape(pb.out_shape)


def _apply_writes(pb: CompressorProblem, writes):
    flat_state = pb.state.view(-1, pb.state.size(-1))
    for loc, vals in writes:  # after all reads: reads see the pre-call state
        flat_state[loc] = vals.to(flat_state.dtype)


def compressor(x, wkv, wgate, state_cache, ape, cmp_ratio=4, *, state_block_table=None, cu_seqlens=None,
               seqused=None, start_pos=None, coff=1, cache_mode=1, compute_dtype=None):
    """Golden ``compressor``: returns ``cmp_kv`` and writes ``state_cache`` in place."""
    pb = parse_compressor(x, wkv, wgate, state_cache, ape, cmp_ratio, state_block_table=state_block_table,
                          cu_seqlens=cu_seqlens, seqused=seqused, start_pos=start_pos, coff=coff,
                          cache_mode=cache_mode, content=True)
    entries, writes = _compress(pb, compute_dtype)
    out = _emit(pb, entries)
    _apply_writes(pb, writes)
    return out


def rotary_literal(u, cs, sn, mode):
    """The rotary formula of 30 §3, element by element."""
    R = u.size(0)
    out = [None] * R
    h = R // 2
    for i in range(h):
        a, c = (2 * i, 2 * i + 1) if mode == 2 else (i, i + h)
        out[a] = u[a] * cs[a] - u[c] * sn[a]
        out[c] = u[c] * cs[c] + u[a] * sn[c]
    return torch.stack(out) if R else u


def compressor_inference(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, rope_head_dim,
                         cmp_ratio, *, state_block_table=None, cu_seqlens=None, seqused=None, start_pos=None,
                         coff=1, norm_eps=1e-6, rotary_mode=1, cache_mode=1, compute_dtype=None):
    """Golden ``compressor_inference``: compression, RMSNorm, RoPE on the last ``rope_head_dim`` dims."""
    pb = parse_compressor(x, wkv, wgate, state_cache, ape, cmp_ratio, state_block_table=state_block_table,
                          cu_seqlens=cu_seqlens, seqused=seqused, start_pos=start_pos, coff=coff,
                          cache_mode=cache_mode, content=True)
    sin, cos = check_inference_args(pb, norm_weight, rope_sin, rope_cos, rope_head_dim, norm_eps, rotary_mode)
    cd = compute_dtype or pb.compute_dtype
    xdt, D, R = x.dtype, pb.D, rope_head_dim

    def post(o, C):
        c = C.to(xdt).to(cd)
        y = c * torch.rsqrt((c * c).mean() + norm_eps) * norm_weight.to(cd)
        y = y.to(xdt).to(cd)
        if R:
            rot = rotary_literal(y[D - R:], cos[o].to(cd), sin[o].to(cd), rotary_mode)
            y = torch.cat([y[:D - R], rot.to(xdt).to(cd)])
        return y

    entries, writes = _compress(pb, compute_dtype)
    out = _emit(pb, entries, post)
    _apply_writes(pb, writes)
    return out
