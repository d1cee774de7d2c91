"""Vectorised PyTorch kernels of ``sparse_flash_mla`` and its gradient, for any torch device.

Query rows are processed in blocks (:meth:`MlaProblem.rows_per_block`), so memory stays
bounded however long the sequence is: a block gathers its rows' keys ``[rows, W, D]``
(window keys, then compressed keys) into a zero-padded buffer and runs the attention of
:func:`dsattn.common.softmax.attend` on it.  Shapes depend only on tensor extents and
attributes, never on tensor values, so the kernels do not read device data on the host
(content checks aside, which are skipped during CUDA graph capture).
"""
from __future__ import annotations

import torch

from ..common.checks import stat_dtype
from ..common.memory import empty_output
from ..common.softmax import attend, attention_dtype, round_q, uses_flash
from ..quant.tokens import PackedTokens
from .problem import MlaProblem, grad_results, l1_outputs, lse_from_rows, lse_to_rows


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _zero_invalid(x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Rows that are not valid must not influence anything, whatever they hold (NaN too)."""
    return torch.where(ok.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), dtype=x.dtype, device=x.device))


BANDED_MIN_ROWS = 8      # batches with at least this many query rows take the banded path
BANDED_BLOCK = 64        # query rows per banded block


def _use_banded(P: MlaProblem) -> bool:
    """The banded path reads the batch extents on the host: free on the CPU, a sync elsewhere.
    It runs only where host reads are allowed at all (content checks on: not during graph
    capture, not on fake tensors, not after ``set_content_checks(False)``)."""
    return (P.q.device.type == "cpu" and P.content and P.q.dtype != torch.float64
            and not uses_flash(P.q.dtype, P.q.device) and P.rows.max_extent >= BANDED_MIN_ROWS)


def _forward_banded(P: MlaProblem, out, lse, cdt):
    """Batches with many query rows: banded blocks; the rest: the per-row gather path."""
    from .banded import batch_row_ranges, block_forward
    rest = []
    for b, start, extent in batch_row_ranges(P):
        if extent < BANDED_MIN_ROWS:
            rest.append((start, start + extent))
            continue
        for t0 in range(start, start + extent, BANDED_BLOCK):
            t1 = min(start + extent, t0 + BANDED_BLOCK)
            o, l = block_forward(P, t0, t1, b, cdt)
            out[t0:t1] = o.to(out.dtype)
            lse[t0:t1] = l.to(lse.dtype)
    return rest


NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def native_sources(P: MlaProblem):
    """The compiled forward and each source as it reads it in place -- its key rows as one flat view,
    or its packed rows as :class:`PackedTokens` (decoded as the kernel gathers them), or None (rows
    gathered and decoded here first) --, where it applies: CPU tensors of a dtype it takes, the
    default rounding (not the flash opt-in), the extension built.  Else None."""
    q = P.q
    if q.device.type != "cpu" or q.dtype not in NATIVE_DTYPES or uses_flash(q.dtype, q.device):
        return None
    from .. import native
    module = native.kernels()
    return None if module is None else (module, [_in_place(src, q.dtype) for src in (P.ori, P.cmp) if src is not None])


def _in_place(src, q_dtype):
    if src.decode is None:
        return src.flat_rows()
    if src.packed is not None:
        return PackedTokens.from_rows(src.tensor, src.packed.rope_head_dim, src.packed.tile_size, q_dtype)
    return None


def _native_operands(P: MlaProblem, src, flat, x, addr, mask, k):
    """(rows, index) for the compiled kernel: the source's flat rows and flat row numbers (from the
    positions, with the block-table checks, when ``k`` carries no addresses); or, for packed /
    strided sources, the block's rows gathered (and decoded) here, numbered in order."""
    if flat is not None:
        rows = flat.data if isinstance(flat, PackedTokens) else flat
        if addr is None:
            return rows, src.rows_index(k.batch, x, mask, check=P.content)
        return rows, src.flat_index(*addr, mask).contiguous()
    rows = src.gather(*addr)                                            # [r, W, D], decoded
    r, w = mask.shape
    index = torch.arange(r * w, device=mask.device).view(r, w)
    return rows.reshape(r * w, rows.size(-1)).contiguous(), torch.where(mask, index, torch.full((), -1, device=mask.device))


