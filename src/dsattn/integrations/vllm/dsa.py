"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5) in vLLM on dsattn's CPU kernels.

Three pieces, each in vLLM's own extension points:

* :class:`DsattnSparseMLABackend`: the sparse MLA attention backend (selected by the platform).
  Every token, prefill or decode, takes the absorbed (576 / 512) path over its indexer top-k:
  ``dsattn.flashmla.flash_mla_with_kvcache`` on vLLM's paged cache, in place.  Caches: ``auto``
  (rows of the model dtype, 576 wide) and ``fp8_ds_mla`` (FlashMLA's 656-byte V3.2 rows), written
  by :meth:`DsattnSparseMLAImpl.do_kv_cache_update`.
* :class:`DsattnSparseAttnIndexer` (``CustomOp.register_oot`` over vLLM's ``SparseAttnIndexer``):
  writes the indexer keys and selects each token's ``index_topk`` keys with ``lightning_indexer``
  (``auto``: keys of the model dtype, a cache of the plug-in's spec) or ``quant_lightning_indexer``
  (``fp8_ds_mla``: vLLM's 132-byte FP8 indexer cache, values then scales per block).  Its metadata
  comes from :class:`DsattnIndexerBackend`'s builder (plain torch; vLLM's launches Triton kernels).
* the indexer's query: vLLM rounds it to FP8 (``per_token_group_quant_fp8``, a Triton kernel off
  CUDA) before scoring.  Here it stays in the model dtype, as in transformers' model and DeepSeek's
  reference, so that the top-k follows the model rather than the rounding
  (:func:`indexer_forward`, replacing ``Indexer.forward``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionLayer, AttentionMetadata,
                                       AttentionMetadataBuilder, CommonAttentionMetadata, MLAAttentionImpl,
                                       MultipleOf)
from vllm.v1.attention.backends.mla.sparse_utils import align_blocks_to_rows
from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

from ... import ops
from ...flashmla import flash_mla_with_kvcache, get_mla_metadata
from ...quant.flashmla import V32, quantize_cache
from ...quant.index_keys import store_index_keys
from ...serving.caches import store_rows
from . import v4

FP8_CACHE = "fp8_ds_mla"


def _quantised(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype == FP8_CACHE


# --------------------------------------------------------------------------------------------
# per-step metadata, one builder for the attention layers and the indexer caches (plain torch on host
# tensors: vLLM's builders launch Triton kernels)

@dataclass
class DsattnDSAMetadata(AttentionMetadata):
    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor      # int32 [num_reqs + 1]
    seq_lens: torch.Tensor             # int32 [num_reqs]: keys each request has after this step
    block_table: torch.Tensor          # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor         # int64 [num_actual_tokens]
    req_id_per_token: torch.Tensor     # int64 [num_actual_tokens]
    block_size: int
    topk_tokens: int
    # vLLM's MLA layer routes num_decode_tokens through forward_mqa and the rest through a dense
    # prefill; every token here takes the sparse path, so all count as decode tokens.
    num_decodes: int = 0
    num_prefills: int = 0
    num_decode_tokens: int = 0


class DsattnDSAMetadataBuilder(AttentionMetadataBuilder[DsattnDSAMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.topk_tokens = vllm_config.model_config.hf_text_config.index_topk

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> DsattnDSAMetadata:
        m = common_attn_metadata
        B, T = m.num_reqs, m.num_actual_tokens
        qsl = m.query_start_loc[:B + 1].to(torch.int32)
        lens = qsl.diff()
        req = torch.repeat_interleave(torch.arange(B, device=qsl.device), lens.long(), output_size=T)
        return DsattnDSAMetadata(
            num_reqs=B, num_actual_tokens=T, query_start_loc=qsl, seq_lens=m.seq_lens[:B].to(torch.int32),
            block_table=m.block_table_tensor[:B].to(torch.int32), slot_mapping=m.slot_mapping[:T].long(),
            req_id_per_token=req, block_size=self.kv_cache_spec.block_size, topk_tokens=self.topk_tokens,
            num_decodes=B, num_prefills=0, num_decode_tokens=T)


# --------------------------------------------------------------------------------------------
# the sparse MLA attention

class DsattnSparseMLABackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16", "float16", FP8_CACHE]

    @staticmethod
    def get_name() -> str:
        return "DSATTN_MLA_SPARSE"

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return align_blocks_to_rows(spec)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]

    @staticmethod
    def get_metadata_cls() -> type:
        return DsattnDSAMetadata

    @staticmethod
    def get_builder_cls() -> type:
        return DsattnDSAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type:
        return DsattnSparseMLAImpl

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [576]


def request_local_to_slots(idx: torch.Tensor, meta: DsattnDSAMetadata) -> torch.Tensor:
    """Request-local key positions ``[T, K]`` (-1: none) -> flat cache slots ``block * bs + offset``."""
    bs = meta.block_size
    valid = idx >= 0
    pos = idx.clamp(min=0).long()
    blocks = meta.block_table.long()[meta.req_id_per_token[:, None], pos // bs]
    return torch.where(valid, blocks * bs + pos % bs, -1).to(torch.int32)


class DsattnSparseMLAImpl(MLAAttentionImpl[DsattnDSAMetadata], SharedTopkIndicesBuffer):
    is_sparse = True

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes,
                 sliding_window, kv_cache_dtype: str, logits_soft_cap, attn_type: str,
                 kv_sharing_target_layer_name, topk_indices_buffer: torch.Tensor | None = None,
                 indexer=None, **mla_args) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank: int = mla_args["kv_lora_rank"]
        self.init_topk_indices_buffer(indexer, topk_indices_buffer)

    # vLLM's index groups (several layers sharing one top-k, HiSparse) are not used: each DSA layer
    # reads the top-k its own indexer just wrote, so there is nothing to record or prepare.
    def record_logical_topk_ready(self) -> None:
        pass

    def prepare_for_batch(self, attn_metadata) -> None:
        pass

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        if kv_cache.numel() == 0:
            return
        n = slot_mapping.size(0)
        rows = torch.cat([kv_c_normed[:n], k_pe[:n].reshape(n, -1)], dim=-1)
        if _quantised(kv_cache_dtype):
            rows = quantize_cache(rows.to(torch.bfloat16).view(n, 1, 1, -1), V32).view(torch.uint8).view(n, -1)
        store_rows(kv_cache, rows.to(kv_cache.dtype), slot_mapping)

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: DsattnDSAMetadata,
                    layer: AttentionLayer) -> tuple[torch.Tensor, None]:
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        T = q.size(0)
        idx = self.topk_indices_buffer[:T, :attn_metadata.topk_tokens]
        slots = request_local_to_slots(idx, attn_metadata)
        fp8 = _quantised(self.kv_cache_dtype)
        cache = kv_c_and_k_pe_cache.unsqueeze(2)
        sched, _ = get_mla_metadata()
        out, _ = flash_mla_with_kvcache(q.unsqueeze(1), cache, None, None, self.kv_lora_rank, sched,
                                        softmax_scale=self.scale, is_fp8_kvcache=fp8, indices=slots.unsqueeze(1))
        return out.view(T, self.num_heads, self.kv_lora_rank), None


# --------------------------------------------------------------------------------------------
# the indexer

class DsattnIndexerBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "DSATTN_DSA_INDEXER"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []

    @staticmethod
    def get_builder_cls() -> type:
        return DsattnDSAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type:
        raise NotImplementedError("the DSA indexer cache holds keys only; DsattnSparseAttnIndexer reads it")


def indexer_cache_spec(self, vllm_config: VllmConfig):
    """The indexer key cache: vLLM's 132-byte FP8 rows with ``fp8_ds_mla``, else keys of the model
    dtype (no rounding, as the model computes them)."""
    spec = _ORIGINAL["spec"](self, vllm_config)
    if _quantised(self.cache_config.cache_dtype):
        return spec
    # a fresh spec (its derived sizes follow head_size and dtype), same role and block size
    return MLAAttentionSpec(block_size=spec.block_size, num_kv_heads=1, max_tp_shards=1,
                            head_size=vllm_config.model_config.hf_text_config.index_head_dim,
                            dtype=vllm_config.model_config.dtype, cache_role=spec.cache_role)


def indexer_cache_backend(self):
    return DsattnIndexerBackend


def indexer_forward(self, hidden_states: torch.Tensor, qr: torch.Tensor, positions, rotary_emb) -> torch.Tensor:
    """``Indexer.forward`` with the query kept in the model dtype (see the module docstring)."""
    q, _ = self.wq_b(qr)
    q = q.view(-1, self.n_head, self.head_dim)
    kw, _ = self.wk_weights_proj(hidden_states)
    k = self.k_norm(kw[:, :self.head_dim]).to(q.dtype)
    weights = kw[:, self.head_dim:]
    q_pe, q_nope = torch.split(q, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
    k_pe, k_nope = torch.split(k, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
    q_pe, k_pe = rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
    q = torch.cat([q_pe.reshape(-1, self.n_head, self.rope_dim), q_nope], dim=-1)
    k = torch.cat([k_pe.reshape(-1, self.rope_dim), k_nope], dim=-1)
    weights = weights.float() * (self.softmax_scale * self.n_head_scale)
    return self.indexer_op(hidden_states, q, k, weights)


def dsa_indexer(q: torch.Tensor, k: torch.Tensor | None, weights: torch.Tensor, kv_cache: torch.Tensor,
                topk_indices_buffer: torch.Tensor, k_cache_prefix: str, topk_tokens: int) -> None:
    """Write this step's indexer keys into ``kv_cache`` and each token's top-k (request-local key
    positions, -1 padded) into ``topk_indices_buffer``.  An opaque op for vLLM's graph capture: the
    step's metadata is read from the forward context, as vLLM's own indexer op does."""
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return                                        # profiling run: no metadata
    meta: DsattnDSAMetadata = attn_metadata[k_cache_prefix]
    T = meta.num_actual_tokens
    fp8 = kv_cache.dtype == torch.uint8
    cache = kv_cache.view(torch.float8_e4m3fn) if fp8 else kv_cache   # fp8: values, then fp32 scales per block
    if k is not None:
        if fp8:
            store_index_keys(k[:T].float(), meta.slot_mapping, cache, key_scale_layout="block")
        else:
            store_rows(cache, k[:T].to(cache.dtype), meta.slot_mapping)
    common = dict(cu_seqlens_q=meta.query_start_loc, seqused_k=meta.seq_lens, block_table=meta.block_table,
                  layout_q="TND", layout_k="PA_BBND", mask_mode=3)
    if fp8:
        idx, _ = ops.quant_lightning_indexer(q[:T], cache, weights[:T].float(), None, None, topk_tokens, 0,
                                             key_scale_layout="block", **common)
    else:
        idx, _ = ops.lightning_indexer(q[:T], cache.unsqueeze(2), weights[:T].float(), topk_tokens, **common)
    topk_indices_buffer[:T, :topk_tokens] = idx[:, 0]


def _dsa_indexer_fake(q, k, weights, kv_cache, topk_indices_buffer, k_cache_prefix: str, topk_tokens: int) -> None:
    return None


class DsattnSparseAttnIndexer(SparseAttnIndexer):
    """vLLM's ``SparseAttnIndexer`` on dsattn: key write, scores and top-k in one op per layer."""

    def forward_cpu(self, hidden_states: torch.Tensor, q, k: torch.Tensor | None, weights: torch.Tensor):
        if self.compress_ratio > 1:                  # DeepSeek-V4's CSA indexer (compressed keys)
            return v4.csa_indexer(self, hidden_states, q, k, weights)
        torch.ops.vllm.dsattn_dsa_indexer(q, k, weights, self.k_cache.kv_cache, self.topk_indices_buffer,
                                          self.k_cache.prefix, self.topk_tokens)
        return self.topk_indices_buffer


_ORIGINAL: dict = {}


def install() -> None:
    """Point vLLM's DSA indexer at dsattn (idempotent)."""
    if _ORIGINAL:
        return
    from vllm.model_executor.models import deepseek_v2
    cache_cls = deepseek_v2.DeepseekV32IndexerCache
    _ORIGINAL["spec"] = cache_cls.get_kv_cache_spec
    cache_cls.get_kv_cache_spec = indexer_cache_spec
    cache_cls.get_attn_backend = indexer_cache_backend
    deepseek_v2.Indexer.forward = indexer_forward
    direct_register_custom_op("dsattn_dsa_indexer", dsa_indexer, mutates_args=["kv_cache", "topk_indices_buffer"],
                              fake_impl=_dsa_indexer_fake, dispatch_key="CPU")
    SparseAttnIndexer.register_oot(DsattnSparseAttnIndexer, name="SparseAttnIndexer")
