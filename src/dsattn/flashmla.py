"""FlashMLA's public Python API over dsattn's operators: code written against ``flash_mla`` runs by
changing the import (``from dsattn import flashmla as flash_mla`` or ``from dsattn.flashmla import
flash_mla_with_kvcache, ...``).  Same names, arguments, defaults, shapes and return values as
FlashMLA's ``flash_mla/flash_mla_interface.py``; its conventions hold at this boundary only:

* the LSE excludes the sink, natural log; a query with no valid key gets out 0 and LSE ``+inf``
  (``max_logits`` ``-inf``); the sink scales the output by ``exp(lse) / (exp(lse) + exp(sink))``
  (``+inf`` -> out 0, ``-inf`` -> no effect);
* index lists hold flat pool indices ``block · page_block_size + offset`` (decode) or key rows
  (prefill); -1 masks that one slot, and so does any slot at or past ``topk_length`` (the kernels
  skip each such slot; dsattn's operators would end a list at its first -1);
* the value is the first ``head_dim_v`` / ``d_v`` columns of the key (576 / 512 for V3.2);
* FP8 caches in FlashMLA's V3.2 (656-byte) and V4 (584-byte) layouts are read directly, dequantising
  only the tokens a query reads (:mod:`dsattn.quant.flashmla`).

Sparse calls run :func:`dsattn.sparse_mla.rows.attend_rows`, the kernels of ``sparse_flash_mla``
over each query's own list of tokens: the compiled CPU kernel reads the listed tokens of a bf16 /
fp16 cache in place (no gathered copy) and decodes an FP8 cache's listed tokens as it reads them;
the Triton kernel runs on CUDA.  The numerics are the operators' (fp32 scores and
softmax, P rounded to the query dtype before P·V, as FlashMLA's kernels do too); the sink enters the
output's normaliser, the LSE leaves it out.  For dense decode the paged cache goes to
``sparse_flash_mla`` as it is (causal: ori mask mode 3), one call per KV head with its group of
query heads when the cache has several (FlashMLA's grouping: query head ``i`` reads KV head
``i // (h_q / h_kv)``).  Nothing reads device data on the host except the content checks (indices
within the pool), which ``dsattn.set_content_checks(False)`` and CUDA graph capture skip.  The
scheduling object is kept for API compatibility: dsattn needs no plan
here, but it records the first call's configuration and rejects an inconsistent reuse, as
FlashMLA does.
"""
from __future__ import annotations


import dataclasses
from typing import Optional, Tuple

import torch

from . import ops
from .common.checks import check_tensor, content_checks_enabled, fail, host_ints
from .common.memo import TensorMemo
from .quant.flashmla import layout_of
from .quant.tokens import PackedTokens
from . import native
from .sparse_mla.rows import Compiled, attend_rows, flat_rows

__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd"]



