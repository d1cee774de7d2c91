"""The golden references: the spec's math in plain, device-agnostic PyTorch, one function
per operator with the operator's signature (plus ``compute_dtype`` / ``emulate_rounding``
where the operator has a choice of arithmetic)."""
from .compressor.ref import compressor, compressor_inference
from .indexer.ref import lightning_indexer, quant_lightning_indexer, sparse_lightning_indexer_kl_loss_grad
from .kv_quant_attn.ref import kv_quant_sparse_flash_attention
from .quant.ref import dequant_block, dynamic_block_quant, kv_rmsnorm_rope_quant_cache
from .sharedkv.ref import sparse_attn_sharedkv, sparse_attn_sharedkv_packed
from .sparse_mla.ref import sparse_flash_mla, sparse_flash_mla_grad

__all__ = ["lightning_indexer", "sparse_lightning_indexer_kl_loss_grad", "sparse_flash_mla",
           "sparse_flash_mla_grad", "compressor", "compressor_inference", "dynamic_block_quant", "dequant_block",
           "kv_rmsnorm_rope_quant_cache", "kv_quant_sparse_flash_attention", "sparse_attn_sharedkv",
           "sparse_attn_sharedkv_packed", "quant_lightning_indexer"]
