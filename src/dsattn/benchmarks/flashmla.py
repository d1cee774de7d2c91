"""FlashMLA's API (:mod:`dsattn.flashmla`) against the operators on the same work: the same queries,
keys, sinks and scale, each through its own interface (FlashMLA's flat pool indices and FP8 cache
layouts; the operators' block tables and packed rows): V4 CSA decode (bf16, FP8 V4), one-request V4 CSA /
HCA decode, V3.2 decode (FP8 V3.2 against QSFA), a V4 CSA prefill.  The ratio is the API's time over the
operator's; the outputs are checked to agree (the bf16 cross-order rule)."""
from __future__ import annotations

import torch

from .. import flashmla, ops
from ..quant import flashmla as F
from ..testing import compare
from . import workloads
from .harness import Result, timeit

DECODE_CALLS = 20


def pool_indices(table: torch.Tensor, positions: torch.Tensor, block: int) -> torch.Tensor:
    """Logical positions ``[B, ..., K]`` (-1 kept) -> FlashMLA's flat pool indices through ``table [B, P]``."""
    B = table.size(0)
    safe = positions.clamp(min=0).reshape(B, -1).to(torch.int64)
    flat = table.to(torch.int64).gather(1, safe // block) * block + safe % block
    return torch.where(positions.reshape(B, -1) >= 0, flat, -1).view(positions.shape).to(torch.int32)


def decode_call(q, kw):
    """A V4 decode step (:func:`workloads.decode`) as FlashMLA's sparse decode: the window's raw tokens
    through ``indices`` into the raw cache, the compressed tokens it reads (CSA's top-k, HCA's every
    entry) through ``extra_indices_in_kvcache`` into the compressed cache."""
    B = q.size(0)
    win, cmp = workloads.step_positions(kw)
    main = pool_indices(kw["ori_block_table"], win, kw["ori_kv"].size(1))
    extra = pool_indices(kw["cmp_block_table"], cmp, kw["cmp_kv"].size(1))
    return dict(indices=main.view(B, 1, -1), extra_indices_in_kvcache=extra.view(B, 1, -1), attn_sink=kw["sinks"],
                softmax_scale=kw["softmax_scale"])


def _flash_decode(q, k_cache, extra_cache, call, fp8):
    meta, _ = flashmla.get_mla_metadata()
    return lambda: flashmla.flash_mla_with_kvcache(q, k_cache, None, None, q.size(-1), meta, is_fp8_kvcache=fp8,
                                                   extra_k_cache=extra_cache, **call)[0]


def decode_rows(results, B=32, fixed=65536, calls=DECODE_CALLS):
    q, kw, flops, _ = workloads.decode(B=B, ratio=4, fixed=fixed, seed=2)
    nbytes = workloads.decode_bytes(q, kw)
    name = f"decode CSA V4-Flash B{B} @{fixed // 1024}K bf16 caches"
    op = lambda: ops.sparse_flash_mla(q, **kw)[0]                                     # noqa: E731
    api = _flash_decode(q, kw["ori_kv"], kw["cmp_kv"], decode_call(q, kw), False)
    t_op, t_api = timeit(op, repeat=calls), timeit(api, repeat=calls)
    match = bool(compare(api()[:, 0], op()[:, 0]))
    results.append(Result("flashmla", name, "sparse_flash_mla (operator)", t_op, flops / 1e9, bytes=nbytes))
    results.append(Result("flashmla", name, "flash_mla_with_kvcache", t_api, flops / 1e9, bytes=nbytes,
                          note=f"API / operator {t_api / t_op:.2f}x", extra={"matches_operator": match}))
    # FlashMLA's V4 FP8 layout (584 B / token) against the operator over packed rows of the same payload
    ori8, cmp8 = F.quantize_cache(kw["ori_kv"], F.V4), F.quantize_cache(kw["cmp_kv"], F.V4)
    qt, args = workloads.sharedkv_args(q, kw, F.to_packed_rows(ori8), F.to_packed_rows(cmp8))
    row = args["cmp_kv"].size(-1)
    nbytes8 = workloads.decode_bytes(q, dict(kw, ori_kv=args["ori_kv"], cmp_kv=args["cmp_kv"]))
    name8 = f"decode CSA V4-Flash B{B} @{fixed // 1024}K FP8 caches"
    op8 = lambda: ops.sparse_attn_sharedkv_packed(qt, kv_rope_dim=64, kv_tile_size=64, **args)[0]   # noqa: E731
    api8 = _flash_decode(q, ori8, cmp8, decode_call(q, kw), True)
    t_op, t_api = timeit(op8, repeat=calls), timeit(api8, repeat=calls)
    match = bool(compare(api8()[:, 0], op8()))
    results.append(Result("flashmla", name8, f"sparse_attn_sharedkv_packed ({row} B rows)", t_op, flops / 1e9,
                          bytes=nbytes8))
    results.append(Result("flashmla", name8, "flash_mla_with_kvcache (V4 584 B layout)", t_api, flops / 1e9,
                          bytes=nbytes8, note=f"API / operator {t_api / t_op:.2f}x",
                          extra={"matches_operator": match}))


def v32_decode_rows(results, B=32, topk=2048, ctx=65536, heads=128, block=64, pool_blocks=512, calls=DECODE_CALLS):
    """V3.2 decode (128 heads, d 576, value 512, top-2048 of the context) over FlashMLA's V3.2 FP8 cache
    (656 B / token) against ``kv_quant_sparse_flash_attention`` over dsattn's packed rows holding the
    same payload, scales and rope (656 B too, another field order)."""
    g = torch.Generator().manual_seed(3)
    keys = (torch.randn(pool_blocks, block, 1, 576, generator=g) * 0.5).bfloat16()
    v32 = F.quantize_cache(keys, F.V32)
    rows = F.to_packed_rows(v32)
    table = torch.randint(0, pool_blocks, (B, ctx // block), generator=g, dtype=torch.int32)
    pos = torch.rand(B, ctx, generator=g).topk(topk, -1).indices                   # distinct positions
    q = (torch.randn(B, 1, heads, 576, generator=g) * 0.1).bfloat16()
    idx = pos.to(torch.int32).view(B, 1, 1, topk)
    scale = 576 ** -0.5
    kw = dict(block_table=table, actual_seq_lengths_kv=torch.full((B,), ctx, dtype=torch.int32),
              layout_query="BSND", layout_kv="PA_BSND", sparse_mode=3, scale_value=scale, rope_head_dim=64)
    flat = pool_indices(table, pos, block).view(B, 1, topk)
    meta, _ = flashmla.get_mla_metadata()
    op = lambda: ops.kv_quant_sparse_flash_attention(q, rows, rows, idx, **kw)[0]      # noqa: E731
    api = lambda: flashmla.flash_mla_with_kvcache(q, v32, None, None, 512, meta, softmax_scale=scale,  # noqa: E731
                                                  is_fp8_kvcache=True, indices=flat)[0]
    flops = 2 * B * heads * topk * (576 + 512)
    nbytes = B * topk * 656 + B * heads * (576 + 512) * 2
    t_op, t_api = timeit(op, repeat=calls), timeit(api, repeat=calls)
    match = bool(compare(api(), op()))
    name = f"decode V3.2 B{B} top-{topk} @{ctx // 1024}K FP8 656 B"
    results.append(Result("flashmla", name, "kv_quant_sparse_flash_attention (operator)", t_op, flops / 1e9,
                          bytes=nbytes))
    results.append(Result("flashmla", name, "flash_mla_with_kvcache (V3.2 layout)", t_api, flops / 1e9, bytes=nbytes,
                          note=f"API / operator {t_api / t_op:.2f}x", extra={"matches_operator": match}))


def prefill_rows(results, L=4096):
    """A V4 CSA prefill as FlashMLA's sparse prefill: one key buffer (raw rows, then compressed rows)
    and per query row its 128 window rows and top-512 compressed rows as indices into it."""
    q, kw, flops = workloads.prefill(L, ratio=4)
    ori, cmp = kw["ori_kv"][0], kw["cmp_kv"][0]
    kv = torch.cat([ori, cmp])                                                        # [L + L/4, 1, D]
    pos = torch.arange(L)
    win = pos[:, None] - workloads.WINDOW + 1 + torch.arange(workloads.WINDOW)[None]
    idx = kw["cmp_sparse_indices"][0, :, 0].to(torch.int64)
    indices = torch.cat([torch.where(win >= 0, win, -1), torch.where(idx >= 0, L + idx, -1)], 1)
    indices = indices.to(torch.int32)[:, None, :]
    op = lambda: ops.sparse_flash_mla(q, **kw)[0]                                     # noqa: E731
    api = lambda: flashmla.flash_mla_sparse_fwd(q[0], kv, indices, kw["softmax_scale"], d_v=q.size(-1),  # noqa: E731
                                                attn_sink=kw["sinks"])[0]
    t_op, t_api = timeit(op, repeat=1), timeit(api, repeat=1)
    match = bool(compare(api(), op()[0]))
    name = f"prefill CSA {L // 1024}K"
    results.append(Result("flashmla", name, "sparse_flash_mla (operator)", t_op, flops / 1e9))
    results.append(Result("flashmla", name, "flash_mla_sparse_fwd", t_api, flops / 1e9,
                          note=f"API / operator {t_api / t_op:.2f}x", extra={"matches_operator": match}))


SINGLE_CALLS = 200


def single_request_rows(results, fixed=8192, calls=SINGLE_CALLS):
    """One request (B 1), V4-Flash CSA and HCA decode: where a step's fixed cost (argument checks, key
    tables, allocations) weighs most.  The operators (bf16 and packed FP8 rows) and FlashMLA's API (bf16 and
    V4 FP8) beside the operator's Python path (its one-step compiled path turned off), median of ``calls``."""
    from ..sharedkv import compiled
    for ratio, kind in ((4, "CSA"), (128, "HCA")):
        q, kw, flops, _ = workloads.decode(B=1, ratio=ratio, fixed=fixed, seed=2)
        qt, plain = workloads.sharedkv_args(q, kw)
        ori8, cmp8 = F.quantize_cache(kw["ori_kv"], F.V4), F.quantize_cache(kw["cmp_kv"], F.V4)
        _, packed = workloads.sharedkv_args(q, kw, F.to_packed_rows(ori8), F.to_packed_rows(cmp8))
        name = f"decode {kind} V4-Flash B1 @{fixed // 1024}K"
        nbytes = workloads.decode_bytes(q, kw)
        nbytes8 = workloads.decode_bytes(q, dict(kw, ori_kv=packed["ori_kv"], cmp_kv=packed["cmp_kv"]))
        op = lambda: ops.sparse_attn_sharedkv(qt, **plain)[0]                                          # noqa: E731
        t_op = timeit(op, repeat=calls, warmup=5)
        step, compiled.run = compiled.run, (lambda *a: None)
        try:
            t_py = timeit(op, repeat=calls, warmup=5)
        finally:
            compiled.run = step
        call = decode_call(q, kw)
        t_api = timeit(_flash_decode(q, kw["ori_kv"], kw["cmp_kv"], call, False), repeat=calls, warmup=5)
        op8 = lambda: ops.sparse_attn_sharedkv_packed(qt, kv_rope_dim=64, kv_tile_size=64, **packed)[0]  # noqa: E731
        t_op8 = timeit(op8, repeat=calls, warmup=5)
        t_api8 = timeit(_flash_decode(q, ori8, cmp8, call, True), repeat=calls, warmup=5)
        results.append(Result("flashmla", name, "sparse_attn_sharedkv bf16 (one compiled step)", t_op, flops / 1e9,
                              bytes=nbytes))
        results.append(Result("flashmla", name, "sparse_attn_sharedkv bf16, Python path", t_py, flops / 1e9,
                              bytes=nbytes, note=f"{t_py / t_op:.1f}x the one-step call"))
        results.append(Result("flashmla", name, "flash_mla_with_kvcache bf16", t_api, flops / 1e9, bytes=nbytes,
                              note=f"API / operator {t_api / t_op:.2f}x"))
        results.append(Result("flashmla", name, "sparse_attn_sharedkv_packed FP8 (one compiled step)", t_op8,
                              flops / 1e9, bytes=nbytes8))
        results.append(Result("flashmla", name, "flash_mla_with_kvcache FP8 V4", t_api8, flops / 1e9, bytes=nbytes8,
                              note=f"API / operator {t_api8 / t_op8:.2f}x"))


def run(smoke: bool = False, results=None) -> list[Result]:
    results = [] if results is None else results
    if smoke:
        decode_rows(results, B=2, fixed=4096, calls=1)
        single_request_rows(results, fixed=2048, calls=1)
        v32_decode_rows(results, B=2, topk=64, ctx=1024, heads=16, pool_blocks=32, calls=1)
        prefill_rows(results, L=256)
    else:
        decode_rows(results)
        single_request_rows(results)
        v32_decode_rows(results)
        prefill_rows(results)
    return results
