"""dsattn's versions of vLLM's DeepSeek-V4 CPU ops (``v4_ops``: what ``_C_AVX512`` / ``_C_AVX2`` lack) against vLLM's
own kernels where this machine loads ``_C``, on fresh random inputs at V4's sizes; and their installation in a process
that loads a library without them."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops  # noqa: E402,F401  (loads torch.ops._C)

from dsattn.integrations.vllm import v4_ops  # noqa: E402
from dsattn.native import isa  # noqa: E402
from test_v4_fp32 import _close_bf16, _randn, _rope_table, g  # noqa: E402,F401  (g: the seeded generator fixture)
from vllm_helpers import needs_vllm_v4_kernels  # noqa: E402


def _equal_share(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a == b).float().mean())


@needs_vllm_v4_kernels
def test_weight_packing_and_bmm_equal_vllms(g):
    """``wo_a`` as ``convert_weight_packed`` keeps it and ``bmm_cpu`` over it: vLLM's products are exact bf16 ones
    summed in fp32, ours fp32 ones: equal after the output's bf16 rounding but for summation-order flips."""
    G, T, N, K = 2, 7, 64, 512
    w = _randn(g, G, N, K, scale=0.05).to(torch.bfloat16)
    x = _randn(g, G, T, K).to(torch.bfloat16)
    want, got = (torch.full((G, T, N), float("nan"), dtype=torch.bfloat16) for _ in range(2))
    torch.ops._C.bmm_cpu(want, x, torch.ops._C.convert_weight_packed(w), True, None)
    packed = v4_ops.convert_weight_packed(w)
    assert packed.dtype == torch.float32 and torch.equal(packed, w.float())
    v4_ops.bmm_cpu(got, x, packed, True, None)
    _close_bf16(got, want, ulps=1)
    with pytest.raises(ValueError, match="bmm_cpu: scale"):
        v4_ops.bmm_cpu(got, x, packed, True, torch.ones(1))


@needs_vllm_v4_kernels
def test_inverse_rope_op_equals_vllms(g):
    T, H = 13, 4
    o = _randn(g, T, H, 512).to(torch.bfloat16)
    positions, table = torch.randint(0, 512, (T,), generator=g), _rope_table(g)
    want = torch.ops._C.inverse_gptj_rope_o_proj_cpu(o, positions, table, 64)
    got = v4_ops.inverse_gptj_rope_o_proj(o, positions, table, 64)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rope_dim 32"):
        v4_ops.inverse_gptj_rope_o_proj(o, positions, table, 32)


@needs_vllm_v4_kernels
def test_indexer_query_equals_vllms(g):
    """The indexer query's FP8 codes (rows with tiny values too: subnormal codes kept) and the folded weights."""
    T, H, D = 11, 64, 128
    q = _randn(g, T, H, D).to(torch.bfloat16).float()
    q[2, :8] *= 1e-4
    positions, table = torch.randint(0, 512, (T,), generator=g), _rope_table(g)
    weights = _randn(g, T, H)
    want_q, got_q = (torch.empty(T, H, D, dtype=torch.float8_e4m3fn) for _ in range(2))
    want_w, got_w = torch.empty(T, H), torch.empty(T, H)
    torch.ops._C.fused_indexer_q_rope_quant_cpu(positions, q, table, want_q, weights, 128 ** -0.5, 64 ** -0.5, want_w)
    v4_ops.fused_indexer_q_rope_quant(positions, q, table, got_q, weights, 128 ** -0.5, 64 ** -0.5, got_w)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_w, want_w)


