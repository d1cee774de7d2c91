"""Vectorised compressor (30-compressor §2, §4): one GEMM pair for every new token of every
batch, then the gated softmax pooling of all emitted groups at once, in blocks of output
rows so the gathered slots stay within a fixed memory budget.

The slots of an output row are gathered by index from the new tokens' projections or, for
positions before ``start_pos``, from the state cache; the state rows of the new tokens are
written after every read, so reads see the pre-call state (§2.3).  Nothing reads tensor
data on the host except the content checks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import native
from ..common.paged import write_rows
from .problem import CompressorProblem

BUDGET_BYTES = 32 << 20


@dataclass
class Saved:
    """What the backward needs per emitted slot (§4)."""
    W: torch.Tensor        # [N_out, coff·r, D] softmax weights
    kv: torch.Tensor       # [N_out, coff·r, D] slot values
    x_row: torch.Tensor    # [N_out, coff·r] row of x holding the slot's token
    half: torch.Tensor     # [coff·r] which D-wide half of the projection the slot uses
    new: torch.Tensor      # [N_out, coff·r] slot is a new token of this call
    valid: torch.Tensor    # [N_out] output row holds an entry


def _rows_matmul(a: torch.Tensor, *bs: torch.Tensor):
    """``[a @ b.T for b in bs]`` in fp32 through the compiled kernel, whose rows do not depend on the other
    rows of the call nor on the thread count (a request's projections are the same bits alone as in any
    batch); None where it does not run (no compiled layer, not a CPU fp32 computation)."""
    if a.device.type != "cpu" or a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    module = native.kernels()
    if module is None:
        return None
    return module.rows_matmul(a.contiguous(), [b.contiguous() for b in bs])


def project(pb: CompressorProblem):
    """kv_new, sc_new ``[Rx, coff·D]`` in the compute dtype for every row of x (§2.1)."""
    cd = pb.compute_dtype
    _, pos, _ = pb.x_row_info()
    if cd == torch.float32:
        both = _rows_matmul(pb.x_rows, pb.wkv, pb.wgate)           # x packed once for both weights
        if both is not None:
            return both[0], both[1] + pb.ape.to(cd)[pos % pb.r]
    X = pb.x_rows.to(cd)
    kv = X @ pb.wkv.to(cd).T
    sc = torch.addmm(pb.ape.to(cd)[pos % pb.r], X, pb.wgate.to(cd).T)
    return kv, sc


def _slot_half(pb: CompressorProblem) -> torch.Tensor:
    s = torch.arange(pb.coff * pb.r, device=pb.x.device)
    return (s >= pb.r).long() if pb.coff == 2 else torch.zeros_like(s)


def _slot_rows(pb: CompressorProblem, x_row, loc):
    """``(at_new, at_state)`` ``[n, coff·r]``: each slot's kv row among the projections viewed
    ``[-1, D]`` (a projection row holds coff D-wide halves) and among the state rows viewed
    ``[-1, D]`` (a state row holds [kv | score], coff halves each: the score is coff rows on)."""
    half = _slot_half(pb)
    return x_row * pb.coff + half, loc * (2 * pb.coff) + half


def _gather_slots(pb: CompressorProblem, kv_new, sc_new, x_row, loc, hist, live, valid):
    """Every slot's (kv, score) rows ``[n, coff·r, D]``: a new token's projection, a state row
    written by an earlier call (``hist``), or for a dead slot kv 0 and score -inf (0 in rows
    without an entry, which are zeroed later).

    Each source is gathered once with ``index_select`` into one buffer (new rows, state rows,
    then a 0 row and a -inf row), and a second ``index_select`` picks each slot's row.  That is
    several times faster on a CPU than advanced indexing plus ``torch.where`` over the
    ``[n, coff·r, D]`` grids, and it never multiplies an unused state row (which may hold
    anything, NaN included) by a zero weight."""
    coff, D = pb.coff, pb.D
    n, S = x_row.shape
    nS = n * S
    dt = kv_new.dtype
    i = torch.arange(nS, device=x_row.device).view(n, S)
    at_new, at_state = (t.flatten() for t in _slot_rows(pb, x_row, loc))
    has_state = pb.state.numel() > 0
    pick = torch.where(live, i, 2 * nS)
    if has_state:
        pick = torch.where(hist, nS + i, pick)
    out = []
    for c, (src, dead) in enumerate(((kv_new, 0.0), (sc_new, float("-inf")))):
        buf = torch.empty(2 * nS + 2, D, dtype=dt, device=x_row.device)
        torch.index_select(src.reshape(-1, D), 0, at_new, out=buf[:nS])
        if has_state:
            buf[nS:2 * nS] = pb.state.reshape(-1, D).index_select(0, at_state + c * coff)
        buf[2 * nS] = dead
        buf[2 * nS + 1] = 0.0
        at = pick if c == 0 else torch.where(live | valid[:, None], pick, 2 * nS + 1)
        out.append(buf.index_select(0, at.flatten()).view(n, S, D))
    return out


# Softmax and sums over the slots (dim 1 of [n, S, D]) run over a contiguous last dim: ATen's kernels
# for an inner dim split the work by the tensor's size (some elements then take a scalar tail with
# another exp), so an output row's bits would depend on how many rows share the call.
def _softmax_over_slots(sc: torch.Tensor) -> torch.Tensor:
    return torch.softmax(sc.transpose(1, 2).contiguous(), dim=-1).transpose(1, 2)


def _sum_over_slots(t: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    out = t.transpose(1, 2).contiguous().sum(-1)
    return out[:, None] if keepdim else out


def pool(pb: CompressorProblem, kv_new, sc_new, o0: int, o1: int, save: bool):
    """Entries of output rows ``[o0, o1)``: returns (C ``[n, D]``, valid ``[n]``, slot data if ``save``)."""
    coff, r = pb.coff, pb.r
    ob, k, valid = (t[o0:o1] for t in pb.out_row_info())
    pos = (k[:, None] - (coff - 1)) * r + torch.arange(coff * r, device=k.device)[None]
    sp = pb.sp[ob][:, None]
    live = valid[:, None] & (pos >= 0)
    new = live & (pos >= sp)
    hist = live & (pos < sp)
    x_row = torch.where(new, pb.base[ob][:, None] + pos - sp, torch.zeros_like(pos))
    loc, _ = pb.state_location(ob[:, None], pos, hist, reading=True)
    module = None if save or kv_new.device.type != "cpu" else native.load()
    if module is not None:        # the pooling in one compiled call (dsattn/native/compressor.cpp)
        # slot kinds as _gather_slots picks them: 0 dead, 1 new token, 2 state row (when there is a state)
        kind = live.long() + hist.long() if pb.state.numel() > 0 else live.long()
        at_new, at_state = _slot_rows(pb, x_row, loc)
        C = module.compressor_pool(kv_new, sc_new, pb.state.reshape(-1, pb.D), kind, at_new, at_state, valid, coff)
        return C, valid, None
    kv, sc = _gather_slots(pb, kv_new, sc_new, x_row, loc, hist, live, valid)
    W = _softmax_over_slots(sc)
    C = _sum_over_slots(W * kv)
    C = torch.where(valid[:, None], C, torch.zeros((), dtype=C.dtype, device=C.device))
    return C, valid, ((W, kv, x_row, new) if save else None)


def write_state(pb: CompressorProblem, kv_new, sc_new) -> None:
    """Write every backed new token's ``[kv | score]`` row (§2.3), without reading device data."""
    if pb.table is None:
        return
    b, pos, used = pb.x_row_info()
    loc, backed = pb.state_location(b, pos, used, reading=False)
    write_rows(pb.state.view(-1, pb.state.size(-1)), loc, backed, torch.cat([kv_new, sc_new], dim=1))


