"""One Python function per registered operator, with exactly the schema's signature.

Each calls ``torch.ops.dsattn.<name>``; the signatures are read from the registered schemas
(``dsattn._registry.op_function``), so the two cannot drift apart.
"""
from __future__ import annotations

from . import compressor as _compressor, indexer as _indexer, kv_quant_attn as _kv_quant_attn  # noqa: F401
from . import quant as _quant, sharedkv as _sharedkv, sparse_mla as _sparse_mla  # noqa: F401  (register the ops)
from . import weights as _weights  # noqa: F401
from ._registry import op_function

lightning_indexer = op_function("lightning_indexer")
sparse_lightning_indexer_kl_loss_grad = op_function("sparse_lightning_indexer_kl_loss_grad")
sparse_flash_mla = op_function("sparse_flash_mla")
sparse_flash_mla_grad = op_function("sparse_flash_mla_grad")
compressor = op_function("compressor")
compressor_inference = op_function("compressor_inference")
dynamic_block_quant = op_function("dynamic_block_quant")
dequant_block = op_function("dequant_block")
kv_rmsnorm_rope_quant_cache = op_function("kv_rmsnorm_rope_quant_cache")
kv_quant_sparse_flash_attention = op_function("kv_quant_sparse_flash_attention")
sparse_attn_sharedkv = op_function("sparse_attn_sharedkv")
sparse_attn_sharedkv_packed = op_function("sparse_attn_sharedkv_packed")
sparse_attn_sharedkv_metadata = op_function("sparse_attn_sharedkv_metadata")
quant_lightning_indexer = op_function("quant_lightning_indexer")
fp8_block_linear = op_function("fp8_block_linear")
mxfp4_linear = op_function("mxfp4_linear")

__all__ = ["lightning_indexer", "sparse_lightning_indexer_kl_loss_grad", "sparse_flash_mla",
           "sparse_flash_mla_grad", "compressor", "compressor_inference", "dynamic_block_quant", "dequant_block",
           "kv_rmsnorm_rope_quant_cache", "kv_quant_sparse_flash_attention", "sparse_attn_sharedkv",
           "sparse_attn_sharedkv_packed", "sparse_attn_sharedkv_metadata", "quant_lightning_indexer", "fp8_block_linear",
           "mxfp4_linear"]
