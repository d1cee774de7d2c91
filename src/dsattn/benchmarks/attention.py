"""Attention forward benchmarks: decode and prefill (CSA / HCA / SWA), against the dense-masked
and the gather-everything approaches and the golden."""
from __future__ import annotations

import gc
import os
import time

import torch

from .. import native, ops, reference
from ..common.softmax import set_flash_attention
from . import workloads
from .harness import Result, current_rss_mb, measure_ceilings, peak_rss_growth_mb, reused_pages_result, timeit

SCEN = {1: "SWA", 4: "CSA", 128: "HCA"}
# a decode call takes milliseconds, and its first calls after the inputs are built run slower (caches, the
# ukernel's first use): the median of 20 calls, not 3 (median of 3: 4.7-5.8 ms where 50 calls gave 4.05)
DECODE_CALLS = 20


def bf16_gemm_rows() -> bool:
    """Whether the rows that run bf16 GEMMs in PyTorch (the golden's, the flash opt-in's) are timed: only
    where the CPU class (:mod:`dsattn.native.isa`, capped or not) has bf16 units.  Without them PyTorch's bf16
    matmul runs at ~1 GFLOP/s (an 8K prefill's golden alone would take hours; no such user would opt in to
    half-precision GEMMs)."""
    from ..native import isa
    return isa.bf16_units()


def _fwd(q, kw):
    return ops.sparse_flash_mla(q, **kw)[0]


def _both_paths(family, name, q, kw, flops, repeat, results, nbytes: float = 0.0) -> Result:
    """The default (golden-rounding) path -- the compiled kernel where it is built --, the PyTorch
    path it replaces, and the opt-in flash path, side by side; returns the default's row.
    ``nbytes``: the bytes the work must move (decode: :func:`workloads.decode_bytes`), for the roofline."""
    t = timeit(lambda: _fwd(q, kw), repeat=repeat)
    default = Result(family, name, "dsattn (default)", t, flops / 1e9, bytes=nbytes)
    results.append(default)
    if native.kernels() is not None:
        with native.suspended():
            t = timeit(lambda: _fwd(q, kw), repeat=repeat)
        results.append(Result(family, name, "PyTorch path (DSATTN_NATIVE=0)", t, flops / 1e9, bytes=nbytes))
    if not bf16_gemm_rows():
        return default
    set_flash_attention(True)
    try:
        t = timeit(lambda: _fwd(q, kw), repeat=repeat)
    finally:
        set_flash_attention(False)
    results.append(Result(family, name, "dsattn (flash opt-in)", t, flops / 1e9, bytes=nbytes))
    return default


# The GEMMs of one V4-Flash query row as the compiled forward calls them: S^T of a ring chunk and of a
# whole row (keys x heads, K = the head dim), S = q k^T as a user would write it, and P V over the
# row's 640 keys in V's 64-column strips (64 heads; 32 at B 1, whose heads the threads split).
GEMM_SHAPES = {"S^T chunk (M 128 keys, N 64 heads, K 512)": (128, 64, 512, 64),
               "S^T row (M 640 keys, N 64 heads, K 512)": (640, 64, 512, 64),
               "S = q k^T (M 64 heads, N 640 keys, K 512)": (64, 640, 512, 64),
               "P V (M 64 heads, N 512, K 640 keys)": (64, 512, 640, 64),
               "P V, B 1 head split (M 32, N 512, K 640)": (32, 512, 640, 64)}


def bf16_paths(module) -> list[str]:
    """The 16-bit GEMM paths of an AVX512-BF16 CPU without AMX that this one has: dsattn's micro-kernel,
    and oneDNN's avx512_core_bf16 ukernel where it runs."""
    if module is None or not module.cpu_has_avx512bf16() or module.attention_gemm("bfloat16") == "amx":
        return []
    return ["avx512bf16"] + (["onednn"] if module.bf16_gemm_choice()["onednn_runs"] else [])