@dataclasses.dataclass
class FlashMLASchedMeta:
    """FlashMLA's scheduling object.  dsattn computes no tile schedule for these calls; the object
    records the configuration of its first use and later calls must match it."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]
        extra_page_block_size: Optional[int]
        extra_topk: Optional[int]

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None
    num_splits: Optional[torch.Tensor] = None


def get_mla_metadata(*args, **kwargs) -> Tuple[FlashMLASchedMeta, None]:
    """``(FlashMLASchedMeta(), None)``, for any arguments (FlashMLA keeps the old signature's
    ``cache_seqlens, num_q_tokens_per_head_k, num_heads_k, ...`` for compatibility)."""
    return FlashMLASchedMeta(), None


def _lse_fill_empty(lse: torch.Tensor, has_key: torch.Tensor) -> torch.Tensor:
    return torch.where(has_key, lse, torch.full((), float("inf"), dtype=lse.dtype, device=lse.device))


def _check_flat_indices(name: str, idx: torch.Tensor, lead: tuple, pool: int, content: bool = True) -> None:
    check_tensor(name, idx)
    if idx.dtype != torch.int32:
        fail(name, f"dtype {idx.dtype} is not supported; expected torch.int32", TypeError)
    if tuple(idx.shape[:-1]) != lead:
        fail(name, f"expected shape {list(lead) + ['topk']}, got {tuple(idx.shape)}")
    if content and content_checks_enabled(idx) and idx.numel():
        lo, hi = (int(v) for v in torch.aminmax(idx))
        if lo < -1 or hi >= pool:
            bad = lo if lo < -1 else hi
            fail(name, f"value {bad} is neither -1 nor a token of the cache's {pool} (num_blocks x page_block_size)")


def _check_lengths(name: str, t: torch.Tensor | None, shape: tuple, K: int, content: bool = True) -> None:
    if t is None:
        return
    check_tensor(name, t)
    if t.dtype != torch.int32:
        fail(name, f"dtype {t.dtype} is not supported; expected torch.int32", TypeError)
    if tuple(t.shape) != shape:
        fail(name, f"expected shape {list(shape)}, got {tuple(t.shape)}")
    if content and content_checks_enabled(t) and t.numel():
        v = host_ints(t)
        if min(v) < 0:
            fail(name, f"value {min(v)} is negative")


class _Scope:
    """One KV cache and its index lists (main or extra), their shapes and dtypes checked (the lists'
    values by :meth:`check_content`); :meth:`source` and :meth:`table` are what the kernels read."""

    def __init__(self, name: str, cache: torch.Tensor, indices: torch.Tensor, lengths, fp8: bool, d: int,
                 b: int, s_q: int):
        self.name, self.cache, self.fp8 = name, cache, fp8
        prefix = "" if name == "k_cache" else "extra_"
        if cache.dim() != 4:
            fail(name, f"expected (num_blocks, page_block_size, num_heads_k, head_dim), got {tuple(cache.shape)}")
        if cache.size(2) != 1:
            fail(name, f"num_heads_k must be 1 for sparse attention, got {cache.size(2)}")
        if fp8:
            layout = layout_of(cache, name)
            if layout.d != d:
                fail(name, f"the {layout.name} layout holds head_dim {layout.d} but q has {d}")
        else:
            if cache.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                fail(name, f"dtype {cache.dtype} is not supported without is_fp8_kvcache; expected a float cache",
                     TypeError)
            if cache.size(-1) != d:
                fail(name, f"head_dim {cache.size(-1)} does not match q's {d}")
        self.idx_name, self.len_name = "indices" if not prefix else "extra_indices_in_kvcache", f"{prefix}topk_length"
        self.pool, self.b, self.s_q = cache.size(0) * cache.size(1), b, s_q
        self.indices, self.lengths = indices, lengths
        _check_flat_indices(self.idx_name, indices, (b, s_q), self.pool, content=False)
        _check_lengths(self.len_name, lengths, (b,), indices.size(-1), content=False)
        self.idx = indices.reshape(b * s_q, -1)
        self.K = self.idx.size(-1)

    def check_content(self) -> None:
        """The lists' values: -1 or a token of the cache; lengths in [0, topk]."""
        _check_flat_indices(self.idx_name, self.indices, (self.b, self.s_q), self.pool)
        _check_lengths(self.len_name, self.lengths, (self.b,), self.K)

    def table(self) -> torch.Tensor:
        """Flat pool indices ``[b·s_q, K]`` int64, -1 at every invalid slot (-1 listed, or at / past
        ``topk_length``)."""
        idx = self.idx.to(torch.int64)
        if self.lengths is None:                   # -1 is the only invalid value the checks let through
            return idx
        cap = self.lengths.repeat_interleave(self.s_q)
        valid = (idx >= 0) & (torch.arange(self.K, device=idx.device)[None] < cap[:, None])
        return torch.where(valid, idx, torch.full((), -1, dtype=torch.int64, device=idx.device))

    def source(self):
        """The cache as the kernels read it: a bf16 / fp16 cache as it lies, an FP8 cache as packed
        tokens (only the listed ones are decoded, as they are read)."""
        return _packed_tokens(self.cache, self.name) if self.fp8 else self.cache


_TOKENS = TensorMemo()            # FP8 caches' PackedTokens descriptors, kept with the cache tensors


def _packed_tokens(cache: torch.Tensor, name: str) -> PackedTokens:
    return _TOKENS.get(cache, (name,), lambda: PackedTokens.from_flashmla(cache, name))


