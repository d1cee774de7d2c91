"""Attention of query rows over key rows they name: the primitive under FlashMLA's API
(:mod:`dsattn.flashmla`), and for any caller that holds explicit per-row key lists.

``q [R, H, D]``; ``sources``: key tensors ``[..., D]`` (K = V; any leading dims, e.g. a paged cache
``[num_blocks, block_size, 1, D]``; unit stride along D) or packed tokens
(:class:`dsattn.quant.tokens.PackedTokens`: int8 / fp8 payloads with tile scales, dsattn's packed
rows or FlashMLA's FP8 layouts); ``index``: one int64 ``[R, W_i]`` per source of flat token numbers
over its leading dims (row-major), ``-1`` at a slot without a key (any slot: a list need not be
compacted).  Per row the keys of every source form one softmax, with the
golden's numerics (00 §8: fp32 scores and statistics, P rounded to the query dtype before P·V, one
rounding of the output) and the optional per-head sink.  Returns ``(out [R, H, D] in q's dtype,
lse [R, H] fp32, max [R, H] fp32 or None)``; a row without a key gets out 0 and LSE 0.
``sink_in_lse=False``: the LSE leaves the sink out (the output still includes it), FlashMLA's
convention; ``want_max``: also each row's maximum scaled score without the sink (``-inf`` for a
row without a key), FlashMLA's ``max_logits``.

One place picks the implementation, in this order, each saying what it covers:

* ``compiled``: the compiled CPU kernel (dsattn/native/attention.cpp) reads the listed rows in
  place: CPU tensors of bf16 / fp16 / fp32, sources whose rows lie one after another (others have
  their listed rows gathered first), packed tokens decoded as it gathers them, the extension built;
* ``triton``: the Triton forward (CUDA tensors, or the interpreter under ``DSATTN_BACKEND=triton``)
  over element offsets of the listed rows, whatever the sources' strides (packed tokens: the listed
  ones decoded first, block of rows by block); without
  ``sink_in_lse`` or with ``want_max`` it runs without the sink (returning its statistics) and the
  sink scales its output after, in fp32 (the output is rounded twice there);
* ``torch``: rows in blocks, their keys gathered and attended by :func:`dsattn.common.softmax.attend`.

Nothing here reads tensor values on the host: shapes alone decide (CUDA-graph safe on the Triton
path)."""
from __future__ import annotations

import torch

from ..backend import use_triton
from ..common.checks import fail
from ..common.softmax import attend, attention_dtype, row_max
from ..quant.tokens import PackedTokens

GATHER_BUDGET = 64 << 20          # bytes of gathered keys per block of rows (the torch path)
DECODE_BUDGET = 64 << 20          # bytes of decoded packed tokens per block of rows (the Triton path)
INDEX_BUDGET = 32 << 20           # bytes of int64 key tables per call of a compiled / Triton kernel


def _unravel(index: torch.Tensor, shape) -> list[torch.Tensor]:
    """Flat token numbers -> one coordinate tensor per leading dim (row-major)."""
    coords = []
    for n in reversed(shape):
        coords.append(index % n)
        index = torch.div(index, n, rounding_mode="floor")
    return coords[::-1]


