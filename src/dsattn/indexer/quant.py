"""Registration and validation of ``dsattn::quant_lightning_indexer``: ``lightning_indexer`` (10 §1) over
quantised keys ``k = fp32(key) x key_dequant_scale`` per token, read in place (int8 or FP8 e4m3 caches,
scales beside the values, in each row or in each block: :mod:`dsattn.quant.index_keys`), with float
queries or int8 / FP8 queries with per-token-head scales (``q = fp32(query) x query_dequant_scale``).

The schema is the CANN ops-transformer torch_extension's (``cann_ops_transformer::quant_lightning_indexer``)
with two library extensions: the scales are optional (a float query has none; keys in the ``"row"`` /
``"block"`` layouts carry theirs) and ``key_scale_layout`` (last, keyword-only) says where the key scales lie.
"""
from __future__ import annotations

import dataclasses

import torch

from .._registry import register
from ..common.checks import check_choice, check_tensor, fail, is_fake
from ..common.layout import KVSource
from ..common.memo import TensorMemo
from ..quant.index_keys import KEY_DTYPES, SCALE_DTYPES, IndexKeyPool, check_key_dtype, index_key_pool
from . import dispatch
from .op import run_indexer
from .problem import K_LAYOUTS, LIGHTNING_DEFAULTS, IndexerProblem, check_lightning_attrs, check_offset, parse_indexer

QUANT_LIGHTNING_INDEXER_SCHEMA = (
    "quant_lightning_indexer(Tensor query, Tensor key, Tensor weights, Tensor? query_dequant_scale, "
    "Tensor? key_dequant_scale, int topk, int quant_mode, *, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? seqused_q=None, Tensor? seqused_k=None, "
    "Tensor? cmp_residual_k=None, Tensor? block_table=None, Tensor? output_idx_offset=None, "
    "Tensor? metadata=None, int max_seqlen_q=-1, str layout_q=\"BSND\", str layout_k=\"BSND\", "
    "int mask_mode=0, int cmp_ratio=1, int return_value=0, str key_scale_layout=\"separate\") -> (Tensor, Tensor)")

QUANT_MODES = (0,)             # per-token(-head) dequant scales, the operator's one mode
FLOAT_QUERY = (torch.bfloat16, torch.float16, torch.float32)