def _attend(q, parts, scale, sinks):
    """``q [r, h, d]`` over ``parts = [(key source, table)]``: FlashMLA's results ``(out [r, h, d] q dtype,
    lse [r, h] without the sink, +inf without a key, max_logits [r, h], -inf without a key)``."""
    sources = [src for src, _ in parts]
    tables = [t for _, t in parts]
    out, lse, mx, _ = attend_rows(q, sources, tables, scale=scale, sinks=sinks, sink_in_lse=False, want_max=True)
    return out, _lse_fill_empty(lse, mx != float("-inf")), mx


def _sparse_decode(q, scopes, head_dim_v, scale, attn_sink):
    b, s_q, h, d = q.shape
    qr = q.reshape(b * s_q, h, d)
    res = _compiled_decode(qr, scopes, scale, attn_sink)
    if res is None:
        for sc in scopes:
            sc.check_content()
        res = _attend(qr, [(sc.source(), sc.table()) for sc in scopes], scale, attn_sink)[:2]
    out, lse = res
    return out[..., :head_dim_v].reshape(b, s_q, h, head_dim_v), lse.view(b, s_q, h).transpose(1, 2)


def _compiled_decode(q, scopes, scale, sinks):
    """``(out, lse)`` of a decode through one compiled step (dsattn/native/flashmla.cpp: the lists'
    content checks, their tables and the attention), where the compiled attention takes the call and
    every source is read in place; None, before anything is written, otherwise or when a list value is
    off (the Python path then checks and raises)."""
    if q.size(0) == 0 or not content_checks_enabled(q):
        return None
    sources = [sc.source() for sc in scopes]
    if Compiled.reasons(q, sources, False):
        return None
    rows = [s.data if isinstance(s, PackedTokens) else flat_rows(s) for s in sources]
    if any(r is None for r in rows):
        return None
    formats = [s.fields() if isinstance(s, PackedTokens) else [] for s in sources]
    empty = q.new_empty((0,), dtype=torch.int32)
    out = torch.empty(q.shape, dtype=q.dtype)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    taken = native.kernels().flashmla_sparse(
        out, lse, q, rows, formats if any(formats) else [], [sc.idx for sc in scopes],
        [empty if sc.lengths is None else sc.lengths for sc in scopes], [sc.pool for sc in scopes], scopes[0].s_q,
        sinks, scale)
    return (out, lse) if taken else None


