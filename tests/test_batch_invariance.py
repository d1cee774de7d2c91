"""Batch invariance: a request's rows are the same bits alone as inside any batch, on 1 thread or all
(dsattn/cases/invariance.py, ``dsattn verify --batch-invariance N``).  Promised on dsattn's own GEMMs (the fp32
GEMM, the vdpbf16ps micro-kernel: the "own" path); AMX and oneDNN's bf16 path are a vendor library's kernels and
promise none."""
import random

import pytest
import torch

from dsattn import native, ops
from dsattn.cases import invariance

BASE = random.randrange(10**6)                      # fresh configurations every run; failures print their seed
PER_FAMILY = 40                                     # 8 families: 320 configurations


@pytest.mark.parametrize("family", invariance.FAMILIES)
def test_every_request_alone_gives_its_rows_in_the_batch(family, native_module):
    if native_module is None:
        pytest.skip(f"the guarantee is the compiled CPU path's; here: {native.status()}")
    with native.gemm_path("own"):
        n, failures = invariance.check_seeds(family, range(BASE, BASE + PER_FAMILY))
    assert n == PER_FAMILY and not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("gemm", ["avx512bf16", "fp32"])
def test_the_other_own_gemm_paths_are_batch_invariant_too(gemm, native_module):
    if native_module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    if gemm == "avx512bf16" and not native_module.cpu_has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16")
    with native.gemm_path(gemm):
        for family in ("mla", "indexer", "qsfa", "compressor"):
            _, failures = invariance.check_seeds(family, range(BASE + 7, BASE + 17))
            assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("gemm", ["best", "own", "avx512bf16", "onednn", "fp32"])
def test_which_gemm_paths_promise_invariance(gemm, native_module):
    # dsattn's own GEMMs promise it (every dtype on "own" and "fp32", bf16 on the micro-kernel); oneDNN's kernels
    # (AMX, the onednn path) do not, and the CLI says which one a run is on
    if native_module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    if gemm == "avx512bf16" and not native_module.cpu_has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16")
    if gemm == "onednn" and not native_module.bf16_gemm_choice()["onednn_runs"]:
        pytest.skip("oneDNN's avx512_core_bf16 ukernel is the path of AVX512-BF16 CPUs without AMX; not this one")
    with native.gemm_path(gemm):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            kind = native_module.attention_gemm(str(dtype).split(".")[-1])
            assert native.gemm_is_own(dtype) == (kind in ("fp32", "avx512bf16")), (dtype, kind)
            if gemm in ("own", "fp32"):
                assert native.gemm_is_own(dtype)
        assert native.gemm_is_own(torch.float32)
        with pytest.raises(ValueError, match="gemm_is_own: dtype 'bfloat16', 'float16' or 'float32', got 'int8'"):
            native.gemm_is_own(torch.int8)
        if gemm == "onednn":
            assert not native.gemm_is_own(torch.bfloat16)


def test_the_check_sees_a_row_that_depends_on_its_batch(monkeypatch):
    # a control: an output nudged by the batch size must be reported
    real = ops.sparse_attn_sharedkv

    def batch_dependent(q, **kw):
        out, lse = real(q, **kw)
        B = q.size(0) if kw.get("layout_q", "BSND") == "BSND" else kw["cu_seqlens_q"].numel() - 1
        return out + (B - 1) * 1e-2, lse
    monkeypatch.setattr(ops, "sparse_attn_sharedkv", batch_dependent)
    failing = [s for s in range(30) if invariance.check("sharedkv", s)]
    with_rows = []                                  # batches of two or more requests, one with a row at least
    for s in range(30):
        c = invariance.fuzz.draw("sharedkv", s)
        req = invariance.Request("sharedkv", c.q, c.kwargs, {})
        if req.B > 1 and any(req.valid_rows(b) for b in range(req.B)):
            with_rows.append(s)
    assert with_rows and set(with_rows) <= set(failing)


def test_indexer_valid_rows_do_not_depend_on_seqused_q():
    # the reported case: BSND fp32, 14 heads, D 86, three requests padded to 16 rows, mask_mode 3,
    # one output_idx_offset per request; the shared-key path ran for some rows and not others
    for seed in range(10):
        g = torch.Generator().manual_seed(BASE + seed)
        q, k = torch.randn(3, 16, 14, 86, generator=g), torch.randn(3, 42, 1, 86, generator=g)
        w = torch.randn(3, 16, 14, generator=g)
        used_q = torch.tensor([15, 3, 14], dtype=torch.int32)
        kw = dict(seqused_k=torch.tensor([42, 16, 4], dtype=torch.int32), mask_mode=3, return_value=1,
                  output_idx_offset=torch.tensor([5, 100, 7], dtype=torch.int32))
        i1, v1 = ops.lightning_indexer(q, k, w, 7, seqused_q=used_q, **kw)
        i2, v2 = ops.lightning_indexer(q, k, w, 7, **kw)
        valid = torch.arange(16)[None] < used_q[:, None]
        assert torch.equal(i1[valid], i2[valid]) and torch.equal(v1[valid], v2[valid]), seed


def test_the_cli_runs_the_family(capsys, native_module):
    from dsattn.cli import main
    if native_module is None:
        pytest.skip(f"the guarantee is the compiled CPU path's; here: {native.status()}")
    assert main(["verify", "--batch-invariance", "3", "--family", "compressor", "--seed", str(BASE)]) == 0
    out = capsys.readouterr().out
    assert "compressor: 3 configurations" in out and "bit-identical" in out