def gemm_kernel_rows(fam: str, results) -> dict[str, float]:
    """One thread, operands in cache: the micro-kernel and oneDNN's ukernel on the attention's shapes, side
    by side; returns each path's rate over all the shapes (GFLOP/s)."""
    module = native.kernels()
    paths = bf16_paths(module)
    total = {p: [0.0, 0.0] for p in paths}
    for name, (M, N, K, panel) in GEMM_SHAPES.items():
        flop = 2.0 * M * N * K
        rates = {p: module.gemm_gflops(p, M, N, K, panel) for p in paths}
        for p in paths:
            total[p][0] += flop
            total[p][1] += flop / (rates[p] * 1e9)
            note = ("operands in cache, one thread" + (f"; micro-kernel / oneDNN {rates['avx512bf16'] / rates['onednn']:.2f}"
                                                        if p == "avx512bf16" and "onednn" in rates else ""))
            results.append(Result(fam, f"GEMM {name}", {"avx512bf16": "dsattn micro-kernel",
                                                        "onednn": "oneDNN avx512_core_bf16"}[p],
                                  flop / (rates[p] * 1e9), flop / 1e9, note=note))
    return {p: f / t / 1e9 for p, (f, t) in total.items()}


def _each_bf16_path(fam, name, q, kw, flops, repeat, results, nbytes, default, onednn_rate):
    """The same call on each 16-bit GEMM path of this CPU, side by side; the ``default`` row's note gets
    its share of ``threads x`` oneDNN's one-thread rate on the attention's shapes."""
    module = native.kernels()
    paths = bf16_paths(module) if q.dtype == torch.bfloat16 else []
    for path in paths:
        with native.gemm_path(path):
            t = timeit(lambda: _fwd(q, kw), repeat=repeat)
        results.append(Result(fam, name, f"GEMM path {path}", t, flops / 1e9, bytes=nbytes))
    if onednn_rate:
        share = default.gflops / (onednn_rate * torch.get_num_threads())
        default.note = (default.note + "; " if default.note else "") + \
            f"{100 * share:.0f} % of {torch.get_num_threads()} x oneDNN's one-thread rate on the row's GEMM shapes"


def random_row_read_seconds(cache: torch.Tensor, rows: int, calls: int = 5) -> float:
    """Median seconds PyTorch's ``index_select`` takes to read ``rows`` rows of ``cache`` (its last
    dim a row) at fresh random positions each call, into a preallocated buffer: a floor for any
    kernel that must read that many randomly placed key rows from this cache on this machine."""
    flat = cache.reshape(-1, cache.size(-1))
    buf = torch.empty(rows, flat.size(1), dtype=flat.dtype)
    picks = iter([torch.randint(0, flat.size(0), (rows,)) for _ in range(calls + 1)])
    return timeit(lambda: torch.index_select(flat, 0, next(picks), out=buf), repeat=calls)


def read_floor_note(kw, rows: int, flops: float, ceil) -> str:
    """A CSA decode step reads its top-k compressed key rows at random places of the cache: the time
    those reads alone take bounds the step from below, whatever its GEMMs do."""
    cache = kw["cmp_kv"]
    t_read = random_row_read_seconds(cache, rows)
    mb = rows * cache.size(-1) * cache.element_size() / 1e6
    t_gemm = flops / (ceil.best_gflops * 1e9)
    return (f"reads {mb:.0f} MB of random top-k key rows: index_select alone {t_read * 1e3:.2f} ms "
            f"({mb / 1e3 / t_read:.1f} GB/s); the GEMMs at the best ceiling {t_gemm * 1e3:.2f} ms; so at most "
            f"{100 * min(1.0, t_gemm / t_read):.0f} % of the ceiling even with every read hidden behind a GEMM")


def fresh_output_note(q) -> str:
    """The op returns a fresh output as large as q: its first writes fault every page in.  Timed
    alone (a fresh tensor of that size filled once, on every thread), that share of the op's time
    is the kernel's floor for writing its result, whatever it computes."""
    t = timeit(lambda: torch.empty(q.numel(), dtype=q.dtype).fill_(1), repeat=3)
    return (f"of which the first writes to its fresh {q.numel() * q.element_size() / 2 ** 20:.0f} MB output "
            f"(page faults): {t:.3f} s, timed alone")