class QuantKeys(KVSource):
    """The keys of a quantised pool as :class:`KVSource` addresses them (batch / position -> block,
    slot), decoded to fp32 as they are gathered; ``tensor`` is a zero-stride stand-in of the pool's
    logical shape (its sizes only are read)."""

    pool: IndexKeyPool

    def gather(self, i0: torch.Tensor, i1: torch.Tensor) -> torch.Tensor:
        if self.pool.rows == 0:
            return torch.zeros((*i1.shape, self.pool.D), device=i1.device)
        if self.layout == "TND":
            return self.pool.gather(i1, torch.zeros_like(i1))
        return self.pool.gather(i0, i1)

    def row(self, b: int, x: int) -> torch.Tensor:
        row = self._row_index(b, x)
        return self.pool.gather(torch.tensor(row // self.pool.bs), torch.tensor(row % self.pool.bs))

    def _row_index(self, b: int, x: int) -> int:
        if self.layout == "BSND":
            return b * self.pool.bs + x
        if self.layout == "TND":
            return int(self.cu[b]) + x
        super()._row(b, x)                                   # (the block table's checks and errors)
        return int(self.block_table[b, x // self.pool.bs]) * self.pool.bs + x % self.pool.bs


@dataclasses.dataclass
class QuantIndexerProblem(IndexerProblem):
    """``q`` holds the query values exactly in a float dtype (a quantised query's codes as bf16, exact
    for int8 and FP8 e4m3); ``q_scale`` ``[R, N1]`` fp32 its per-token-head scales (None: a float query)."""

    q_scale: torch.Tensor | None = None
    pool: IndexKeyPool | None = None

    def dequantized(self) -> IndexerProblem:
        """The same call with a float query (``q x q_scale`` in fp32) and keys decoded as they are read."""
        if self.q_scale is None:
            return self
        q = self.rows.flat(self.q).float() * self.q_scale[..., None]
        return dataclasses.replace(self, q=self.rows.unflat(q, self.q), q_scale=None)


def _check_query(query, query_dequant_scale, key, lead_rank: int):
    check_tensor("query", query)
    if query.dtype in FLOAT_QUERY:
        if query_dequant_scale is not None:
            fail("query_dequant_scale", f"must be None for a float query ({query.dtype}): only an int8 / FP8 query "
                 "has dequant scales")
        return query, None
    if query.dtype == torch.uint8:
        check_key_dtype("query", query)
    if query.dtype not in KEY_DTYPES:
        fail("query", f"dtype {query.dtype} is not supported; expected bfloat16, float16, float32, int8 or "
             "float8_e4m3fn", TypeError)
    if key.dtype != query.dtype:
        fail("query", f"a quantised query is scored against keys of its own format: query is {query.dtype} but key is "
             f"{key.dtype} (give a float query, or quantise both alike)")
    if query_dequant_scale is None:
        fail("query_dequant_scale", f"is required for a quantised query ({query.dtype}): one scale per token and head")
    check_tensor("query_dequant_scale", query_dequant_scale)
    if query_dequant_scale.dtype not in SCALE_DTYPES:
        fail("query_dequant_scale", f"dtype {query_dequant_scale.dtype} is not supported; expected torch.float32 or "
             "torch.float16", TypeError)
    if query.dim() == lead_rank + 2 and tuple(query_dequant_scale.shape) != tuple(query.shape[:-1]):
        fail("query_dequant_scale", f"expected one scale per token and head, shape {list(query.shape[:-1])}, got "
             f"{tuple(query_dequant_scale.shape)}")
    return _code_values(query), query_dequant_scale.float()


def _code_values(codes: torch.Tensor) -> torch.Tensor:
    """int8 / FP8 codes -> their exact values as bf16: in the compiled layer on the CPU (PyTorch's own FP8
    conversion is about 50 times slower), else by PyTorch."""
    if codes.device.type == "cpu" and not is_fake(codes):
        from .. import native
        module = native.kernels()
        if module is not None:
            return module.index_codes_bf16(codes.contiguous().view(torch.uint8),
                                           codes.dtype == torch.float8_e4m3fn)
    return codes.to(torch.bfloat16)


def parse_quant_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, topk, quant_mode, kw,
                        content) -> tuple[QuantIndexerProblem, torch.Tensor | None, int]:
    """(``kw``: the op's keyword arguments, a dict of the call's own, which this consumes)"""
    check_lightning_attrs(topk, kw.pop("max_seqlen_q", -1), kw.get("return_value", 0))
    return_value = kw.pop("return_value", 0)
    offset = kw.pop("output_idx_offset", None)
    scale_layout = kw.pop("key_scale_layout", "separate")
    check_choice("quant_mode", quant_mode, QUANT_MODES)
    layout_q, layout_k = kw.get("layout_q", "BSND"), kw.get("layout_k", "BSND")
    check_choice("layout_q", layout_q, ("BSND", "TND"))
    check_choice("layout_k", layout_k, K_LAYOUTS)
    check_tensor("key", key)
    check_key_dtype("key", key)
    rank = 4 if layout_q == "BSND" else 3
    if query.dim() != rank:
        fail("query", f"expected a {rank}-D tensor for layout {layout_q}, got shape {tuple(query.shape)}")
    q, q_scale = _check_query(query, query_dequant_scale, key, rank - 2)
    check_tensor("weights", weights)                # (its dtype and shape: parse_indexer's checks, by these names)
    device = query.device
    if key.device != device:
        fail("key", f"is on {key.device} but query is on {device}; all tensors must be on one device")
    for name, t in (("query_dequant_scale", query_dequant_scale), ("key_dequant_scale", key_dequant_scale)):
        if t is not None and t.device != device:
            fail(name, f"is on {t.device} but query is on {device}; all tensors must be on one device")
    D = query.size(-1)
    if key_dequant_scale is None:            # (scales in the key: its layout alone describes the pool)
        pool, keys = _POOLS.get(key, (layout_k, scale_layout, D, q.dtype),
                                lambda: _pool_and_stand_in(key, None, layout_k, scale_layout, D, q.dtype))
    else:
        pool, keys = _pool_and_stand_in(key, key_dequant_scale, layout_k, scale_layout, D, q.dtype)
    P = parse_indexer(q, keys, weights, k_layouts=K_LAYOUTS, content=content, problem_cls=QuantIndexerProblem,
                      source_cls=QuantKeys, names=("query", "weights"), **{**LIGHTNING_DEFAULTS, **kw})
    P.k.pool, P.k.decode = pool, _decoded
    P.pool, P.q_scale = pool, None if q_scale is None else P.rows.flat(q_scale)
    return P, check_offset(offset, P, layout_q), return_value


def _pool_and_stand_in(key, key_dequant_scale, layout_k: str, scale_layout: str, D: int,
                       dtype: torch.dtype) -> tuple[IndexKeyPool, torch.Tensor]:
    """The pool and a zero-stride tensor of its logical key shape in the query's dtype: what parse_indexer reads
    of the keys (their sizes).  Kept with the pool where it is memoised (a decode step passes the same pools)."""
    pool = index_key_pool(key, key_dequant_scale, layout_k, scale_layout, D)
    logical = (pool.blocks, 1, D) if layout_k == "TND" else (pool.blocks, pool.bs, 1, D)
    return pool, torch.empty((), dtype=dtype, device=pool.values.device).expand(logical)


def _decoded(rows):
    """(QuantKeys.gather decodes; a decoder set marks the source as coded, so that span() gathers through
    it and flat_rows() offers no plain rows)"""
    return rows


_POOLS = TensorMemo()                        # pools with in-place scales, kept with their key tensors


def _kernel(query, key, weights, query_dequant_scale, key_dequant_scale, topk, quant_mode, **kw):
    P, offset, return_value = parse_quant_indexer(query, key, weights, query_dequant_scale, key_dequant_scale,
                                                  topk, quant_mode, kw, None)
    return run_indexer(P, query, topk, offset, return_value, dispatch.quant_lightning_indexer)


def _fake(query, key, weights, query_dequant_scale, key_dequant_scale, topk, quant_mode, **kw):
    _, _, return_value = parse_quant_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, topk,
                                             quant_mode, kw, False)
    shape = tuple(query.shape[:-2]) + (1, topk)
    return (query.new_empty(shape, dtype=torch.int32),
            query.new_empty(shape if return_value else (0,), dtype=torch.float32))


register(QUANT_LIGHTNING_INDEXER_SCHEMA, _kernel, _fake)
