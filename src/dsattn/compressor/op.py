"""Registration of ``dsattn::compressor`` (differentiable) and ``dsattn::compressor_inference``.

``compressor`` mutates ``state_cache``, and ``torch.library.register_autograd`` refuses
operators with mutated arguments, so its backward is registered the way the dispatcher allows
for such ops: an ``Autograd`` kernel that runs the forward inside an
:class:`torch.autograd.Function` (saving the softmax weights and slot values of §4) whenever
x, wkv, wgate or ape require grad, and otherwise redispatches below autograd.  The state
cache receives no gradient.
"""
from __future__ import annotations

import torch

from .._registry import LIB, register
from . import fast
from .postprocess import check_inference_args, normalize_and_rotate
from .problem import parse_compressor

COMPRESSOR_SCHEMA = (
    "compressor(Tensor x, Tensor wkv, Tensor wgate, Tensor(a!) state_cache, Tensor ape, "
    "int cmp_ratio=4, *, Tensor? state_block_table=None, Tensor? cu_seqlens=None, "
    "Tensor? seqused=None, Tensor? start_pos=None, int coff=1, int cache_mode=1) -> Tensor")

COMPRESSOR_INFERENCE_SCHEMA = (
    "compressor_inference(Tensor x, Tensor wkv, Tensor wgate, Tensor(a!) state_cache, "
    "Tensor ape, Tensor norm_weight, Tensor rope_sin, Tensor rope_cos, "
    "int rope_head_dim, int cmp_ratio, *, Tensor? state_block_table=None, "
    "Tensor? cu_seqlens=None, Tensor? seqused=None, Tensor? start_pos=None, "
    "int coff=1, float norm_eps=1e-06, int rotary_mode=1, int cache_mode=1) -> Tensor")

_INFERENCE_ATTRS = (("norm_eps", 1e-6), ("rotary_mode", 1))


def _kernel(x, wkv, wgate, state_cache, ape, cmp_ratio=4, **kw):
    return fast.forward(parse_compressor(x, wkv, wgate, state_cache, ape, cmp_ratio, **kw))


def _fake(x, wkv, wgate, state_cache, ape, cmp_ratio=4, **kw):
    pb = parse_compressor(x, wkv, wgate, state_cache, ape, cmp_ratio, content=False, **kw)
    return x.new_empty(pb.out_shape)


class _CompressorFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wkv, wgate, ape, state_cache, cmp_ratio, kw):
        pb = parse_compressor(x, wkv, wgate, state_cache, ape, cmp_ratio, **kw)
        C, _, saved = fast.compress(pb, save=True)
        ctx.pb, ctx.saved = pb, saved
        return C.to(x.dtype).reshape(pb.out_shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        dx, dwkv, dwgate, dape = fast.backward(ctx.pb, ctx.saved, grad)
        needs = ctx.needs_input_grad
        pick = lambda g, i: g if needs[i] else None  # noqa: E731
        return pick(dx, 0), pick(dwkv, 1), pick(dwgate, 2), pick(dape, 3), None, None, None


def _autograd_kernel(x, wkv, wgate, state_cache, ape, cmp_ratio=4, **kw):
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, wkv, wgate, ape)):
        return _CompressorFunction.apply(x, wkv, wgate, ape, state_cache, cmp_ratio, kw)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.dsattn.compressor(x, wkv, wgate, state_cache, ape, cmp_ratio, **kw)


def _split_inference(kw):
    post = {name: kw.pop(name, default) for name, default in _INFERENCE_ATTRS}
    return post


def _inference_kernel(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, rope_head_dim,
                      cmp_ratio, **kw):
    post = _split_inference(kw)
    pb = parse_compressor(x, wkv, wgate, state_cache, ape, cmp_ratio, **kw)
    sin, cos = check_inference_args(pb, norm_weight, rope_sin, rope_cos, rope_head_dim, post["norm_eps"],
                                    post["rotary_mode"])
    C, valid, _ = fast.compress(pb)
    rows = torch.arange(pb.N_out, device=x.device)
    y = normalize_and_rotate(pb, C, rows, norm_weight, sin, cos, rope_head_dim, post["norm_eps"],
                             post["rotary_mode"])
    y = torch.where(valid[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    return y.reshape(pb.out_shape)


def _inference_fake(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, rope_head_dim,
                    cmp_ratio, **kw):
    post = _split_inference(kw)
    pb = parse_compressor(x, wkv, wgate, state_cache, ape, cmp_ratio, content=False, **kw)
    check_inference_args(pb, norm_weight, rope_sin, rope_cos, rope_head_dim, post["norm_eps"], post["rotary_mode"])
    return x.new_empty(pb.out_shape)


register(COMPRESSOR_SCHEMA, _kernel, _fake)
LIB.impl("compressor", _autograd_kernel, "Autograd")
register(COMPRESSOR_INFERENCE_SCHEMA, _inference_kernel, _inference_fake)