def _dense_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, scale, causal, fp8):
    b, s_q, h, d = q.shape
    if block_table is None or cache_seqlens is None:
        fail("block_table" if block_table is None else "cache_seqlens",
             "is required for dense attention (indices is None)")
    if k_cache.dim() != 4:
        fail("k_cache", f"expected (num_blocks, page_block_size, num_heads_k, head_dim), got {tuple(k_cache.shape)}")
    h_kv = k_cache.size(2)
    if h_kv < 1 or h % h_kv:
        fail("k_cache", f"num_heads_k {h_kv} must divide q's num_heads_q {h} (query heads are grouped over the "
             "KV heads)")
    if fp8:                          # the V3.2 layout read token by token: the same call as a sparse one
        if h_kv != 1:
            fail("k_cache", f"an FP8 cache holds one KV head; num_heads_k must be 1, got {h_kv}")
        bs = k_cache.size(1)
        W = block_table.size(1) * bs
        pos = torch.arange(W, device=q.device)
        flat = block_table.to(torch.int64)[:, pos // bs] * bs + pos % bs            # [b, W]
        limit = cache_seqlens.to(torch.int64)[:, None] - (s_q - 1 - torch.arange(s_q, device=q.device))[None] \
            if causal else cache_seqlens.to(torch.int64)[:, None].expand(b, s_q)
        live = pos[None, None] < limit[..., None]                                    # [b, s_q, W]
        idx = torch.where(live, flat[:, None, :].expand(b, s_q, W), torch.full((), -1, device=q.device))
        scope = _Scope("k_cache", k_cache, idx.to(torch.int32), None, True, d, b, s_q)
        return _sparse_decode(q, [scope], head_dim_v, scale, None)
    if k_cache.dtype != q.dtype:
        fail("k_cache", f"dtype {k_cache.dtype} does not match q's {q.dtype}", TypeError)
    # FlashMLA groups the query heads over the KV heads (query head i reads KV head i // (h_q / h_kv));
    # the operator takes one KV head, so each KV head is one call with its group of query heads
    g = h // h_kv
    out = torch.empty(b, s_q, h, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device)
    for j in range(h_kv):
        o, l = ops.sparse_flash_mla(q[:, :, j * g:(j + 1) * g], ori_kv=k_cache[:, :, j:j + 1],
                                    ori_block_table=block_table, seqused_ori_kv=cache_seqlens, softmax_scale=scale,
                                    ori_mask_mode=3 if causal else 0, layout_q="BSND", layout_kv="PA_BBND",
                                    return_softmax_lse=True)
        out[:, :, j * g:(j + 1) * g] = o[..., :head_dim_v]
        lse[:, :, j * g:(j + 1) * g] = l[:, 0]                                      # [b, N2=1, s_q, g]
    n_keys = cache_seqlens.to(torch.int64)[:, None].expand(b, s_q)
    if causal:
        n_keys = (n_keys - (s_q - 1 - torch.arange(s_q, device=q.device))[None]).clamp(min=0)
    lse = _lse_fill_empty(lse, (n_keys > 0)[..., None])                            # [b, s_q, h]
    return out, lse.transpose(1, 2)


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: Optional[torch.Tensor],
                           cache_seqlens: Optional[torch.Tensor], head_dim_v: int,
                           tile_scheduler_metadata: FlashMLASchedMeta, num_splits: None = None,
                           softmax_scale: Optional[float] = None, causal: bool = False, is_fp8_kvcache: bool = False,
                           indices: Optional[torch.Tensor] = None, attn_sink: Optional[torch.Tensor] = None,
                           extra_k_cache: Optional[torch.Tensor] = None,
                           extra_indices_in_kvcache: Optional[torch.Tensor] = None,
                           topk_length: Optional[torch.Tensor] = None,
                           extra_topk_length: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a paged KV cache -> ``(out [b, s_q, h_q, head_dim_v], lse [b, h_q, s_q])``.

    Sparse (``indices [b, s_q, topk]`` of flat pool indices, -1 masks a slot): over ``k_cache`` and,
    optionally, ``extra_k_cache`` with its own indices; ``topk_length`` / ``extra_topk_length`` ``[b]``
    keep the leftmost slots; ``attn_sink [h_q]``; bf16 caches or FP8 caches in FlashMLA's V3.2 / V4
    layouts (``is_fp8_kvcache``).  Dense (``indices`` None): ``block_table`` and ``cache_seqlens``,
    ``causal`` aligns the ``s_q`` queries to the end of the cache."""
    sched = tile_scheduler_metadata
    if not isinstance(sched, FlashMLASchedMeta):
        fail("tile_scheduler_metadata", f"expected the FlashMLASchedMeta of get_mla_metadata(), got "
             f"{type(sched).__name__}", TypeError)
    if num_splits is not None:
        fail("num_splits", "must be None (the new interface keeps it for compatibility)")
    check_tensor("q", q)
    check_tensor("k_cache", k_cache)
    if q.dim() != 4:
        fail("q", f"expected (batch_size, seq_len_q, num_heads_q, head_dim), got {tuple(q.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        fail("q", f"dtype {q.dtype} is not supported; expected bfloat16, float16 or float32", TypeError)
    b, s_q, h_q, d = q.shape
    if not isinstance(head_dim_v, int) or not 1 <= head_dim_v <= d:
        fail("head_dim_v", f"value {head_dim_v!r} must be an int in [1, head_dim={d}] (the value is the key's "
             "leading columns)")
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink)
        if attn_sink.dtype != torch.float32 or tuple(attn_sink.shape) != (h_q,):
            fail("attn_sink", f"expected a float32 tensor of shape [num_heads_q={h_q}], got {attn_sink.dtype} "
                 f"{tuple(attn_sink.shape)}")
    sparse = indices is not None
    cfg = FlashMLASchedMeta.Config(b, s_q, h_q, k_cache.size(1) if k_cache.dim() > 1 else 0,
                                   k_cache.size(2) if k_cache.dim() > 2 else 0, causal, is_fp8_kvcache,
                                   indices.size(-1) if sparse else None,
                                   extra_k_cache.size(1) if extra_k_cache is not None else None,
                                   extra_indices_in_kvcache.size(-1) if extra_indices_in_kvcache is not None else None)
    if not sched.have_initialized:
        sched.have_initialized, sched.config = True, cfg
    elif sched.config != cfg:
        diff = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(sched.config, f.name)]
        fail("tile_scheduler_metadata", f"was initialised by a call with other {', '.join(diff)}; reuse it only "
             "across calls of the same shapes")
    if not sparse:
        for name, t in (("attn_sink", attn_sink), ("extra_k_cache", extra_k_cache),
                        ("extra_indices_in_kvcache", extra_indices_in_kvcache), ("topk_length", topk_length),
                        ("extra_topk_length", extra_topk_length)):
            if t is not None:
                fail(name, "is only supported with sparse attention (indices given)")
        return _dense_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, scale, causal, is_fp8_kvcache)
    if causal:
        fail("causal", "must be False when indices is given (sparse attention)")
    if (extra_k_cache is None) != (extra_indices_in_kvcache is None):
        fail("extra_indices_in_kvcache" if extra_k_cache is not None else "extra_k_cache",
             "extra_k_cache and extra_indices_in_kvcache go together")
    if extra_topk_length is not None and extra_k_cache is None:
        fail("extra_topk_length", "is given without extra_k_cache")
    scopes = [_Scope("k_cache", k_cache, indices, topk_length, is_fp8_kvcache, d, b, s_q)]
    if extra_k_cache is not None:
        scopes.append(_Scope("extra_k_cache", extra_k_cache, extra_indices_in_kvcache, extra_topk_length,
                             is_fp8_kvcache, d, b, s_q))
    return _sparse_decode(q, scopes, head_dim_v, scale, attn_sink)


def flash_mla_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                         attn_sink: Optional[torch.Tensor] = None, topk_length: Optional[torch.Tensor] = None
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill: ``q [s_q, h_q, d_qk]``, ``kv [s_kv, 1, d_qk]``, ``indices [s_q, 1, topk]``
    (-1 or >= s_kv: an invalid slot), ``topk_length [s_q]`` -> ``(out [s_q, h_q, d_v] in q's dtype,
    max_logits [s_q, h_q] fp32, lse [s_q, h_q] fp32)``: LSE and max_logits without the sink; a row
    with no valid index gets out 0, LSE ``+inf``, max_logits ``-inf``."""
    for name, t in (("q", q), ("kv", kv), ("indices", indices)):
        check_tensor(name, t)
    if q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        fail("q", f"expected a bfloat16 / float16 / float32 [s_q, h_q, d_qk] tensor, got {q.dtype} {tuple(q.shape)}")
    s_q, h_q, d = q.shape
    if kv.dim() != 3 or kv.size(1) != 1 or kv.size(2) != d:
        fail("kv", f"expected [s_kv, h_kv=1, d_qk={d}], got {tuple(kv.shape)}")
    if kv.dtype != q.dtype:
        fail("kv", f"dtype {kv.dtype} does not match q's {q.dtype}", TypeError)
    if indices.dtype != torch.int32 or indices.dim() != 3 or tuple(indices.shape[:2]) != (s_q, 1):
        fail("indices", f"expected an int32 [s_q={s_q}, h_kv=1, topk] tensor, got {indices.dtype} "
             f"{tuple(indices.shape)}")
    if not isinstance(d_v, int) or not 1 <= d_v <= d:
        fail("d_v", f"value {d_v!r} must be an int in [1, d_qk={d}]")
    if attn_sink is not None and (attn_sink.dtype != torch.float32 or tuple(attn_sink.shape) != (h_q,)):
        fail("attn_sink", f"expected a float32 tensor of shape [h_q={h_q}], got {attn_sink.dtype} "
             f"{tuple(attn_sink.shape)}")
    K = indices.size(-1)
    _check_lengths("topk_length", topk_length, (s_q,), K)
    s_kv = kv.size(0)
    idx = indices[:, 0].to(torch.int64)
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= torch.arange(K, device=q.device)[None] < topk_length[:, None]
    table = torch.where(valid, idx, torch.full((), -1, dtype=torch.int64, device=q.device))
    out, lse, mx = _attend(q, [(kv, table)], float(sm_scale), attn_sink)
    out = out[..., :d_v].contiguous()
    return out, mx, lse
