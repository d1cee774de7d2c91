"""Indexer, backward and quantised-attention benchmarks."""
from __future__ import annotations

import time

import torch

from .. import native, ops, reference
from ..quant.rows import pack_kv_rows, quantize_kv_rows
from ..quant.block import quantize_tiles
from . import workloads
from .harness import Result, peak_rss_growth_mb, reused_pages_result, timeit


def _indexer_decode(B=32, ctx=131072, heads=64, dim=128, topk=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    Kc = ctx // 4
    q = torch.randn(B, 1, heads, dim, generator=g).bfloat16()
    k = torch.randn(B, Kc, 1, dim, generator=g).bfloat16()
    w = torch.rand(B, 1, heads, generator=g) * 0.01
    kw = dict(layout_q="BSND", layout_k="BSND", mask_mode=3, cmp_ratio=4,
              seqused_k=torch.full((B,), Kc, dtype=torch.int32), cmp_residual_k=torch.zeros(B, dtype=torch.int32))
    return q, k, w, topk, kw, 2 * B * heads * Kc * dim


def _indexer_prefill(L=8192, heads=64, dim=128, topk=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    Kc = L // 4
    q = torch.randn(1, L, heads, dim, generator=g).bfloat16()
    k = torch.randn(1, Kc, 1, dim, generator=g).bfloat16()
    w = torch.rand(1, L, heads, generator=g) * 0.01
    kw = dict(layout_q="BSND", layout_k="BSND", mask_mode=3, cmp_ratio=4,
              cmp_residual_k=torch.zeros(1, dtype=torch.int32))
    visible = ((torch.arange(L) + 1) // 4).sum().item()
    return q, k, w, topk, kw, 2 * heads * visible * dim


def indexer_chunk_memory(ctx: int, rows: int, L: int = 8192, heads: int = 64, dim: int = 128, topk: int = 512):
    """Rows ``[L - rows, L)`` of an ``L``-token prefill chunk that ends at position ``ctx`` (so its
    compressed keys are ``ctx / 4``), run once; returns the RSS after building the inputs
    (``peak_rss_growth_mb`` subtracts it from the peak).  The last rows see the most keys."""
    from .harness import current_rss_mb
    g = torch.Generator().manual_seed(0)
    Kc = ctx // 4
    q = torch.randn(1, rows, heads, dim, generator=g).bfloat16()
    k = torch.randn(1, Kc, 1, dim, generator=g).bfloat16()
    w = torch.rand(1, rows, heads, generator=g) * 0.01
    kw = dict(layout_q="BSND", layout_k="BSND", mask_mode=3, cmp_ratio=4, seqused_k=torch.tensor([Kc], dtype=torch.int32),
              cmp_residual_k=torch.zeros(1, dtype=torch.int32))
    base = current_rss_mb()
    t = __import__("time").perf_counter()
    ops.lightning_indexer(q, k, w, topk, **kw)
    return {"base_rss_mb": base, "seconds": __import__("time").perf_counter() - t,
            "inputs_mb": (q.numel() * 2 + k.numel() * 2 + w.numel() * 4) / 2 ** 20}


def quantised_index_call(q, k, kw, key_dtype, bs: int = 64):
    """The same keys as a paged quantised pool: FP8 in vLLM's block layout (values, then fp32 scales, per block
    of ``bs`` tokens), int8 with its scales in their own tensor (the Ascend pool) -> ``(key, key_scale, kwargs)``
    for ``quant_lightning_indexer``."""
    from ..quant.index_keys import pack_index_blocks, quantize_index_keys
    B, Kc, _, D = k.shape
    per = -(-Kc // bs)
    blocks = torch.zeros(B, per * bs, D, dtype=torch.float32)
    blocks[:, :Kc] = k[:, :, 0].float()
    values, scales = quantize_index_keys(blocks.view(B * per, bs, D), key_dtype)
    kw = dict(kw, layout_k="PA_BBND", block_table=torch.arange(B * per, dtype=torch.int32).view(B, per),
              seqused_k=kw.get("seqused_k", torch.full((B,), Kc, dtype=torch.int32)))
    if key_dtype == torch.float8_e4m3fn:
        return pack_index_blocks(values, scales), None, dict(kw, key_scale_layout="block")
    return values[:, :, None], scales[:, :, None], dict(kw, key_scale_layout="separate")


def indexer(smoke=False, results=None):
    results = [] if results is None else results
    builds = [("smoke decode B2 2K", lambda: _indexer_decode(B=2, ctx=2048))] if smoke else [
        ("decode B32 @128K (32K keys)", _indexer_decode), ("prefill 8K", _indexer_prefill)]
    for name, build in builds:
        q, k, w, topk, kw, flops = build()
        t = timeit(lambda: ops.lightning_indexer(q, k, w, topk, **kw), repeat=2)
        # the share of top-k selection: time the scores alone (same math as the kernel's first stage)
        qf, kf = q.float(), k.float()
        def scores():
            s = torch.relu(torch.einsum("bshd,bkd->bshk", qf, kf[:, :, 0]))
            return torch.einsum("bshk,bsh->bsk", s, w)
        ts = timeit(scores, repeat=2)
        s = scores()
        tk = timeit(lambda: torch.topk(s, topk, dim=-1), repeat=2)
        results.append(Result("indexer", name, "dsattn", t, flops / 1e9,
                              note=f"PyTorch's top-k alone {tk:.3f} s, its scores alone {ts:.3f} s"))
        if native.kernels() is not None:          # the PyTorch path the compiled kernel replaces, beside it
            with native.suspended():
                tp = timeit(lambda: ops.lightning_indexer(q, k, w, topk, **kw), repeat=2)
            results.append(Result("indexer", name, "PyTorch path (DSATTN_NATIVE=0)", tp, flops / 1e9))
        # quant_lightning_indexer on the same keys quantised, read in place (half the bytes of bf16 for FP8)
        for label, key_dtype in (("FP8 keys, vLLM block layout", torch.float8_e4m3fn),
                                 ("int8 keys, separate scales", torch.int8)):
            key, key_scale, qkw = quantised_index_call(q, k, kw, key_dtype)
            tq = timeit(lambda: ops.quant_lightning_indexer(q, key, w, None, key_scale, topk, 0, **qkw), repeat=2)
            results.append(Result("indexer", name, f"quant_lightning_indexer ({label})", tq, flops / 1e9,
                                  note=f"{tq / t:.2f}x the bf16 lightning_indexer's time"))
        if smoke:
            gi, _ = reference.lightning_indexer(q, k, w, topk, **kw)
            fi, _ = ops.lightning_indexer(q, k, w, topk, **kw)
            same = (torch.sort(fi, -1)[0] == torch.sort(gi, -1)[0]).float().mean()
            results[-1].extra["matches_golden_sets"] = bool(same > 0.99)
    if not smoke:
        # peak memory of the indexer in a fresh process: the working set is O(rows x topk) plus a fixed
        # score budget whatever the context (the last 512 rows of the chunk at 1M: 8K rows there are ~10 min)
        for ctx, rows in ((131072, 8192), (1048576, 512)):
            r = peak_rss_growth_mb("dsattn.benchmarks.others", "indexer_chunk_memory", {"ctx": ctx, "rows": rows})
            name = f"8K prefill chunk at {ctx // 1024}K context (last {rows} rows, fresh process)"
            if "error" in r:
                results.append(Result("indexer", name, "dsattn", float("nan"), note=f"failed: {r['error']}"))
                continue
            growth = r["peak_rss_mb"] - r["base_rss_mb"]
            results.append(Result("indexer", name, "dsattn", r["seconds"], 2 * rows * 64 * (ctx // 4) * 128 / 1e9,
                                  peak_mb=growth, note=f"inputs {r['inputs_mb']:.0f} MB; outputs "
                                  f"{rows * 512 * 8 / 2 ** 20:.0f} MB; a [rows, keys] fp32 score buffer would be "
                                  f"{rows * (ctx // 4) * 4 / 2 ** 20:.0f} MB"))
    return results


def _training_inputs(L: int):
    q, kw, flops = workloads.prefill(L, ratio=4)
    return q, kw, torch.randn(q.shape).bfloat16() * 0.1, flops * 3.5   # backward: recompute S, dP, dQ, dK, dV


def _training_step_seconds(q, kw, dout, repeat: int = 1) -> tuple[float, float]:
    """(forward, grad) seconds of one CSA training step."""
    o, lse = ops.sparse_flash_mla(q, return_softmax_lse=True, **kw)
    t_f = timeit(lambda: ops.sparse_flash_mla(q, return_softmax_lse=True, **kw), repeat=repeat)
    t_b = timeit(lambda: ops.sparse_flash_mla_grad(q, dout, o, lse, **kw), repeat=repeat)
    return t_f, t_b


def training_step_run(L: int) -> dict:
    """Subprocess entry (run with REUSED_PAGES_ENV): the step's median seconds over 3 calls after a first."""
    from .harness import current_rss_mb
    q, kw, dout, flops = _training_inputs(L)
    t_f, t_b = _training_step_seconds(q, kw, dout, repeat=3)
    return {"seconds": t_f + t_b, "base_rss_mb": current_rss_mb(), "gflop": flops / 1e9,
            "note": f"forward {t_f:.2f} s, grad {t_b:.2f} s"}


def backward(smoke=False, results=None):
    results = [] if results is None else results
    L = 256 if smoke else 4096
    q, kw, dout, flops = _training_inputs(L)
    name = f"CSA training step {L // 1024 or L}{'K' if L >= 1024 else ''} tokens"

    def step(variant):
        t_f, t_b = _training_step_seconds(q, kw, dout)
        results.append(Result("backward", name, variant, t_f + t_b, flops / 1e9,
                              note=f"forward {t_f:.2f} s, grad {t_b:.2f} s; FLOPs = forward x 3.5"))
    step("dsattn fwd + grad")
    if native.kernels() is not None and not smoke:      # the PyTorch path the compiled kernels replace
        with native.suspended():
            step("PyTorch path (DSATTN_NATIVE=0)")
        results.append(reused_pages_result("backward", name, "dsattn.benchmarks.others", "training_step_run",
                                           {"L": L}))
    return results


def kv_quant(smoke=False, results=None):
    results = [] if results is None else results
    sharedkv_packed(smoke, results)
    B, topk, heads, block = (2, 64, 16, 128) if smoke else (32, 2048, 128, 128)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(4096 if smoke else 16384, (8192 if smoke else 131072) + 1, (B,), generator=g)
    nb = 512 if not smoke else 64
    lat = torch.randn(nb * block, 512, generator=g)
    y, s = quantize_tiles(lat, torch.int8, 128)
    rope = torch.randn(nb * block, 64, generator=g).bfloat16()
    cache = pack_kv_rows(y, s, rope).reshape(nb, block, 1, 656)
    nbt = int(ctx.max()) // block + 1
    table = torch.randint(0, nb, (B, nbt), generator=g, dtype=torch.int32)
    q = (torch.randn(B, 1, heads, 576, generator=g) * 0.1).bfloat16()
    idx = (torch.rand(B, 1, 1, topk, generator=g) * ctx.view(B, 1, 1, 1)).to(torch.int32)
    kw = dict(block_table=table, actual_seq_lengths_kv=ctx.to(torch.int32), layout_query="BSND",
              layout_kv="PA_BSND", sparse_mode=3, scale_value=576 ** -0.5, rope_head_dim=64)
    flops = 2 * B * heads * topk * (576 + 512)
    t = timeit(lambda: ops.kv_quant_sparse_flash_attention(q, cache, cache, idx, **kw), repeat=2)
    results.append(Result("kv_quant", f"QSFA decode B{B} top-{topk} int8 656 B rows PA_BSND block {block}",
                          "dsattn", t, flops / 1e9, note=f"{heads} heads (V3.2 128 / TP1)"))
    if smoke:
        t0 = time.perf_counter()
        want = reference.kv_quant_sparse_flash_attention(q, cache, cache, idx, **kw)[0]
        got = ops.kv_quant_sparse_flash_attention(q, cache, cache, idx, **kw)[0]
        from ..testing import compare
        results[-1].extra["matches_golden"] = bool(compare(got, want))
        results.append(Result("kv_quant", results[-1].workload, "golden", time.perf_counter() - t0, flops / 1e9))
    return results


def _sharedkv_decode(B, ratio, fixed=None):
    """The attention decode workload as ``sparse_attn_sharedkv`` arguments (TND q, PA_ND caches)."""
    q, kw, flops, _ = workloads.decode(B=B, ratio=ratio, fixed=fixed)
    return (*workloads.sharedkv_args(q, kw), flops)


def sharedkv_packed(smoke=False, results=None):
    """V4 decode over packed int8 window / compressed caches (604-byte rows: 448 nope in tiles of
    64, bf16 rope 64, fp32 scales) against the same step over bf16 caches (1024-byte rows)."""
    results = [] if results is None else results
    B = 2 if smoke else 32
    for ratio, name in ((4, "CSA"), (128, "HCA")):
        q, args, flops = _sharedkv_decode(B, ratio, fixed=2048 if smoke else None)
        packed = dict(args, **{k: quantize_kv_rows(args[k][..., 0, :], 64, torch.int8, 64)[..., None, :]
                               for k in ("ori_kv", "cmp_kv")})
        workload = f"V4 decode B{B} {name} sharedkv, PA_ND (bf16 vs int8 packed cache)"
        t = timeit(lambda: ops.sparse_attn_sharedkv(q, **args), repeat=2)
        tp = timeit(lambda: ops.sparse_attn_sharedkv_packed(q, kv_rope_dim=64, kv_tile_size=64, **packed), repeat=2)
        rb, rp = args["cmp_kv"].stride(1) * 2, packed["cmp_kv"].size(-1)
        results.append(Result("kv_quant", workload, "dsattn", t, flops / 1e9, note=f"bf16 rows {rb} B"))
        results.append(Result("kv_quant", workload, "dsattn packed int8", tp, flops / 1e9,
                              note=f"int8 rows {rp} B: {rb / rp:.2f}x tokens per cache byte"))
        if smoke:
            got, _ = ops.sparse_attn_sharedkv_packed(q, kv_rope_dim=64, kv_tile_size=64, **packed)
            want, _ = reference.sparse_attn_sharedkv_packed(q, kv_rope_dim=64, kv_tile_size=64, **packed)
            from ..testing import compare
            results[-1].extra["matches_golden"] = bool(compare(got, want))
    return results


def _plan_workload(S1, S2, scenario):
    cu = [0]
    for s in S1:
        cu.append(cu[-1] + s)
    sc = {"CSA": dict(cmp_ratio=4, cmp_topk=512), "HCA": dict(cmp_ratio=128, cmp_topk=0),
          "SWA": dict(has_cmp_kv=False, cmp_ratio=1)}[scenario]
    return dict(num_heads_q=64, num_heads_kv=1, head_dim=512, layout_q="TND", layout_kv="PA_ND",
                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), seqused_kv=torch.tensor(S2, dtype=torch.int32),
                aic_core_num=24, aiv_core_num=48, support_fd=True, ori_win_left=127, **sc)


def planner(smoke=False, results=None):
    """The metadata planner (issue 15): one serving step's plan from the CPU mirrors to the 1024-int32
    table, through the golden (Python), the NumPy fast planner and the compiled planner, in one run
    (median of many calls; the golden only on the small workloads)."""
    import random
    import time

    from .. import native
    from ..planner import fast, native as native_planner, ref
    from ..planner.params import plan_params
    from ..planner.table import encode
    results = [] if results is None else results
    rng = random.Random(0)
    decode = (256, [1] * 256, [rng.randint(1000, 65536) for _ in range(256)])
    mixed = (64, [8192] * 4 + [1] * 60, [8192] * 4 + [rng.randint(1000, 65536) for _ in range(60)])
    workloads = [("decode B32", 32, [1] * 32, [rng.randint(1000, 65536) for _ in range(32)], "CSA")] if smoke else [
        ("decode B256", *decode, "CSA"), ("decode B256", *decode, "HCA"),
        ("mixed 4x8K prefill + 60 decode", *mixed, "CSA"), ("mixed 4x8K prefill + 60 decode", *mixed, "HCA"),
        ("mixed 4x8K prefill + 60 decode", *mixed, "SWA")]
    module = native.load()

    def median_s(fn, n):
        fn()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return sorted(ts)[len(ts) // 2]

    def args_of(kw):
        a = dict(kw)
        return a.pop("num_heads_q"), a.pop("num_heads_kv"), a.pop("head_dim"), a

    for name, B, S1, S2, scenario in workloads:
        h, hk, d, rest = args_of(_plan_workload(S1, S2, scenario))
        pp = plan_params(h, hk, d, **rest)
        m_blocks = sum(len(ref.batch_rows(pp, b)) for b in range(pp.B))
        # the path build_table takes is the default: the compiled planner where it is loaded
        numpy_name = "NumPy fast planner" if module is not None else "dsattn (default): NumPy fast planner"
        variants = [(numpy_name, lambda: encode(fast.plan(plan_params(h, hk, d, **rest))), 10)]
        if module is not None:
            variants.append(("dsattn (default): compiled planner",
                             lambda: native_planner.plan_table(module, h, hk, d, **rest), 200))
        if smoke or "mixed" not in name:
            variants.insert(0, ("golden (Python)", lambda: encode(ref.plan(plan_params(h, hk, d, **rest))), 3))
        tables = {}
        for variant, fn, n in variants:
            tables[variant] = fn()
            results.append(Result("planner", f"{name}, {scenario} (64 heads, {m_blocks} m-blocks)", variant,
                                  median_s(fn, n)))
        first = next(iter(tables.values()))
        same = all(torch.equal(t, first) for t in tables.values())
        for r in results[-len(variants):]:
            r.note = f"{1e6 * r.seconds:.0f} us per plan; tables identical: {same}"
    return results
