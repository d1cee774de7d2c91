"""Softmax with sinks, the rounding of P, and LSE merging of partial attention states.

Conventions (00-overview §8, §9):

* scores are fp32 (or wider for the float64 golden); the sink is one extra, *unscaled*
  logit per head whose value vector is zero;
* ``m = max(sink, max_j S_j)``, ``l = exp(sink - m) + sum_j exp(S_j - m)``,
  ``O = sum_j round_q(exp(S_j - m)) v_j / l``, ``lse = m + log(l)`` (includes the sink);
* rows that see no key produce ``O = 0`` and ``lse = 0`` -- also when no row of the call has a
  key (a zero-width score block: no reduction over an empty axis);
* infinite sinks take no part in the maximum: a ``-inf`` sink adds ``exp(-inf) = 0`` (no sink),
  a ``+inf`` sink makes ``l = inf``, so the row gets ``O = 0`` and ``lse = +inf`` (00 §12);
* a key that no row of the block may see never reaches a product: scores are replaced (not
  masked by a zero weight) and value rows no valid row selects are replaced by zeros, since
  ``0 · NaN = NaN`` would let an unread NaN row into valid outputs (00 §8).
"""
from __future__ import annotations

import torch


def round_q(x: torch.Tensor, qdtype: torch.dtype) -> torch.Tensor:
    """Round-to-nearest-even to the query dtype, then back to ``x``'s dtype (identity for fp32
    and wider query dtypes)."""
    if qdtype in (torch.float16, torch.bfloat16):
        return x.to(qdtype).to(x.dtype)
    return x


def row_max(s: torch.Tensor) -> torch.Tensor:
    """Maximum over the last axis; ``-inf`` where the axis is empty (``amax`` raises there)."""
    if s.size(-1) == 0:
        return torch.full(s.shape[:-1], float("-inf"), dtype=s.dtype, device=s.device)
    return s.amax(-1)


