"""Triton path of ``kv_quant_sparse_flash_attention`` (issue 13, item 3): the packed rows are
dequantised inside the attention kernel.

It is the two-branch forward kernel of :mod:`dsattn.sparse_mla.triton` with one key source: a
row's keys are its candidate tokens (every listed sparse block, whole, masked by causality and the
KV length: :func:`dsattn.kv_quant_attn.problem.candidate_tokens`), passed as byte offsets of their
packed rows (656 bytes with a 64-wide rope, 528 without).  The kernel loads the bytes, decodes
int8 / fp8 e4m3fn, scales each 128-wide tile, rounds once to the query dtype (the golden's point),
and splits the head dim exactly where the format does: the 512 dequantised columns (key and
value) and the rope tail (key only), so the two score dots are the golden's nope and rope dots.
Statistics are the maximum and the sum (``softmax_max`` / ``softmax_sum``), not an LSE.
"""
from __future__ import annotations

import torch

from ..common.checks import content_checks_enabled
from ..quant.rows import KV_LORA_RANK, TILE_SIZE, PackedKV
from ..sparse_mla.triton import ADDRESS_BUDGET, RowAttention, device_target, head_split, kernel_covers
from .problem import QsfaProblem, candidate_tokens


def supports(P: QsfaProblem) -> bool:
    t = P.kv.tensor
    D = KV_LORA_RANK + P.R
    return (head_split(D)[0] == KV_LORA_RANK and kernel_covers(P.query.dtype, D, True, *device_target(t.device))
            and t.stride(-1) == 1 and t.data_ptr() % 4 == 0
            and all(t.stride(i) % 4 == 0 for i in range(t.dim() - 1)) and P.R % 2 == 0)


def forward(P: QsfaProblem, want_stats: bool, splits: int | None = None):
    q = P.query
    qf = P.rows.flat_unit_stride(q)
    R = qf.size(0)
    att = RowAttention(qf, [P.kv.tensor], KV_LORA_RANK + P.R, P.sinks, P.scale, packed=PackedKV(P.R, TILE_SIZE),
                       value_tail=False, stats=True, splits=splits)
    out, smax, ssum = att.outputs(R)
    check = content_checks_enabled(P.query, P.kv.tensor)
    step = max(1, min(R, ADDRESS_BUDGET // (8 * max(1, P.width)))) if R else 1
    for t0 in range(0, R, step):
        t1 = min(R, t0 + step)
        b, tok, mask = candidate_tokens(P, t0, t1)
        addr = P.kv.locate(b[:, None], tok, mask, check=check)
        att.run(t0, t1, att.offsets(P.kv, addr, mask).contiguous(), out, smax, ssum)
    attn = P.rows.unflat(out.to(q.dtype), q)
    if not want_stats:
        empty = torch.zeros(0, dtype=torch.float32, device=q.device)
        return attn, empty, empty.clone()
    return attn, smax.reshape(P.stats_shape()), ssum.reshape(P.stats_shape())
