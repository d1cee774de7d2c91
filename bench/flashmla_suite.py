"""Run FlashMLA's own correctness tests, unchanged, on the CPU through ``dsattn.flashmla``.

    python bench/flashmla_suite.py --tests <FlashMLA checkout>/tests --file dense --every 4
    python bench/flashmla_suite.py --tests <FlashMLA checkout>/tests --file sparse_prefill --every 2
    python bench/flashmla_suite.py --tests <FlashMLA checkout>/tests --file sparse_decode --every 25 --max-batch 74

FlashMLA's test files (``test_flash_mla_dense_decoding.py``, ``test_flash_mla_sparse_prefill.py``,
``test_flash_mla_sparse_decoding.py``, with their ``lib.py``, ``ref.py``, ``quant.py`` and ``kernelkit``) are
imported as they are, with ``import flash_mla`` resolved to ``dsattn.flashmla`` and the few CUDA calls
they make for data placement turned into no-ops (``Tensor.cuda``, ``torch.cuda.synchronize``); their
case generators, references and comparators decide pass or fail.  ``--every N`` runs every Nth case
of a file's correctness (and corner) lists; performance-only cases are skipped (no timing here).
Nothing is downloaded: point ``--tests`` at a checkout.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time

import torch



def _cases(which: str, T, max_batch: int, max_sq: int):
    if which == "dense":
        P = T.TestParam
        cases = [P(b, s_q, s_k, varlen, causal, test_performance=False, h_q=h_q, h_kv=h_kv)
                 for b in (1, 2, 6) for s_q in (1, 2, 4) for s_k in (20, 140, 4096)
                 for h_q in (1, 3, 9, 63, 64, 126, 128) for h_kv in (1, 2, 3, 8)
                 for varlen in (False, True) for causal in (False, True) if h_q % h_kv == 0]
        cases += [P(16, 2, 4096, is_varlen=True, is_causal=causal, test_performance=False, have_zero_seqlen_k=True,
                    h_q=h_q, h_kv=h_kv)
                  for h_q in (1, 3, 9, 63, 64, 126, 128) for h_kv in (1, 2, 3, 8) for causal in (False, True)
                  if h_q % h_kv == 0]
        return cases, lambda t: (T.test_flash_mla(t), True)[1]
    if which == "sparse_decode":
        raw = [r for r in T.gen_testcase() if r.check_correctness and r.num_runs == 0 and r.b <= max_batch]
        return [r.to_test_param() for r in raw], lambda p: T.test_flash_mla(p).is_correct
    from lib import TestParam
    cases = []
    for d_qk in (512, 576):
        for h_q in (128, 64):
            for s_kv, topk in ((128, 128), (592, 128), (1840, 256), (1592, 384), (1521, 512), (95, 128), (153, 256),
                               (114, 384)):
                for s_q in (1, 62):
                    for sink in (False, True):
                        for length in (False, True):
                            cases.append(TestParam(s_q, s_kv, topk, h_q=h_q, num_runs=0, have_attn_sink=sink,
                                                   have_topk_length=length, d_qk=d_qk))
            for s_q, s_kv, topk in ((1, 128, 128), (1, 256, 256), (min(max_sq, 1234), 4321, 4096)):
                cases.append(TestParam(s_q, s_kv, topk, h_q=h_q, is_all_indices_invalid=True, num_runs=0,
                                       have_attn_sink=True, have_topk_length=True, d_qk=d_qk))
            for s_kv, topk in ((32, 2048), (64, 8192)):
                cases.append(TestParam(1, s_kv, topk, h_q=h_q, num_runs=0, have_attn_sink=True, have_topk_length=True,
                                       d_qk=d_qk))
    return cases, T.run_test


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", required=True, help="FlashMLA's tests/ folder")
    ap.add_argument("--file", choices=("dense", "sparse_prefill", "sparse_decode"), required=True)
    ap.add_argument("--every", type=int, default=1, help="run every Nth case")
    ap.add_argument("--limit", type=int, default=1 << 30, help="at most this many cases")
    ap.add_argument("--max-batch", type=int, default=74, help="sparse decode: cases with b up to this")
    ap.add_argument("--max-sq", type=int, default=64, help="sparse prefill corner cases: s_q up to this")
    args = ap.parse_args(argv)
    sys.path.insert(0, args.tests)
    import dsattn.flashmla
    sys.modules["flash_mla"] = dsattn.flashmla
    torch.Tensor.cuda = lambda self, *a, **k: self          # their data stays on the CPU
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.set_default_dtype(torch.bfloat16)                 # as their main() sets it
    module = {"dense": "test_flash_mla_dense_decoding", "sparse_prefill": "test_flash_mla_sparse_prefill",
              "sparse_decode": "test_flash_mla_sparse_decoding"}[args.file]
    T = __import__(module)
    cases, run = _cases(args.file, T, args.max_batch, args.max_sq)
    picked = cases[::args.every][:args.limit]
    failures = []
    t0 = time.time()
    for case in picked:
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                ok = run(case)
        except Exception as e:                              # noqa: BLE001 - a crash is a failed case
            ok = False
            log.write(f"{type(e).__name__}: {e}")
        if not ok:
            failures.append((case, log.getvalue()[-800:]))
    print(f"{module}: {len(picked)} of {len(cases)} cases run, {len(picked) - len(failures)} passed, "
          f"{len(failures)} failed ({time.time() - t0:.0f} s)")
    for case, log in failures[:5]:
        print(f"FAILED {case}\n{log}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
