"""Registration of ``dsattn::fp8_block_linear`` (no CANN counterpart: the W8A16 linear of FP8 block-scaled
checkpoints, shaped as vLLM's and DeepGEMM's block-scaled GEMMs take it):

    fp8_block_linear(Tensor x, Tensor weight, Tensor weight_scale, int[2] block_size=[128, 128],
                     Tensor? bias=None) -> Tensor

``x`` [..., K] bf16 / fp16 / fp32; ``weight`` [N, K] float8_e4m3fn (or its uint8 bits); ``weight_scale``
[ceil(N / bn), ceil(K / bk)] float32 (a checkpoint's ``weight_scale_inv``: w = code x scale) or float8_e8m0fnu;
``block_size`` [bn, bk]; the result [..., N] in x's dtype, each element the dequantised product summed in fp32
(the golden: :mod:`dsattn.weights.ref`).

    mxfp4_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias=None) -> Tensor

the same over MXFP4 weights (DeepSeek-V4's routed experts): ``weight`` uint8 [N, K / 2], e2m1 codes two a byte
(element 2i in the low nibble); ``weight_scale`` [N, K / 32] ue8m0 (float8_e8m0fnu or its uint8 bits) or float32."""
from __future__ import annotations

from .._registry import register
from . import dispatch
from .problem import parse_fp8_linear, parse_mxfp4_linear

SCHEMA = ("fp8_block_linear(Tensor x, Tensor weight, Tensor weight_scale, int[2] block_size=[128, 128], "
          "Tensor? bias=None) -> Tensor")
MXFP4_SCHEMA = "mxfp4_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias=None) -> Tensor"


def _kernel(x, weight, weight_scale, block_size=(128, 128), bias=None):
    P = parse_fp8_linear(x, weight, weight_scale, block_size, bias)
    return dispatch.choose(P).linear(P)


def _fake(x, weight, weight_scale, block_size=(128, 128), bias=None):
    P = parse_fp8_linear(x, weight, weight_scale, block_size, bias)
    return x.new_empty(P.out_shape)


def _mxfp4_kernel(x, weight, weight_scale, bias=None):
    P = parse_mxfp4_linear(x, weight, weight_scale, bias)
    return dispatch.choose(P).linear(P)


def _mxfp4_fake(x, weight, weight_scale, bias=None):
    return x.new_empty(parse_mxfp4_linear(x, weight, weight_scale, bias).out_shape)


register(SCHEMA, _kernel, _fake)
register(MXFP4_SCHEMA, _mxfp4_kernel, _mxfp4_fake)