def native_keys(P: MlaProblem, flat, t0: int, t1: int):
    """:meth:`MlaProblem.keys` of rows ``[t0, t1)`` for the compiled kernels: the physical addresses
    only where a source's rows must be gathered here (packed rows), the rest as flat row numbers."""
    return P.keys(t0, t1, addresses=any(f is None for f in flat))


def _native_block_rows(P: MlaProblem, R: int) -> int:
    """Query rows per call of the compiled kernels: their int64 index tables (plus the key
    addresses built for them, about 24 bytes per key slot) stay within 32 MiB."""
    return max(1, min(R, (32 << 20) // (max(1, P.ori_width + P.cmp_width) * 24)))


def _forward_native(P: MlaProblem, module, flat, out, lse) -> None:
    """Rows in blocks: the key addresses of a block (flat row numbers, -1 = no key) go to the
    compiled kernel, which gathers, attends and writes each row (dsattn/native/attention.cpp)."""
    qf = P.rows.flat(P.q)
    R = qf.size(0)
    step = _native_block_rows(P, R)
    sinks = None if P.sinks is None else P.sinks.float()
    formats = _formats(flat)
    for t0 in range(0, R, step):
        t1 = min(R, t0 + step)
        module.sparse_attention_forward(qf[t0:t1].contiguous(), *_native_tables(P, module, flat, t0, t1), sinks, P.scale,
                                        out=out[t0:t1], lse=lse[t0:t1], formats=formats)


def _formats(flat) -> list:
    """The compiled kernels' ``formats`` argument: each packed source's fields, [] when none is packed."""
    formats = [f.fields() if isinstance(f, PackedTokens) else [] for f in flat]
    return formats if any(formats) else []


def _native_tables(P: MlaProblem, module, flat, t0: int, t1: int) -> tuple[list, list]:
    """(key row sources, index tables) of rows ``[t0, t1)``: where every source is read in place, the
    tables come from one compiled call (:meth:`MlaProblem.key_tables`), else from :meth:`MlaProblem.keys`."""
    if any(f is None for f in flat):
        return _native_keys(P, flat, native_keys(P, flat, t0, t1))
    return [f.data if isinstance(f, PackedTokens) else f for f in flat], P.key_tables(module, t0, t1)


def native_rows(P: MlaProblem, module, flat, qf, k, t0: int, t1: int, sinks, out=None, lse=None):
    """``(out [r, H, D] query dtype, lse [r, H] fp32)`` of flattened rows ``[t0, t1)`` over their keys
    ``k`` (:meth:`MlaProblem.keys`) through the compiled kernel; ``sinks`` fp32 or None.  Written
    into ``out`` / ``lse`` when given (contiguous: rows of the op's outputs)."""
    return module.sparse_attention_forward(qf[t0:t1].contiguous(), *_native_keys(P, flat, k), sinks, P.scale,
                                           out=out, lse=lse, formats=_formats(flat))


def _native_keys(P: MlaProblem, flat, k) -> tuple[list, list]:
    """(key row sources, index tables) of a block's keys ``k``: ori first, then cmp."""
    parts = [_native_operands(P, P.ori, flat[0], k.ori_x, k.ori_addr, k.ori_mask, k)]
    if P.cmp is not None:
        parts.append(_native_operands(P, P.cmp, flat[1], k.cmp_x, k.cmp_addr, k.cmp_mask, k))
    return [x for x, _ in parts], [i for _, i in parts]


def forward_native(P: MlaProblem, native, return_softmax_lse: bool):
    """The compiled forward (``native``: :func:`native_sources`'s module and in-place sources)."""
    q = P.q
    R, H, D = P.rows.R, q.size(-2), q.size(-1)
    out = empty_output(R, H, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(R, H, dtype=stat_dtype(q), device=q.device)
    _forward_native(P, *native, out, lse)
    return _results(P, out, lse, return_softmax_lse)


def forward_torch(P: MlaProblem, return_softmax_lse: bool):
    """The vectorised PyTorch forward (any device and dtype)."""
    q = P.q
    cdt = _compute_dtype(q)
    qf = P.rows.flat(q)
    R, H, D = qf.shape
    out = empty_output(R, H, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(R, H, dtype=stat_dtype(q), device=q.device)
    sinks = None if P.sinks is None else P.sinks.to(cdt)
    adt = attention_dtype(q)
    step = P.rows_per_block()
    spans = [(0, R)]
    if _use_banded(P):
        out.zero_()
        lse.zero_()
        spans = _forward_banded(P, out, lse, cdt)
    for t0, t1 in (blk for a, z in spans for blk in ((x, min(z, x + step)) for x in range(a, z, step))):
        k = P.keys(t0, t1)
        keys = P.gather(k, adt)
        qb = _zero_invalid(qf[t0:t1].to(adt), k.valid)
        o, l = attend(qb, keys, k.mask, sinks, P.scale, q.dtype, k.valid)
        out[t0:t1] = o.to(q.dtype)
        lse[t0:t1] = l.to(lse.dtype)
    return _results(P, out, lse, return_softmax_lse)


def _results(P: MlaProblem, out, lse, return_softmax_lse: bool):
    q = P.q
    attn_out = P.rows.unflat(out, q)
    if not return_softmax_lse:
        return attn_out, torch.zeros((), dtype=stat_dtype(q), device=q.device)
    return attn_out, lse_from_rows(lse, q, "BSND" if P.rows.layout == "BSND" else "TND")


def backward_native(P: MlaProblem, native, dout, attn_out, softmax_lse):
    """The compiled gradient (``native``: :func:`native_sources` with every source a flat view)."""
    rows = P.rows
    return _backward_native(P, *native, rows.flat(P.q), rows.flat(dout), rows.flat(attn_out),
                            lse_to_rows(softmax_lse, rows))


def backward_torch(P: MlaProblem, dout, attn_out, softmax_lse):
    """The vectorised PyTorch gradient (any device and dtype)."""
    q = P.q
    cdt = _compute_dtype(q)
    sdt = stat_dtype(q)
    dev = q.device
    rows = P.rows
    qf, dof, of = rows.flat(q), rows.flat(dout), rows.flat(attn_out)
    lse_rows = lse_to_rows(softmax_lse, rows)
    R, H, D = qf.shape
    Wo = P.ori_width
    dq = empty_output(R, H, D, dtype=q.dtype, device=dev)
    dori = torch.zeros(P.ori.tensor.shape, dtype=cdt, device=dev)
    dcmp = torch.zeros(P.cmp.tensor.shape, dtype=cdt, device=dev) if P.cmp is not None else None
    dsinks = torch.zeros(H, dtype=cdt, device=dev)
    sinks = None if P.sinks is None else P.sinks.to(cdt)
    cmp_l1 = torch.zeros(R, P.cmp_idx.size(1), dtype=sdt, device=dev) if P.cmp_idx is not None else None
    ori_l1 = torch.zeros(R, P.ori_idx.size(1), dtype=sdt, device=dev) if P.ori_idx is not None else None
    step = P.rows_per_block(extra_per_key=2 * H)
    for t0 in range(0, R, step):
        t1 = min(R, t0 + step)
        k = P.keys(t0, t1)
        mask = k.mask
        keys = P.gather(k, cdt)                                         # [r, W, D]
        ok = k.valid
        qb = _zero_invalid(qf[t0:t1].to(cdt), ok)
        dO = _zero_invalid(dof[t0:t1].to(cdt), ok)
        O = _zero_invalid(of[t0:t1].to(cdt), ok)
        lse = _zero_invalid(lse_rows[t0:t1].to(cdt), ok)
        s = P.scale * torch.einsum("rhd,rwd->rhw", qb, keys)
        Pm = torch.where(mask[:, None, :], torch.exp(s - lse[..., None]), torch.zeros((), dtype=cdt, device=dev))
        dP = torch.einsum("rhd,rwd->rhw", dO, keys)
        Dsum = (dO * O).sum(-1)
        dS = round_q(Pm * (dP - Dsum[..., None]), q.dtype)
        dq[t0:t1] = (P.scale * torch.einsum("rhw,rwd->rhd", dS, keys)).to(q.dtype)
        # key and value parts of dK in one batched GEMM over 2H: [scale·dS | round(P)] x [q ; dO]
        dK = torch.einsum("rhw,rhd->rwd", torch.cat([P.scale * dS, round_q(Pm, q.dtype)], 1), torch.cat([qb, dO], 1))
        # masked columns are exact zeros already (dS and P are 0 there, q and dO finite), so they
        # may be scattered to their harmless placeholder address unchanged
        P.ori.scatter_add(dori, *k.ori_addr, dK[:, :Wo])
        if P.cmp is not None:
            P.cmp.scatter_add(dcmp, *k.cmp_addr, dK[:, Wo:])
        if sinks is not None:
            g = torch.exp(sinks - lse) * (Pm * dP).sum(-1)
            has_key = (ok & mask.any(-1))[:, None] & torch.isfinite(lse)   # rows with a key and a finite LSE
            dsinks -= torch.where(has_key, g, torch.zeros((), dtype=cdt, device=dev)).sum(0)
        l1_outputs(P, k, Pm.mean(1), t0, t1, cmp_l1, ori_l1)
    return grad_results(P, dq, dori, dcmp, dsinks if sinks is not None else None, ori_l1, cmp_l1)


# Rows of one request per key-gradient group of the compiled backward (see key_gradient_groups).
KEY_GRADIENT_GROUP_ROWS = 64


def key_gradient_groups(P: MlaProblem) -> torch.Tensor:
    """One int64 id per flat row: blocks of ``KEY_GRADIENT_GROUP_ROWS`` rows of one request, counted from
    the request's first row.  The compiled backward sums a key's gradient over a group's rows in row
    order, then over the groups in order, so a request's key gradients do not depend on which other
    requests share the call, nor on where its rows fall in the call's row blocks."""
    rows = P.rows
    return (rows.batch.to(torch.int64) << 32) + torch.div(rows.local.to(torch.int64), KEY_GRADIENT_GROUP_ROWS,
                                                          rounding_mode="floor")


def _backward_native(P: MlaProblem, module, flat, qf, dof, of, lse_rows) -> tuple:
    """The gradient through the compiled kernel (dsattn/native/attention.cpp), rows in blocks: it
    returns dq, the key rows' fp32 gradients and P's head mean per index slot (for the L1 norms)."""
    q, dev = P.q, P.q.device
    R, sdt = qf.size(0), stat_dtype(q)
    dq = empty_output(*qf.shape, dtype=qf.dtype, device=dev)      # contiguous: the kernel writes its row blocks
    grads = [torch.zeros(f.shape, dtype=torch.float32, device=dev) for f in flat]
    dsinks = torch.zeros(q.size(-2), dtype=torch.float32, device=dev)
    sinks = None if P.sinks is None else P.sinks.float()
    cmp_l1 = torch.zeros(R, P.cmp_idx.size(1), dtype=sdt, device=dev) if P.cmp_idx is not None else None
    ori_l1 = torch.zeros(R, P.ori_idx.size(1), dtype=sdt, device=dev) if P.ori_idx is not None else None
    step = _native_block_rows(P, R)
    groups = key_gradient_groups(P)
    for t0 in range(0, R, step):
        t1 = min(R, t0 + step)
        k = native_keys(P, flat, t0, t1)
        sources, index = _native_keys(P, flat, k)
        res = module.sparse_attention_backward(qf[t0:t1].contiguous(), dof[t0:t1].contiguous(), of[t0:t1].contiguous(),
                                               lse_rows[t0:t1].float().contiguous(), sources, index, sinks, P.scale,
                                               dq=dq[t0:t1], groups=groups[t0:t1], dsources=grads)
        dsinks += res[-2]
        l1_outputs(P, k, res[-1], t0, t1, cmp_l1, ori_l1)
    dori = grads[0].view(P.ori.tensor.shape)
    dcmp = grads[1].view(P.cmp.tensor.shape) if P.cmp is not None else None
    return grad_results(P, dq, dori, dcmp, dsinks if sinks is not None else None, ori_l1, cmp_l1)