def finite_sinks(sinks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sinks as they enter the row maximum: ``±inf`` sinks are left out of it (``-inf`` is no
    sink; a ``+inf`` sink enters only the denominator, making it ``inf``: out 0, LSE ``+inf``)."""
    s = sinks.to(dtype)
    return torch.where(torch.isfinite(s), s, torch.full((), float("-inf"), dtype=dtype, device=s.device))


def stable_max(m: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The softmax's shift: the row maximum joined with the finite sinks, 0 where nothing is finite."""
    if sinks is not None:
        m = torch.maximum(m, finite_sinks(sinks, m.dtype))
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def softmax_with_sink(s: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor | None):
    """Unnormalised softmax over the last axis with an optional per-head sink.

    ``s``: scores ``[R, H, W]``; ``mask``: ``[R, W]`` (or broadcastable) True for real keys;
    ``sinks``: ``[H]`` or None.  Returns ``(e, l, m)`` with ``e = exp(s - m)`` (0 where masked),
    ``l`` the denominator including the sink and ``m`` the running max (finite; 0 for rows
    without any key and without a sink).  Masked scores may hold anything, NaN included.
    """
    # a fill, not torch.tensor(): a host-to-device copy is not allowed inside CUDA graph capture
    neg_inf = torch.full((), float("-inf"), dtype=s.dtype, device=s.device)
    s = torch.where(mask.unsqueeze(-2), s, neg_inf)
    m = stable_max(row_max(s), sinks)
    e = torch.exp(s - m.unsqueeze(-1))
    l = e.sum(-1)
    if sinks is not None:
        l = l + torch.exp(sinks.to(s.dtype) - m)
    return e, l, m


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_enabled = False


def set_flash_attention(enabled: bool) -> None:
    """Opt in to PyTorch's fused CPU flash-attention kernel for bf16 / fp16 attention.

    It runs half-precision GEMMs (about 2.5x the fp32 path on AVX512-BF16 machines) with fp32
    scores, softmax and accumulation, but rounds P against the running maximum of each key tile
    (and applies the sink after the kernel), not against the row's global maximum as the golden
    does.  Its rounding noise is independent of the golden's and of the same size as the
    golden's own error against exact math (both meet the FlashMLA bounds on about 99.6-99.8 % of
    elements at head dim 32), which is below the bf16 cross-order rule's 99.9 %; hence off by
    default: the default path reproduces the golden's rounding points exactly."""
    global _flash_enabled
    _flash_enabled = bool(enabled)


def uses_flash(qdtype: torch.dtype, device: torch.device) -> bool:
    return (_flash_enabled and _FLASH_CPU is not None and device.type == "cpu"
            and qdtype in (torch.float16, torch.bfloat16))


def attention_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype :func:`attend` wants its q and keys in."""
    if uses_flash(q.dtype, q.device):
        return q.dtype
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _flash_attend(q, keys, mask, sinks, scale, row_ok):
    ok = row_ok & mask.any(-1)
    neg = torch.full((), float("-inf"), dtype=q.dtype, device=q.device)
    bias = torch.where(mask, torch.zeros((), dtype=q.dtype, device=q.device), neg)[:, None, None, :]
    out, lse = _FLASH_CPU(q[:, None], keys[:, None], keys[:, None], attn_mask=bias, scale=scale)
    out, lse = out[:, 0].float(), lse[:, 0]
    if sinks is not None:                          # the sink: one more logit with a zero value vector
        total = torch.logaddexp(lse, sinks.float())
        out = out * torch.exp(lse - total)[..., None]
        lse = total
    okh = ok[:, None]
    return (torch.where(okh[..., None], out, torch.zeros((), device=out.device)),
            torch.where(okh, lse, torch.zeros((), device=lse.device)))


def attend(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor | None,
           scale: float, qdtype: torch.dtype, row_ok: torch.Tensor, stats: bool = False):
    """Attention of ``q [R, H, D]`` over per-row keys ``keys [R, W, D]`` (K = V), both in
    :func:`attention_dtype` (the query dtype on the flash path, else fp32 / fp64).  ``mask [R, W]``
    marks real keys (masked key rows must already be zero), ``row_ok [R]`` valid rows.  Returns
    ``(out [R, H, D], lse [R, H])`` unrounded (fp32 or wider); with ``stats`` (fp32 / fp64 keys) also
    the softmax's shift ``m`` and denominator ``l`` (sink included), 0 and 0 for rows without a key."""
    if keys.dtype in (torch.float16, torch.bfloat16):
        if stats:
            raise ValueError("stats: the softmax statistics need fp32 or fp64 keys (not the flash path)")
        return _flash_attend(q, keys, mask, sinks, scale, row_ok)
    s = scale * torch.einsum("rhd,rwd->rhw", q, keys)
    e, l, m = softmax_with_sink(s, mask, sinks)
    out = torch.einsum("rhw,rwd->rhd", round_q(e, qdtype), keys) / l.unsqueeze(-1)
    lse = m + torch.log(l)
    ok = (row_ok & mask.any(-1)).unsqueeze(-1)
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    out = torch.where(ok.unsqueeze(-1), out, zero)
    lse = torch.where(ok, lse, zero)
    if stats:
        return out, lse, torch.where(ok, m, zero), torch.where(ok, l, zero)
    return out, lse


def attend_branches(scores, masks, values, scale: float, sinks: torch.Tensor | None, qdtype: torch.dtype):
    """One softmax over several key branches of the same query rows, as the golden computes it:
    a single maximum over every branch's keys (and the sink), P rounded to the query dtype before
    P·V, the sink's exponential only in the denominator.

    ``scores``: list of unscaled ``q·k`` ``[n, H, W_i]``; ``masks``: list of ``[n, W_i]`` real keys;
    ``values``: list of ``("shared", V [W_i, D])`` (one key set for every row) or
    ``("per_row", V [n, W_i, D])``.  Returns ``(out [n, H, D], lse [n, H], has [n, 1])``: rows
    without a key get 0 / 0 and ``has`` False."""
    # scaled, then masked: -inf scaled by a zero or negative softmax_scale would be NaN / +inf
    s = [(scale * x).masked_fill(~m[:, None, :], float("-inf")) for x, m in zip(scores, masks)]
    m_ = stable_max(torch.stack([row_max(x) for x in s]).amax(0), sinks)
    l = torch.zeros_like(m_)
    acc = None
    for x, mask, (kind, V) in zip(s, masks, values):
        e = torch.exp(x - m_[..., None])
        l = l + e.sum(-1)
        pe = round_q(e, qdtype)
        if kind == "shared":
            # a shared key range may hold rows that only padding / invalid rows (or nobody) may see
            V = V.masked_fill(~mask.any(0)[:, None], 0.0)
            part = torch.einsum("nhu,ud->nhd", pe, V)
        else:
            part = torch.einsum("nhw,nwd->nhd", pe, V)
        acc = part if acc is None else acc + part
    if sinks is not None:
        l = l + torch.exp(sinks.to(m_.dtype) - m_)
    has = torch.stack([m.any(-1) for m in masks]).any(0)[:, None]
    zero = torch.zeros((), dtype=acc.dtype, device=acc.device)
    out = torch.where(has[..., None], acc / l[..., None], zero)
    lse = torch.where(has, m_ + torch.log(l), zero)
    return out, lse, has


def merge_attention_states(outs, lses, *, sinks=None, valid=None):
    """Merge partial attention states computed on disjoint key subsets (60-serving §7.2).

    ``outs``: list of ``[..., N, Dv]`` tensors (one dtype); ``lses``: list of float32
    ``[..., N]``; ``valid``: list of bool ``[..., N]`` or None (all partials valid);
    ``sinks``: float32 ``[N]`` or None, added exactly once here (partials are computed
    without it).  Returns ``(out [..., N, Dv] in the outs dtype, lse float32 [..., N])``;
    rows where no partial saw a key get ``out = 0``, ``lse = 0``.
    """
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"outs: expected a non-empty list matching lses, got {len(outs)} and {len(lses)}")
    if valid is not None and len(valid) != len(outs):
        raise ValueError(f"valid: expected {len(outs)} masks, got {len(valid)}")
    dtype, shape = outs[0].dtype, tuple(outs[0].shape)
    if len(shape) < 2:
        raise ValueError(f"outs: partials must be [..., N, Dv], got shape {shape}")
    for k, (o, l) in enumerate(zip(outs, lses)):
        if o.dtype != dtype:
            raise TypeError(f"outs: partial {k} has dtype {o.dtype}, expected {dtype}")
        if tuple(o.shape) != shape:
            raise ValueError(f"outs: partial {k} has shape {tuple(o.shape)}, expected partial 0's {shape}")
        if l.dtype != torch.float32:
            raise TypeError(f"lses: partial {k} has dtype {l.dtype}, expected torch.float32")
        if tuple(o.shape[:-1]) != tuple(l.shape):
            raise ValueError(f"lses: partial {k} has shape {tuple(l.shape)}, expected {tuple(o.shape[:-1])}")
        if valid is not None and (not isinstance(valid[k], torch.Tensor) or tuple(valid[k].shape) != tuple(l.shape)):
            raise ValueError(f"valid: mask {k} must be a tensor of shape {tuple(l.shape)}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
            raise TypeError(f"sinks: expected a float32 tensor of shape [N={shape[-2]}]")
        if tuple(sinks.shape) not in ((shape[-2],), ()) and tuple(sinks.shape) != shape[:-1]:
            raise ValueError(f"sinks: expected shape [N={shape[-2]}] (one per head), got {tuple(sinks.shape)}")
    lse = torch.stack(lses).float()
    ok = torch.isfinite(lse)
    if valid is not None:
        ok = ok & torch.stack([v.to(torch.bool) for v in valid])
    lse = torch.where(ok, lse, torch.full_like(lse, float("-inf")))
    M = lse.amax(0)
    M = stable_max(M, sinks.float() if sinks is not None else None)
    w = torch.exp(lse - M)                                       # [P, ..., N], 0 for empty partials
    den = w.sum(0)
    if sinks is not None:
        den = den + torch.exp(sinks.float() - M)
    parts = torch.stack([o.float() for o in outs])
    parts = torch.where(ok.unsqueeze(-1), parts, torch.zeros_like(parts))
    out = (w.unsqueeze(-1) * parts).sum(0) / den.unsqueeze(-1)
    any_ok = ok.any(0)
    out = torch.where(any_ok.unsqueeze(-1), out, torch.zeros_like(out))
    lse_out = torch.where(any_ok, M + torch.log(den), torch.zeros_like(M))
    return out.to(dtype), lse_out