@needs_vllm_v4_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_equals_vllms(g, dtype):
    """V4's two routers: the same experts (as sets: the order of equal-weight picks is the kernel's), the same
    renormalised weights within 1e-5."""
    T, E, k = 41, 64, 6
    logits = _randn(g, T, E, scale=3.0).to(dtype)
    logits[0, :3] = 30.0                                 # softplus's linear branch, and a three-way tie
    bias = _randn(g, E, scale=0.1)
    want = torch.ops._C.biased_topk_cpu(logits, logits, bias, k, True, "sqrtsoftplus", 0, 2.5, True)
    got = v4_ops.biased_topk(logits, logits, bias, k, True, "sqrtsoftplus", 0, 2.5, True)
    table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    want_h = torch.ops._C.hash_topk_cpu(logits, table, k, "sqrtsoftplus", 0, E, 2.5)
    got_h = v4_ops.hash_topk(logits, table, k, "sqrtsoftplus", 0, E, 2.5)
    for (w_got, i_got), (w_want, i_want) in ((got, want), (got_h, want_h)):
        assert w_got.dtype == torch.float32 and i_got.dtype == torch.int32
        (ids_got, at_got), (ids_want, at_want) = i_got.sort(-1), i_want.sort(-1)
        assert torch.equal(ids_got, ids_want)
        # (vLLM's kernel takes a vectorised exp / log: within 1e-5 of weights that sum to 2.5)
        torch.testing.assert_close(w_got.gather(-1, at_got), w_want.gather(-1, at_want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="scoring_func='softmax'"):
        v4_ops.biased_topk(logits, logits, bias, k, True, "softmax", 0, 2.5, True)


def _compressor_case(g, ratio: int, head: int, length: int):
    """A request's compressor state (``[blocks, block_size, 2 W]``, W = coff x head, in a shuffled block table),
    its tokens' window slots and their compressed-cache slots (-1 where no group closes).  The state is a view of
    padded pages, as vLLM's is (not contiguous), the padding NaN."""
    coff, bs = (2, 4) if ratio == 4 else (1, 8)
    W, blocks = coff * head, -(-length // bs) + 2
    table = torch.randperm(blocks, generator=g)
    pages = torch.full((blocks, bs * 2 * W + 48), float("nan"))
    state = pages[:, :bs * 2 * W].unflatten(1, (bs, 2 * W))
    state.copy_(_randn(g, blocks, bs, 2 * W))
    positions = torch.arange(length)
    window = coff * ratio
    local = positions[:, None] - window + 1 + torch.arange(window)
    gather = torch.where(local >= 0, table[local.clamp(min=0) // bs] * bs + local.clamp(min=0) % bs, -1)
    cache_bs = 16
    cache_blocks = -(-(length // ratio) // cache_bs) + 2
    closes = torch.randperm(cache_blocks * cache_bs, generator=g)[positions // ratio]
    kv_slots = torch.where((positions + 1) % ratio == 0, closes, -1)
    kv_slots[min(ratio * 3, length) - 1] = -1             # a group whose compressed slot is padding: not stored
    return state, gather, positions, kv_slots, cache_bs, cache_blocks


@needs_vllm_v4_kernels
@pytest.mark.parametrize("ratio", [4, 128])
def test_save_partial_states_equals_vllms(g, ratio):
    head = 512
    state, _, positions, _, _, _ = _compressor_case(g, ratio, head, 400)
    T, W, bs = 97, state.size(-1) // 2, state.size(1)
    kv, score, ape = _randn(g, T, W), _randn(g, T, W), _randn(g, ratio, W)
    slots = torch.randperm(state.size(0) * bs, generator=g)[:T]
    slots[4] = -1
    ours, theirs = state.clone(), state.clone()
    torch.ops._C.save_partial_states_cpu(kv, score, ape, positions[:T] + 5, theirs, slots)
    v4_ops.save_partial_states(kv, score, ape, positions[:T] + 5, ours, slots)
    assert torch.equal(ours, theirs) and not torch.equal(ours, state)


@needs_vllm_v4_kernels
@pytest.mark.parametrize("ratio, head", [(4, 512), (128, 512), (4, 128)])
def test_compress_norm_rope_store_equals_vllms(g, ratio, head):
    """The compressed rows in the main (584-byte V4 rows) and indexer (132-byte) caches: the same FP8 codes and
    scales but for a summation-order flip now and then (the window's softmax and sums), the bf16 rope within a
    step, every byte no group writes untouched."""
    state, gather, positions, kv_slots, bs, blocks = _compressor_case(g, ratio, head, 300 if ratio == 4 else 640)
    row = 584 if head == 512 else 132
    raw = torch.randint(0, 256, (blocks, bs * row), dtype=torch.uint8, generator=g)
    ours, theirs = raw.clone(), raw.clone()
    w = torch.rand(head, generator=g) + 0.5
    table = _rope_table(g, positions=1024)
    args = (state, gather, positions, kv_slots, w, 1e-6, table)
    if head == 512:
        torch.ops._C.compress_norm_rope_store_cpu(*args, theirs, bs, ratio)
        v4_ops.compress_norm_rope_store(*args, ours, bs, ratio)
    else:
        torch.ops._C.compress_norm_rope_store_indexer_cpu(*args, theirs, bs, ratio)
        v4_ops.compress_norm_rope_store_indexer(*args, ours, bs, ratio)
    stored = kv_slots[kv_slots >= 0]
    body, scale = (576, 8) if head == 512 else (128, 4)
    mask = torch.zeros(blocks, bs * row, dtype=torch.bool)             # the bytes of the stored rows
    blk, off = stored // bs, stored % bs
    mask[blk[:, None], (off * body)[:, None] + torch.arange(body)] = True
    mask[blk[:, None], (bs * body + off * scale)[:, None] + torch.arange(scale)] = True
    assert stored.numel() > 2 and torch.equal(ours[~mask], raw[~mask]) and torch.equal(theirs[~mask], raw[~mask])
    assert _equal_share(ours[mask], theirs[mask]) > 0.999
    if head == 512:                                      # the rope parts: bf16 within a step
        rope = ours[:, :bs * 576].view(blocks, bs, 576)[..., 448:].contiguous().view(torch.bfloat16)
        want = theirs[:, :bs * 576].view(blocks, bs, 576)[..., 448:].contiguous().view(torch.bfloat16)
        _close_bf16(rope.view(-1, 64)[stored], want.view(-1, 64)[stored])


def test_install_supplies_every_op_where_the_library_lacks_them():
    """In a process that loads ``_C_AVX2`` (DSATTN_CPU_ISA=avx2): every V4 op is defined by ``install``, once,
    and a call reaches dsattn's version."""
    if isa.CLASSES.index(isa.cpu_class()) < isa.CLASSES.index("avx2"):
        pytest.skip(f"this CPU's class is {isa.cpu_class()}")
    code = ("import torch; from dsattn.integrations.vllm.platform import DsattnCpuPlatform; "
            "DsattnCpuPlatform.import_kernels(); from dsattn.integrations.vllm import v4_ops, v4_fp32; "
            "names = v4_ops.install(); assert v4_ops.install() == names; print('supplied', len(names)); "
            "x = torch.randn(3, 4, 64).bfloat16(); fn = torch.randn(4, 256) * 0.02; s = torch.ones(1); b = torch.zeros(4); "
            "print('same', torch.equal(torch.ops._C.hc_head_fused_cpu(x, fn, s, b, 1e-6, 1e-6), "
            "v4_fp32.hc_head(x, fn, s, b, 1e-6, 1e-6)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **isa.environment("avx2")))
    assert proc.returncode == 0, proc.stderr
    assert "supplied 13" in proc.stdout and "same True" in proc.stdout, proc.stdout


@needs_vllm_v4_kernels
def test_routing_kernels_refused_by_vllm_are_replaced_at_load():
    """vLLM's ``hash_topk_cpu`` / ``biased_topk_cpu`` take 64 / 128 / 256 / 384 experts with top-k 6 or 8 only (a
    distilled or pruned V4 with 8 experts and top-2 stopped at its first decode step).  In a fresh process (the
    replacement lasts the process): each refusal is found by one probe call, the op's CPU kernel becomes dsattn's,
    which then routes the refused shape as ``v4_ops`` does; a shape vLLM takes keeps vLLM's kernel."""
    code = """
import torch
from vllm import _custom_ops
from dsattn.integrations.vllm import v4_ops
assert v4_ops.routing_refusals(64, 6) == {}, 'vLLM takes 64 experts, top-6'
assert v4_ops.reroute_refused(64, 6) == {}
refused = v4_ops.reroute_refused(8, 2)
print('refused', sorted(refused))
assert all('unsupported num_experts 8' in r for r in refused.values()), refused
assert v4_ops.reroute_refused(8, 2) == {} and v4_ops.routing_refusals(8, 2) == {}
g = torch.Generator().manual_seed(0)
logits = torch.randn(9, 8, generator=g) * 3
table = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(9)]).to(torch.int32)
bias = torch.randn(8, generator=g) * 0.1
for got, want in ((torch.ops._C.hash_topk_cpu(logits, table, 2, 'sqrtsoftplus', 0, 8, 2.5),
                   v4_ops.hash_topk(logits, table, 2, 'sqrtsoftplus', 0, 8, 2.5)),
                  (torch.ops._C.biased_topk_cpu(logits, logits, bias, 2, True, 'sqrtsoftplus', 0, 2.5, True),
                   v4_ops.biased_topk(logits, logits, bias, 2, True, 'sqrtsoftplus', 0, 2.5, True))):
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
print('routed')
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused ['biased_topk_cpu', 'hash_topk_cpu']" in proc.stdout and "routed" in proc.stdout, proc.stdout
