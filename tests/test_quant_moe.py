"""The routed-experts loop of the vLLM plug-in's FP8 / MXFP4 experts (``dsattn.weights.moe.run_experts``) against a
dense float64 MoE (``dsattn.weights.ref.routed_experts``), and the memory the quantised linears and that loop take:
no weight-sized copy."""
import json
import os
import subprocess
import sys

import pytest
import torch

from dsattn import ops
from dsattn.weights import moe, quantize_fp8_blocks, quantize_mxfp4, ref

E, H, I, T, K_TOP = 6, 256, 128, 23, 3


def _experts(fmt, gen):
    """Quantised expert weights (w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I]), the per-expert linear that reads
    them, and their dequantised values (the golden's dense weights)."""
    w13 = torch.randn(E, 2 * I, H, generator=gen) * 0.1
    w2 = torch.randn(E, H, I, generator=gen) * 0.1
    codes, scales, dense = [[], []], [[], []], [[], []]
    for i, w in enumerate((w13, w2)):
        for e in range(E):
            if fmt == "fp8":
                c, s = quantize_fp8_blocks(w[e], (128, 128))
                d = ref.dequantize(c, s, 128, 128)
            else:
                c, s = quantize_mxfp4(w[e])
                d = ref.dequantize_mxfp4(c, s)
            codes[i].append(c)
            scales[i].append(s)
            dense[i].append(d)

    def linear(e, i, a):
        if fmt == "fp8":
            return ops.fp8_block_linear(a, codes[i][e], scales[i][e], [128, 128])
        return ops.mxfp4_linear(a, codes[i][e], scales[i][e])

    return linear, torch.stack(dense[0]), torch.stack(dense[1])