def flat_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t [..., D]`` as ``[tokens, D]`` rows one after another (a view, no copy), or None."""
    D = t.size(-1)
    if t.stride(-1) != 1:
        return None
    expected = D
    for n, s in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if n != 1 and s != expected:
            return None
        expected *= n
    return t.as_strided((t.numel() // max(D, 1), D), (D, 1))


def gather_rows(src, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The listed tokens ``[*index.shape, D]`` of ``src`` (``-1``: a zero row, never read); packed
    tokens decoded to ``dtype``."""
    if isinstance(src, PackedTokens):
        return src.dequantize(index, dtype)
    valid = index >= 0
    coords = _unravel(torch.where(valid, index, torch.zeros_like(index)), src.shape[:-1])
    rows = src[tuple(coords)]
    return torch.where(valid[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def _apply_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, has_key: torch.Tensor) -> torch.Tensor:
    """The sink on a sink-free result: ``out · exp(lse) / (exp(lse) + exp(sink))``."""
    scaled = out / (1.0 + torch.exp(sinks.float() - lse))[..., None]
    return torch.where(has_key[..., None], scaled, torch.zeros((), dtype=out.dtype, device=out.device))


# ----------------------------------------------------------------------------- the implementations
class Compiled:
    name = "compiled"

    @staticmethod
    def reasons(q, sources, want_grad: bool) -> list[str]:
        from .. import native
        why = []
        if q.device.type != "cpu":
            why.append(f"tensors on {q.device.type}, not the CPU")
        if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            why.append(f"query dtype {q.dtype}")
        if any(not isinstance(s, PackedTokens) and s.dtype != q.dtype for s in sources):
            why.append("key dtype differs from the query's")
        if any(isinstance(s, PackedTokens) and s.device.type != "cpu" for s in sources):
            why.append("packed tokens off the CPU")
        if native.kernels() is None:
            why.append(f"compiled layer: {native.status()}")
        return why

    @staticmethod
    def run(q, sources, index, sinks, scale, sink_in_lse, out, lse, mx, st=None):
        from .. import native
        module = native.kernels()
        R = q.size(0)
        packed = [isinstance(s, PackedTokens) for s in sources]
        flat = [None if p else flat_rows(s) for s, p in zip(sources, packed)]
        formats = [s.fields() if p else [] for s, p in zip(sources, packed)] if any(packed) else []
        W = max(1, sum(i.size(1) for i in index))
        step = max(1, min(R, INDEX_BUDGET // (8 * W))) if R else 1
        for t0 in range(0, R, step):
            t1 = min(R, t0 + step)
            rows, tables = [], []
            block_stats = None if st is None else torch.empty(2, t1 - t0, q.size(1), device=q.device)
            for src, p, f, idx in zip(sources, packed, flat, index):
                block = idx[t0:t1]
                if p:                              # the kernel decodes the listed tokens as it reads them
                    rows.append(src.data)
                    tables.append(block.contiguous())
                elif f is not None:
                    rows.append(f)
                    tables.append(block.contiguous())
                else:                          # rows not laid out one after another: the listed ones
                    r, w = block.shape
                    rows.append(gather_rows(src, block).reshape(r * w, src.size(-1)))
                    seq = torch.arange(r * w, device=q.device).view(r, w)
                    tables.append(torch.where(block >= 0, seq, torch.full((), -1, device=q.device)))
            module.sparse_attention_forward(q[t0:t1].contiguous(), rows, tables, sinks, scale, out=out[t0:t1],
                                            lse=lse[t0:t1], sink_in_lse=sink_in_lse,
                                            max=None if mx is None else mx[t0:t1], formats=formats,
                                            stats=None if st is None else block_stats)
            if st is not None:
                st[:, t0:t1] = block_stats


class Triton:
    name = "triton"

    @staticmethod
    def reasons(q, sources, want_grad: bool) -> list[str]:
        why = []
        if not use_triton(q.device):
            why.append(f"Triton does not run on {q.device.type} tensors here (DSATTN_BACKEND)")
            return why
        from . import triton as kernels
        if not kernels.kernel_covers(q.dtype, q.size(-1), False, *kernels.device_target(q.device)):
            why.append(f"the kernel does not cover dtype {q.dtype} with head dim {q.size(-1)} on this target")
        if any(not isinstance(s, PackedTokens) and (s.dtype != q.dtype or s.stride(-1) != 1) for s in sources):
            why.append("key rows of another dtype or without unit stride")
        return why

    @staticmethod
    def run(q, sources, index, sinks, scale, sink_in_lse, out, lse, mx, st=None):
        from . import triton as kernels
        R, D = q.size(0), q.size(-1)
        qf = q if q.stride(-1) == 1 else q.contiguous()
        # (max, sum) from the kernel: without the sink where the LSE or the maxima must leave it out (the
        # sink then scales the output here), with it for the softmax statistics
        stats = st is not None or mx is not None or (sinks is not None and not sink_in_lse)
        in_kernel = sinks if st is not None or not stats else None
        o, l, ssum = Triton._launch(kernels, qf, sources, index, in_kernel, scale, stats)
        if st is not None:                         # l holds the shifts, ssum the denominators, sink included
            st[0].copy_(l)
            st[1].copy_(ssum)
            l = torch.where(ssum > 0, l + torch.log(ssum), torch.zeros_like(l))
        elif stats:                                # l holds the rows' maxima, ssum their sums
            has_key = ssum > 0
            row_max, l = l, torch.where(has_key, l + torch.log(ssum), torch.zeros_like(l))
            if mx is not None:
                mx.copy_(torch.where(has_key, row_max, torch.full_like(row_max, float("-inf"))))
            if sinks is not None:
                o = _apply_sink(o.float(), l, sinks, has_key[:, :1])
                if sink_in_lse:
                    l = torch.where(has_key, torch.logaddexp(l, sinks.float()), l)
        out.copy_(o)
        lse.copy_(l)

    @staticmethod
    def _launch(kernels, qf, sources, index, sinks, scale, stats):
        """The kernel over every row in blocks: ``(out, lse or max, sum)`` as RowAttention writes them."""
        R, D = qf.size(0), qf.size(-1)
        packed = any(isinstance(s, PackedTokens) for s in sources)
        W = max(1, sum(i.size(1) for i in index))
        step = max(1, min(R, INDEX_BUDGET // (8 * W))) if R else 1
        if packed:                                 # the listed tokens decoded per block: keep blocks small
            step = max(1, min(step, DECODE_BUDGET // (W * D * qf.element_size()))) if R else 1
        att = None
        for t0 in range(0, R, step):
            t1 = min(R, t0 + step)
            plain = []
            for src, block in zip(sources, (idx[t0:t1] for idx in index)):
                if isinstance(src, PackedTokens):
                    r, w = block.shape
                    seq = torch.arange(r * w, device=qf.device).view(r, w)
                    plain.append((src.dequantize(block, qf.dtype).reshape(r * w, D),
                                  torch.where(block >= 0, seq, torch.full((), -1, device=qf.device))))
                else:
                    plain.append((src, block))
            if att is None or packed:
                att = kernels.RowAttention(qf, [t for t, _ in plain], D, sinks, scale, stats=stats)
                if t0 == 0:
                    o, l, ssum = att.outputs(R)
            parts = []
            for src, block in plain:
                coords = _unravel(torch.where(block >= 0, block, torch.zeros_like(block)), src.shape[:-1])
                off = sum(c * s for c, s in zip(coords, src.stride()[:-1]))
                off = off + (src.data_ptr() - att.base.data_ptr()) // src.element_size()
                parts.append(torch.where(block >= 0, off, torch.full((), -1, dtype=off.dtype, device=off.device)))
            att.run(t0, t1, torch.cat(parts, 1).contiguous(), o, l, ssum)
        return o, l, ssum


class Torch:
    name = "torch"

    @staticmethod
    def reasons(q, sources, want_grad: bool) -> list[str]:
        return []

    @staticmethod
    def run(q, sources, index, sinks, scale, sink_in_lse, out, lse, mx, st=None):
        R, H, D = q.shape
        adt = torch.float64 if q.dtype == torch.float64 else torch.float32
        if st is None:
            adt = attention_dtype(q)
        W = max(1, sum(i.size(1) for i in index))
        step = max(1, min(R, GATHER_BUDGET // (W * D * torch.finfo(adt).bits // 8 * 3))) if R else 1
        sink_f = None if sinks is None else sinks.to(adt)
        for t0 in range(0, R, step):
            t1 = min(R, t0 + step)
            blocks = [idx[t0:t1] for idx in index]
            keys = torch.cat([gather_rows(s, b, q.dtype).to(adt) for s, b in zip(sources, blocks)], 1) if blocks else \
                q.new_zeros((t1 - t0, 0, D), dtype=adt)
            mask = torch.cat([b >= 0 for b in blocks], 1) if blocks else \
                torch.zeros(t1 - t0, 0, dtype=torch.bool, device=q.device)
            row_ok = torch.ones(t1 - t0, dtype=torch.bool, device=q.device)
            if st is not None:                     # the softmax's shift and denominator too
                o, l, m, den = attend(q[t0:t1].to(adt), keys, mask, sink_f, scale, q.dtype, row_ok, stats=True)
                st[0, t0:t1], st[1, t0:t1] = m.float(), den.float()
            else:
                o, l = attend(q[t0:t1].to(adt), keys, mask, sink_f if sink_in_lse else None, scale, q.dtype, row_ok)
            if sinks is not None and not sink_in_lse:
                o = _apply_sink(o, l, sink_f, mask.any(1, keepdim=True))
            if mx is not None:
                s = (scale * torch.einsum("rhd,rwd->rhw", q[t0:t1].to(adt), keys)).masked_fill(
                    ~mask[:, None, :], float("-inf"))
                mx[t0:t1] = row_max(s).float()
            out[t0:t1] = o.to(q.dtype)
            lse[t0:t1] = l.float()


IMPLEMENTATIONS = (Compiled, Triton, Torch)


def choose(q: torch.Tensor, sources) -> type:
    """The first implementation that covers the call."""
    for impl in IMPLEMENTATIONS:
        if not impl.reasons(q, sources, False):
            return impl
    return Torch


def explain(q: torch.Tensor, sources) -> list[tuple[str, list[str]]]:
    """``[(name, reasons it does not run)]`` for every implementation, in dispatch order."""
    return [(impl.name, impl.reasons(q, sources, False)) for impl in IMPLEMENTATIONS]


def _check_call(q, sources, index, sinks, sink_in_lse: bool, want_max: bool, want_stats: bool) -> None:
    """Shapes and dtypes only (never tensor values: the call stays free of host reads)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        fail("q", f"expected a [R, H, D] tensor, got {getattr(q, 'shape', type(q).__name__)}", TypeError
             if not isinstance(q, torch.Tensor) else ValueError)
    R, H, D = q.shape
    if len(sources) != len(index):
        fail("index", f"expected one table per source ({len(sources)}), got {len(index)}")
    for k, (src, idx) in enumerate(zip(sources, index)):
        width = src.D if isinstance(src, PackedTokens) else src.size(-1)
        if width != D:
            fail("sources", f"source {k} holds keys of width {width}, q's head dim is {D}")
        if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int64 or idx.dim() != 2 or idx.size(0) != R:
            fail("index", f"table {k} must be an int64 [R={R}, W] tensor, got "
                 f"{getattr(idx, 'dtype', type(idx).__name__)} {tuple(getattr(idx, 'shape', ()))}", TypeError
                 if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int64 else ValueError)
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (H,)):
        fail("sinks", f"expected a float32 tensor of shape [H={H}], got {sinks.dtype} {tuple(sinks.shape)}")
    if want_stats and (want_max or not sink_in_lse):
        fail("want_stats", "goes with sink_in_lse=True and without want_max (the statistics include the sink)")


def attend_rows(q: torch.Tensor, sources, index, *, scale: float, sinks: torch.Tensor | None = None,
                sink_in_lse: bool = True, want_max: bool = False, want_stats: bool = False):
    """See the module's docstring.  ``want_stats``: the 4th result is ``[2, R, H]`` fp32, each row's
    softmax shift ``m`` and denominator ``l`` (sink included; 0 and 0 without a key), else None."""
    _check_call(q, sources, index, sinks, sink_in_lse, want_max, want_stats)
    R, H, D = q.shape
    out = torch.empty(R, H, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(R, H, dtype=torch.float32, device=q.device)
    mx = torch.empty(R, H, dtype=torch.float32, device=q.device) if want_max else None
    st = torch.empty(2, R, H, dtype=torch.float32, device=q.device) if want_stats else None
    if R:
        choose(q, sources).run(q, list(sources), list(index), sinks, float(scale), sink_in_lse, out, lse, mx, st)
    return out, lse, mx, st
