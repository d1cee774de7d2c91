"""The parity matrix behind ``dsattn verify``: every operator against its golden reference.

For each operator, BSND and TND (plus paged KV where the operator takes it) x cmp_ratio
1, 4, 128 x float16, bfloat16, float32.  fp16 outputs use the standard rule, bf16 the
cross-order rule (the fast path sums in another order), and fp32 runs are held to 1e-5
relative against the golden evaluated in float64.  Indices use the index-set rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import cases, hyper_parallel, ops, reference, testing

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
RATIOS = (1, 4, 128)


@dataclass
class Row:
    case: str
    output: str
    result: testing.Comparison


def _rule(actual, expected_fp32_golden, expected_f64_golden=None):
    if actual.dtype == torch.float32 and expected_f64_golden is not None:
        return testing.fp32_math_close(actual, expected_f64_golden)
    return testing.compare(actual, expected_fp32_golden)


def _impl(name: str, impl: str) -> Callable:
    if impl == "reference":
        return getattr(reference, name)
    if impl == "facade":
        return _FACADE[name]
    return getattr(ops, name)


def _facade_mla(q, **kw):
    layout = kw.pop("layout_q")
    kw.pop("layout_kv")
    ren = {k: k.replace("cu_seqlens_", "cu_seq_lens_") for k in kw if k.startswith("cu_seqlens_")}
    return hyper_parallel.npu_sparse_flash_mla(q, layout=layout, **{ren.get(k, k): v for k, v in kw.items()})


def _facade_mla_grad(q, dout, o, lse, **kw):
    layout = kw.pop("layout_q")
    kw.pop("layout_kv")
    ren = {k: k.replace("cu_seqlens_", "cu_seq_lens_") for k in kw if k.startswith("cu_seqlens_")}
    return hyper_parallel.npu_sparse_flash_mla_grad(q, dout, o, lse, layout=layout,
                                                    **{ren.get(k, k): v for k, v in kw.items()})


_FACADE = {"sparse_flash_mla": _facade_mla, "sparse_flash_mla_grad": _facade_mla_grad,
           "lightning_indexer": ops.lightning_indexer,
           "sparse_lightning_indexer_kl_loss_grad": ops.sparse_lightning_indexer_kl_loss_grad}


def mla_rows(case: cases.Case, impl: str = "ops", grad: bool = True) -> list[Row]:
    q, kw = case.q, case.kwargs
    fwd = _impl("sparse_flash_mla", impl)
    o, lse = fwd(q, return_softmax_lse=True, **dict(kw))
    go, glse = reference.sparse_flash_mla(q, return_softmax_lse=True, **kw)
    f64 = {}
    if q.dtype == torch.float32:
        f64["o"], f64["lse"] = reference.sparse_flash_mla(q, return_softmax_lse=True, compute_dtype=torch.float64, **kw)
    rows = [Row(case.name, "attn_out", _rule(o, go, f64.get("o"))),
            Row(case.name, "softmax_lse", _rule(lse, glse, f64.get("lse")))]
    if grad and kw["layout_kv"] != "PA_BBND":
        dout = case.extra["dout"]
        names = ("dq", "dori_kv", "dcmp_kv", "dsinks", "ori_l1", "cmp_l1")
        got = _impl("sparse_flash_mla_grad", impl)(q, dout, go, glse, **dict(kw))
        want = reference.sparse_flash_mla_grad(q, dout, go, glse, **kw)
        want64 = reference.sparse_flash_mla_grad(q, dout, go, glse, compute_dtype=torch.float64, **kw) \
            if q.dtype == torch.float32 else [None] * 6
        for n, a, e, e64 in zip(names, got, want, want64):
            if e.numel():
                rows.append(Row(case.name, n, _rule(a, e, e64)))
    return rows


def indexer_rows(case: cases.Case, impl: str = "ops") -> list[Row]:
    k, w, topk = case.extra["k"], case.extra["w"], case.extra["topk"]
    idx, val = _impl("lightning_indexer", impl)(case.q, k, w, topk, **case.kwargs)
    gi, gv = reference.lightning_indexer(case.q, k, w, topk, **case.kwargs)
    full = k.size(0) * k.size(1) + 1
    ri, rv = reference.lightning_indexer(case.q, k, w, full, **case.kwargs)
    return [Row(case.name, "indices+values", testing.compare_indexer(idx, val, gi, gv, ri, rv))]


def kl_rows(case: cases.Case, impl: str = "ops") -> list[Row]:
    args = (case.q, case.extra["k"], case.extra["w"], case.extra["sparse_indices"], case.extra["p"])
    got = _impl("sparse_lightning_indexer_kl_loss_grad", impl)(*args, **case.kwargs)
    want = reference.sparse_lightning_indexer_kl_loss_grad(*args, **case.kwargs)
    # The KL gradient gates by relu'(S): a score within rounding distance of 0 sits on either side
    # in fp32 and float64, switching a whole term on or off, and dI = y*psum - p cancels.  Per-element
    # 1e-5 is therefore not attainable for it; its fp32 outputs use the spec's standard rule (00 §11).
    want64 = [None] * 4
    return [Row(case.name, n, _rule(a, e, e64)) for n, a, e, e64 in zip(("dq", "dk", "dw", "softmax_out"), got, want,
                                                                          want64)]


def matrix(impl: str = "ops", quick: bool = False, progress: Callable | None = None) -> list[Row]:
    """Run the whole parity matrix; ``quick`` keeps fp16 and bf16 only and skips paged cases."""
    dtypes = DTYPES[:2] if quick else DTYPES
    jobs = []
    for layout in ("BSND", "TND"):
        for r in RATIOS:
            for dt in dtypes:
                seed = hash((layout, r, str(dt))) % 10_000
                jobs.append(lambda layout=layout, r=r, dt=dt, seed=seed:
                            mla_rows(cases.mla_case(layout, r, dt, seed=seed), impl))
                jobs.append(lambda layout=layout, r=r, dt=dt, seed=seed:
                            indexer_rows(cases.indexer_case(layout, r, dt, seed=seed), impl))
                jobs.append(lambda layout=layout, r=r, dt=dt, seed=seed:
                            kl_rows(cases.kl_case(layout, r, dt, seed=seed), impl))
                if not quick and impl != "facade":                     # the npu_* interface has no paged KV
                    jobs.append(lambda layout=layout, r=r, dt=dt, seed=seed:
                                mla_rows(cases.mla_case(layout, r, dt, paged=True, seed=seed + 1), impl))
                    jobs.append(lambda layout=layout, r=r, dt=dt, seed=seed:
                                indexer_rows(cases.indexer_case(layout, r, dt, paged=True, seed=seed + 1), impl))
    rows: list[Row] = []
    for n, job in enumerate(jobs):
        rows.extend(job())
        if progress:
            progress(n + 1, len(jobs))
    return rows