def _routing(gen, unused_expert: int):
    """Top-k ids over E experts (no token picks ``unused_expert``) and their weights."""
    scores = torch.rand(T, E, generator=gen)
    scores[:, unused_expert] = -1.0
    weights, ids = scores.topk(K_TOP, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def _check(got, want, x_dtype):
    assert not torch.isnan(got).any()
    # the linears' fp32 sums and the activation's rounding to x's dtype between the two products
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[x_dtype]
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err <= tol, (float(err), tol)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_run_experts_matches_a_dense_float64_moe(fmt, dtype, gen):
    """Expert 4 has no token; an expert map puts experts 1 and 3 on another rank (-1: they add nothing here); the
    SwiGLU clamp is active (a limit below the gate / up values' range)."""
    linear, w13, w2 = _experts(fmt, gen)
    weights, ids = _routing(gen, unused_expert=4)
    x = (torch.randn(T, H, generator=gen) * 2).to(dtype)
    expert_map = torch.tensor([0, -1, 1, -1, 2, 3], dtype=torch.int32)     # global -> this rank's
    local = [0, 2, 4, 5]                                                   # this rank's experts, by global id
    limit = 0.15
    h = torch.einsum("th,eih->tei", x.double(), w13)
    assert (h[..., :I] > limit).any() and (h[..., I:].abs() > limit).any(), "the clamp must bite"
    out = torch.full((T, H), float("nan"), dtype=torch.float32)
    moe.run_experts(out, x, lambda e, i, a: linear(local[e], i, a), len(local), I, weights, ids, expert_map,
                    False, limit)
    want = ref.routed_experts(x, w13, w2, weights, ids, expert_map=None, limit=limit)
    mine = ref.routed_experts(x, w13[local], w2[local], weights, ids, expert_map=expert_map, limit=limit)
    assert not torch.allclose(mine, want), "the map must leave some experts out"
    _check(out, mine, dtype)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_run_experts_with_weights_applied_on_input(fmt, gen):
    """vLLM's apply_router_weight_on_input (top-1): x already carries each token's weight; nothing more is applied."""
    linear, w13, w2 = _experts(fmt, gen)
    scores = torch.rand(T, E, generator=gen)
    weights, ids = scores.topk(1, dim=-1)
    x = torch.randn(T, H, generator=gen) * weights
    out = torch.empty(T, H)
    moe.run_experts(out, x, linear, E, I, weights, ids.to(torch.int32), None, True, None)
    _check(out, ref.routed_experts(x, w13, w2, weights, ids, weights_applied=True), torch.float32)
    unweighted = ref.routed_experts(x, w13, w2, weights, ids, weights_applied=False)
    assert not torch.allclose(out.double(), unweighted, rtol=1e-3)


def test_run_experts_reads_no_expert_no_token_chose(gen):
    linear, _, _ = _experts("fp8", gen)
    weights, ids = _routing(gen, unused_expert=2)
    called = set()

    def counting(e, i, a):
        called.add(e)
        return linear(e, i, a)

    moe.run_experts(torch.empty(T, H), torch.randn(T, H, generator=gen), counting, E, I, weights, ids)
    assert called == set(range(E)) - {2}


# ---- memory: the quantised weights are read in place ----

_RSS_WORKER = r"""
import json, sys
import torch
from dsattn import ops
from dsattn.weights import moe
fmt, what = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
E, H, I, T, N = 8, 2048, 1024, 64, 4096
def codes(n, k):
    return torch.randint(0, 256, (n, k if fmt == "fp8" else k // 2), dtype=torch.uint8) & 0x77
def scale(n, k):
    return torch.rand(-(-n // 128), -(-k // 128)) * 1e-2 if fmt == "fp8" else torch.randint(118, 126, (n, k // 32), dtype=torch.uint8)
def linear(x, c, s):
    return ops.fp8_block_linear(x, c, s, [128, 128]) if fmt == "fp8" else ops.mxfp4_linear(x, c, s)
if what == "linear":
    w = [(codes(N, N), scale(N, N))]
    weight_bytes = w[0][0].numel()
    activation_bytes = 64 * (N + N) * 4 * 2           # x and y of the largest call, fp32, twice over
    def run():
        for rows in (1, 8, 64):
            linear(torch.randn(rows, N, dtype=torch.bfloat16), *w[0])
else:
    w13 = [(codes(2 * I, H), scale(2 * I, H)) for _ in range(E)]
    w2 = [(codes(H, I), scale(H, I)) for _ in range(E)]
    weight_bytes = sum(c.numel() for c, _ in w13 + w2)
    ids = torch.randint(0, E, (T, 2), dtype=torch.int32)
    weights = torch.rand(T, 2)
    activation_bytes = T * (H + 2 * I) * 4 * 2
    def run():
        out = torch.empty(T, H)
        x = torch.randn(T, H, dtype=torch.bfloat16)
        moe.run_experts(out, x, lambda e, i, a: linear(a, *(w13 if i == 0 else w2)[e]), E, I, weights, ids)
# warm up the same paths on the same widths with a fraction of the weight (the compiled layer, thread pools, the GEMM's
# setup for these shapes): a copy of the weight made per call would show in the measured run, an expert's too
if what == "linear":
    part = (codes(256, N), scale(256, N))
    for rows in (1, 8, 64):
        linear(torch.randn(rows, N, dtype=torch.bfloat16), *part)
else:
    for rows in (1, 9, 17, 33):
        linear(torch.randn(rows, H, dtype=torch.bfloat16), *w13[0])
        linear(torch.randn(rows, I, dtype=torch.bfloat16), *w2[0])
def status_kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
run()                           # (first-call allocations that stay: the GEMM's per-shape state, thread buffers)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                # the peak RSS (VmHWM) starts again from the current RSS
before = status_kb("VmRSS")
run()
print(json.dumps(dict(growth_kb=status_kb("VmHWM") - before, weight_kb=weight_bytes // 1024,
                      activation_kb=activation_bytes // 1024)))
"""


@pytest.mark.parametrize("what", ["linear", "experts"])
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_peak_memory_holds_no_weight_sized_copy(what, fmt, native_module):
    """Peak RSS over a forward (a 4096 x 4096 linear at 1, 8 and 64 rows; 8 experts of V4-Flash's 2048 x 1024 with 64
    tokens), measured on its second call (the first keeps per-shape state), grows by less than an eighth of the
    quantised weights' own bytes plus twice the activations in fp32: a dequantised copy of the weights (bf16: 2x / 4x
    their bytes), of one expert's (a quarter / half of them) or of the PyTorch path's 1024-row chunks would not fit
    (DSATTN_NATIVE=0 measured 34-108 MB)."""
    if native_module is None:
        pytest.skip("the PyTorch path dequantises 1024 weight rows at a time; the in-place promise is the compiled one's")
    # glibc with a fixed mmap threshold: a large block freed goes back to the kernel at once (its dynamic threshold
    # would keep a freed copy's pages in the heap, and the next call's copy would reuse them unseen)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    proc = subprocess.run([sys.executable, "-c", _RSS_WORKER, fmt, what], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print(got)
    assert got["growth_kb"] < got["weight_kb"] / 8 + got["activation_kb"], got
