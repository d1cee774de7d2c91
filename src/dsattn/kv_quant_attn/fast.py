"""Vectorised ``kv_quant_sparse_flash_attention`` (40-kv-quant §4.4) for any torch device.

Query rows are processed in blocks sized to a memory budget.  For a block, every listed
sparse block of every row is expanded to its ``sparse_block_size`` candidate tokens, the
candidates' packed rows are gathered by address (never a copy of the cache), unpacked and
dequantised in fp32 (then rounded to the query dtype), and attended with the nope and rope
dot products formed separately (§4.5 makes the rope-0 and rope-64 forms bit-identical).
Shapes depend only on tensor extents, never on tensor values.
"""
from __future__ import annotations

import torch

from ..common.checks import content_checks_enabled
from ..common.memory import empty_output
from ..common.softmax import round_q, softmax_with_sink
from ..quant.rows import KV_LORA_RANK, TILE_SIZE, unpack_kv_rows
from ..quant.tokens import PackedTokens
from ..sparse_mla import rows
from .problem import QsfaProblem, candidate_tokens

BUDGET_BYTES = 32 << 20


def _rows_per_block(P: QsfaProblem) -> int:
    H = P.query.size(-2)
    per_row = P.width * (P.kv.D + 4 * (2 * KV_LORA_RANK + P.R) + 3 * 4 * H)
    return max(1, min(P.rows.R, BUDGET_BYTES // max(per_row, 1)))


def compiled_tokens(P: QsfaProblem):
    """The packed cache as the compiled CPU kernel reads it in place (each listed token decoded as it
    is gathered), where that kernel runs: CPU, half-precision queries, rows one after another."""
    q = P.query
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    tokens = PackedTokens.from_rows(P.kv.tensor, P.R, TILE_SIZE, q.dtype)
    if tokens is None or rows.Compiled.reasons(q, [tokens], False):
        return None
    return tokens


def _forward_compiled(P: QsfaProblem, tokens, want_stats: bool):
    """Rows in blocks: each row's candidate tokens as index tables, attended by the compiled kernel
    (K = the 576-wide key, V its first 512 columns: the dequantised nope part), which also returns
    the softmax's shift and denominator (softmax_max / softmax_sum)."""
    q = P.query
    qf = P.rows.flat(q)
    R, H, _ = qf.shape
    out = empty_output(R, H, KV_LORA_RANK, dtype=q.dtype, device=q.device)
    smax = torch.empty(R, H, dtype=torch.float32, device=q.device)    # two tensors: returns must not alias
    ssum = torch.empty(R, H, dtype=torch.float32, device=q.device)
    step = max(1, min(R, (32 << 20) // (24 * max(P.width, 1))))   # the key addresses of a block: ~24 B a slot
    check = content_checks_enabled(P.query, P.kv.tensor)
    for t0 in range(0, R, step):
        t1 = min(R, t0 + step)
        b, tok, mask = candidate_tokens(P, t0, t1)
        flat = P.kv.rows_index(b[:, None], tok, mask, check=check)          # paged CPU caches: one compiled call
        o, _, _, st = rows.attend_rows(qf[t0:t1], [tokens], [flat.contiguous()], scale=P.scale, sinks=P.sinks,
                                       want_stats=True)
        out[t0:t1] = o[..., :KV_LORA_RANK]
        smax[t0:t1] = st[0]
        ssum[t0:t1] = st[1]
    return _results(P, out, smax, ssum, want_stats)


def _results(P: QsfaProblem, out, smax, ssum, want_stats: bool):
    """The op's outputs from the flattened rows: the attention, and the statistics or empty tensors."""
    attn = P.rows.unflat(out, P.query)
    if not want_stats:
        empty = torch.zeros(0, dtype=torch.float32, device=out.device)
        return attn, empty, empty.clone()
    return attn, smax.reshape(P.stats_shape()), ssum.reshape(P.stats_shape())


def forward_compiled(P: QsfaProblem, want_stats: bool):
    """The compiled CPU kernel, the packed tokens decoded as they are gathered."""
    return _forward_compiled(P, compiled_tokens(P), want_stats)


def forward_torch(P: QsfaProblem, want_stats: bool):
    """The vectorised PyTorch path: blocks of rows, their candidate tokens dequantised here."""
    q = P.query
    qf = P.rows.flat(q)
    R, H, _ = qf.shape
    dev = q.device
    out = empty_output(R, H, KV_LORA_RANK, dtype=q.dtype, device=dev)
    smax = torch.empty(R, H, dtype=torch.float32, device=dev)
    ssum = torch.empty(R, H, dtype=torch.float32, device=dev)
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    step = _rows_per_block(P)
    check = content_checks_enabled(P.query, P.kv.tensor)
    for t0 in range(0, R, step):
        t1 = min(R, t0 + step)
        b, tok, mask = candidate_tokens(P, t0, t1)
        i0, i1 = P.kv.locate(b[:, None], tok, mask, check=check)
        packed = P.kv.gather(i0, i1)                                   # [n, W, row bytes]
        nope, rope, scales = unpack_kv_rows(packed, P.R, q.dtype)
        knope = nope.float().unflatten(-1, (-1, TILE_SIZE)) * scales[..., None]
        knope = round_q(knope.flatten(-2), q.dtype)
        knope = torch.where(mask[..., None], knope, zero)              # unselected rows may hold NaN bytes
        qb = qf[t0:t1].float()
        s = torch.einsum("rhd,rwd->rhw", qb[..., :KV_LORA_RANK].contiguous(), knope)
        if P.R:
            kr = torch.where(mask[..., None], rope.float(), zero)
            s = s + torch.einsum("rhd,rwd->rhw", qb[..., KV_LORA_RANK:].contiguous(), kr)
        s = P.scale * s
        e, l, m = softmax_with_sink(s, mask, P.sinks)
        o = torch.einsum("rhw,rwd->rhd", round_q(e, q.dtype), knope) / l[..., None]
        ok = mask.any(-1)[:, None]
        out[t0:t1] = torch.where(ok[..., None], o, zero).to(q.dtype)
        smax[t0:t1] = torch.where(ok, m, zero)
        ssum[t0:t1] = torch.where(ok, l, zero)
    return _results(P, out, smax, ssum, want_stats)