def _block_rows(pb: CompressorProblem) -> int:
    per_row = pb.coff * pb.r * pb.D * 4 * 8     # kv, sc, W, state gather, temporaries (fp32)
    return max(1, BUDGET_BYTES // max(per_row, 1))


def compress(pb: CompressorProblem, save: bool = False):
    """All emitted entries: (C ``[N_out, D]`` compute dtype, valid ``[N_out]``, Saved or None).
    Writes the state cache."""
    kv_new, sc_new = project(pb)
    step = max(1, pb.N_out) if save else _block_rows(pb)
    parts = [pool(pb, kv_new, sc_new, o0, min(o0 + step, pb.N_out), save) for o0 in range(0, pb.N_out, step)]
    write_state(pb, kv_new, sc_new)
    if not parts:
        C = kv_new.new_zeros((0, pb.D))
        valid = torch.zeros(0, dtype=torch.bool, device=C.device)
        saved = None
        if save:
            z = kv_new.new_zeros((0, pb.coff * pb.r, pb.D))
            zi = torch.zeros((0, pb.coff * pb.r), dtype=torch.long, device=C.device)
            saved = Saved(z, z, zi, _slot_half(pb), zi.bool(), valid)
        return C, valid, saved
    C = torch.cat([p[0] for p in parts])
    valid = torch.cat([p[1] for p in parts])
    saved = None
    if save:
        W, kv, x_row, new = parts[0][2]
        saved = Saved(W, kv, x_row, _slot_half(pb), new, valid)
    return C, valid, saved


def forward(pb: CompressorProblem) -> torch.Tensor:
    C, _, _ = compress(pb)
    return C.to(pb.x.dtype).reshape(pb.out_shape)


def backward(pb: CompressorProblem, saved: Saved, grad: torch.Tensor):
    """§4: gradients for x, wkv, wgate, ape (state reads are constants)."""
    cd = pb.compute_dtype
    coff, D, r = pb.coff, pb.D, pb.r
    Rx = pb.x_rows.size(0)
    dC = grad.reshape(-1, D).to(cd)
    dC = torch.where(saved.valid[:, None], dC, torch.zeros((), dtype=cd, device=dC.device))
    W = saved.W
    dKV = W * dC[:, None]
    dW = saved.kv * dC[:, None]
    dZ = W * (dW - _sum_over_slots(W * dW, keepdim=True))
    zero = torch.zeros((), dtype=cd, device=dC.device)
    keep = saved.new[..., None]
    idx = (saved.x_row.reshape(-1), saved.half.expand_as(saved.x_row).reshape(-1))
    dkv_new = torch.zeros(Rx, coff, D, dtype=cd, device=dC.device)
    dsc_new = torch.zeros(Rx, coff, D, dtype=cd, device=dC.device)
    dkv_new.index_put_(idx, torch.where(keep, dKV, zero).reshape(-1, D), accumulate=True)
    dsc_new.index_put_(idx, torch.where(keep, dZ, zero).reshape(-1, D), accumulate=True)
    dkv_new, dsc_new = dkv_new.view(Rx, coff * D), dsc_new.view(Rx, coff * D)
    _, pos, used = pb.x_row_info()
    dape = torch.zeros(r, coff * D, dtype=cd, device=dC.device).index_add_(0, pos % r, dsc_new)
    X = torch.where(used[:, None], pb.x_rows.to(cd), zero)    # padding rows may hold anything
    dx_kv = _rows_matmul(dkv_new, pb.wkv.to(cd).T) if cd == torch.float32 else None
    if dx_kv is not None:
        dx = dx_kv[0] + _rows_matmul(dsc_new, pb.wgate.to(cd).T)[0]
    else:
        dx = dkv_new @ pb.wkv.to(cd) + dsc_new @ pb.wgate.to(cd)
    dx = dx.to(pb.x.dtype).reshape(pb.x.shape)
    dwkv = (dkv_new.T @ X).to(pb.wkv.dtype)
    dwgate = (dsc_new.T @ X).to(pb.wgate.dtype)
    return dx, dwkv, dwgate, dape.to(pb.ape.dtype)