def golden_per_row(q, kw, rows=16):
    """Seconds per query row of the golden, timed on the last ``rows`` query rows of batch 0."""
    sub = q[:1, -rows:]
    k = dict(kw)
    if "cmp_sparse_indices" in k:
        k["cmp_sparse_indices"] = k["cmp_sparse_indices"][:1, -rows:]
    for name in ("ori_block_table", "cmp_block_table", "seqused_ori_kv", "seqused_cmp_kv", "cmp_residual_kv"):
        if name in k:
            k[name] = k[name][:1]
    if k["layout_kv"] == "BSND":
        k["ori_kv"] = k["ori_kv"][:1]
        if "cmp_kv" in k:
            k["cmp_kv"] = k["cmp_kv"][:1]
    t = time.perf_counter()
    reference.sparse_flash_mla(sub, **k)
    return (time.perf_counter() - t) / rows


def dense_masked_decode(q, kw, S2o, requests=4):
    """Scores over every key of every request (all raw keys + all compressed keys), then the mask
    (the reference model code's approach), fp32 like the library; seconds per request."""
    ratio = kw.get("cmp_ratio", 1)
    caches = []
    for b in range(requests):
        n = int(S2o[b])
        caches.append((torch.randn(n, workloads.D).bfloat16(), torch.randn(n // ratio, workloads.D).bfloat16()))
    sinks, scale = kw["sinks"], kw["softmax_scale"]

    def step():
        for b, (ori, cmp) in enumerate(caches):
            n = ori.size(0)
            keys = torch.cat([ori, cmp]).float()
            s = scale * (q[b, 0].float() @ keys.T)                       # [H, n + n/r]
            visible = torch.zeros(keys.size(0), dtype=torch.bool)
            visible[max(0, n - workloads.WINDOW):n] = True
            if "cmp_sparse_indices" in kw:
                idx = kw["cmp_sparse_indices"][b, 0, 0].long()
                visible[n + idx[idx >= 0]] = True
            else:
                visible[n:] = True
            s = s.masked_fill(~visible, float("-inf"))
            m = torch.maximum(s.amax(-1), sinks)
            e = torch.exp(s - m[:, None])
            o = (e.bfloat16().float() @ keys) / (e.sum(-1) + torch.exp(sinks - m))[:, None]
        return o
    return timeit(step, repeat=2) / requests


def careful_dense_decode(q, kw, S2o, dtype: torch.dtype, requests=4):
    """The dense baseline a careful user would write: scores over the window's raw keys and every
    compressed key only (not every raw key), in the machine's fast dtype (``dtype``: bf16 where its
    GEMM beats fp32, else fp32), the sink in the softmax; seconds per request."""
    ratio = kw.get("cmp_ratio", 1)
    caches = []
    for b in range(requests):
        n = int(S2o[b])
        window = torch.randn(min(n, workloads.WINDOW), workloads.D).to(dtype)
        caches.append(torch.cat([window, torch.randn(n // ratio, workloads.D).to(dtype)]))
    sinks, scale = kw["sinks"], kw["softmax_scale"]

    def step():
        for b, keys in enumerate(caches):
            s = (scale * (q[b, 0].to(dtype) @ keys.T)).float()              # [H, window + n/r]
            m = torch.maximum(s.amax(-1), sinks)
            e = torch.exp(s - m[:, None])
            o = (e.to(dtype) @ keys).float() / (e.sum(-1) + torch.exp(sinks - m))[:, None]
        return o
    return timeit(step, repeat=2) / requests


def gather_everything(q, kw):
    """Every selected key row of every query gathered into one buffer, then attention on it (the
    pure-PyTorch references of FlashMLA / vLLM); fp32 math like the library."""
    L = q.size(1)
    ori, cmp = kw["ori_kv"][0, :, 0], kw["cmp_kv"][0, :, 0]
    pos = torch.arange(L)
    win = pos[:, None] - torch.arange(workloads.WINDOW - 1, -1, -1)[None]            # [L, 128]
    idx = kw["cmp_sparse_indices"][0, :, 0].long()
    keys = torch.cat([ori[win.clamp(min=0)], cmp[idx.clamp(min=0)]], 1).float()      # [L, 640, D]
    mask = torch.cat([win >= 0, idx >= 0], 1)
    s = kw["softmax_scale"] * torch.einsum("lhd,lwd->lhw", q[0].float(), keys)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    m = torch.maximum(s.amax(-1), kw["sinks"])
    e = torch.exp(s - m[..., None])
    den = e.sum(-1) + torch.exp(kw["sinks"] - m)
    return torch.einsum("lhw,lwd->lhd", e.bfloat16().float(), keys) / den[..., None]


def memory_run(L: int, impl: str, chunk: int = 0) -> dict:
    """Subprocess entry: build a CSA prefill of L tokens, run ``impl`` once, report timing, the
    RSS after the inputs were built and the bytes of inputs + outputs."""
    torch.set_num_threads(torch.get_num_threads())
    q, kw, flops = workloads.prefill(L, ratio=4)
    gc.collect()
    base = current_rss_mb()
    io = q.numel() * q.element_size() * 2 + sum(v.numel() * v.element_size() for v in kw.values()
                                                if isinstance(v, torch.Tensor))
    t = time.perf_counter()
    if impl == "gather":
        gather_everything(q, kw)
    else:
        _fwd(q, kw)
    return {"seconds": time.perf_counter() - t, "base_rss_mb": base, "io_mb": io / 2 ** 20, "gflop": flops / 1e9}


def reused_pages_run(L: int, ratio: int, calls: int = 3) -> dict:
    """Subprocess entry (run with :data:`REUSED_PAGES_ENV`): the median of ``calls`` prefill calls after a
    first one, each output freed before the next call allocates its own."""
    q, kw, flops = workloads.prefill(L, ratio=ratio)
    _fwd(q, kw)
    return {"seconds": timeit(lambda: _fwd(q, kw), repeat=calls), "base_rss_mb": current_rss_mb(),
            "gflop": flops / 1e9}


def run(smoke: bool = False, results=None) -> list[Result]:
    results = [] if results is None else results
    fam = "attention"
    if smoke:
        from ..testing import compare
        for ratio in (4, 128):
            q, kw, flops, _ = workloads.decode(B=2, lo=300, hi=2000, seed=1, ratio=ratio)
            _both_paths(fam, f"smoke decode {SCEN[ratio]} B2", q, kw, flops, 1, results, workloads.decode_bytes(q, kw))
            results[-2].extra["matches_golden"] = bool(compare(_fwd(q, kw), reference.sparse_flash_mla(q, **kw)[0]))
        q, kw, flops = workloads.prefill(192, ratio=4)
        _both_paths(fam, "smoke prefill CSA 192", q, kw, flops, 1, results)
        results[-2].extra["matches_golden"] = bool(compare(_fwd(q, kw), reference.sparse_flash_mla(q, **kw)[0]))
        return results
    ceil = measure_ceilings(2048)          # as the runner's: the GEMM rate the reads are weighed against
    onednn_rate = gemm_kernel_rows(fam, results).get("onednn", 0.0)
    for model, heads, topk in (("Flash", 64, 512), ("Pro", 128, 1024)):
        for ratio in (4, 128):
            q, kw, flops, _ = workloads.decode(heads=heads, ratio=ratio, topk=topk)
            name = f"decode {SCEN[ratio]} V4-{model} B32 8K-128K"
            default = _both_paths(fam, name, q, kw, flops, DECODE_CALLS, results, workloads.decode_bytes(q, kw))
            if ratio == 4:
                default.note = read_floor_note(kw, q.size(0) * topk, flops, ceil)
            _each_bf16_path(fam, name, q, kw, flops, DECODE_CALLS, results, workloads.decode_bytes(q, kw), default,
                        onednn_rate)
            if bf16_gemm_rows():
                g = _golden_decode(q, kw)
                results.append(Result(fam, name, "golden", g, flops / 1e9, note="32 requests, timed on 4, scaled"))
    # dense-masked and careful dense vs ours at 64K
    fast = torch.bfloat16 if (ceil.bf16_gflops or 0.0) > ceil.fp32_gflops else torch.float32
    for ratio in (4, 128):
        q, kw, flops, S2o = workloads.decode(ratio=ratio, fixed=65536, seed=2)
        name = f"decode {SCEN[ratio]} V4-Flash B32 @64K"
        default = _both_paths(fam, name, q, kw, flops, DECODE_CALLS, results, workloads.decode_bytes(q, kw))
        if ratio == 4:
            default.note = read_floor_note(kw, q.size(0) * 512, flops, ceil)
        _each_bf16_path(fam, name, q, kw, flops, DECODE_CALLS, results, workloads.decode_bytes(q, kw), default,
                        onednn_rate)
        per_req = dense_masked_decode(q, kw, S2o)
        results.append(Result(fam, name, "dense-masked", per_req * 32, flops / 1e9, note="timed on 4 requests, x8"))
        per_req = careful_dense_decode(q, kw, S2o, fast)
        results.append(Result(fam, name, "careful dense", per_req * 32, flops / 1e9,
                              note=f"window + every compressed key in {str(fast).split('.')[-1]} (this machine's "
                                   "faster GEMM); timed on 4 requests, x8"))
    for ratio in (4, 128, 1):
        q, kw, flops = workloads.prefill(8192, ratio=ratio)
        name = f"prefill {SCEN[ratio]} 8K"
        default = _both_paths(fam, name, q, kw, flops, 1, results)
        default.note = fresh_output_note(q)
        _each_bf16_path(fam, name, q, kw, flops, 1, results, 0.0, default, onednn_rate)
        if bf16_gemm_rows():
            g = golden_per_row(q, kw) * 8192
            results.append(Result(fam, name, "golden", g, flops / 1e9, note="timed on 16 rows, scaled to 8192"))
        del q, kw
        gc.collect()
        results.append(reused_pages_result(fam, name, "dsattn.benchmarks.attention", "reused_pages_run",
                                           {"L": 8192, "ratio": ratio}))
    # gather-everything vs ours: time and resident-set growth, each in a fresh process
    for L in (4096, 32768):
        for impl in (("ours", "gather") if L == 4096 else ("ours",)):
            r = peak_rss_growth_mb("dsattn.benchmarks.attention", "memory_run", {"L": L, "impl": impl})
            name = f"prefill CSA {L // 1024}K (fresh process)"
            variant = "dsattn (default)" if impl == "ours" else "gather-everything"
            if "error" in r:
                results.append(Result(fam, name, variant, float("nan"), note=f"failed: {r['error']}"))
                continue
            growth = r["peak_rss_mb"] - r["base_rss_mb"]
            results.append(Result(fam, name, variant, r["seconds"], r["gflop"], peak_mb=growth,
                                  note=f"inputs+outputs {r['io_mb']:.0f} MB; growth/io {growth / r['io_mb']:.2f}"))
    # The gather-everything approach at 32K cannot run here: its buffer alone (every query's 640 key
    # rows, bf16 gathered + fp32 converted) is computed, not measured.
    need = 32768 * (workloads.WINDOW + 512) * workloads.D * (2 + 4) / 2 ** 20
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 20
    results.append(Result(fam, "prefill CSA 32K (fresh process)", "gather-everything", float("nan"), peak_mb=need,
                          note=f"not runnable: its key buffer alone needs {need / 1024:.0f} GiB (computed) > "
                               f"{ram / 1024:.0f} GiB RAM"))
    return results


def _golden_decode(q, kw, requests=4):
    """Golden seconds for the whole 32-request step, timed on ``requests`` requests."""
    B = q.size(0)
    k = dict(kw)
    for name in ("ori_block_table", "cmp_block_table", "seqused_ori_kv", "seqused_cmp_kv", "cmp_residual_kv"):
        if name in k:
            k[name] = k[name][:requests]
    if "cmp_sparse_indices" in k:
        k["cmp_sparse_indices"] = k["cmp_sparse_indices"][:requests]
    t = time.perf_counter()
    reference.sparse_flash_mla(q[:requests], **k)
    return (time.perf_counter() - t) * B / requests
