"""dsattn: DeepSeek sparse attention operators (V4 CSA/HCA, V3.2 DSA) for any hardware.

* ``dsattn.ops`` — the registered operators (``torch.ops.dsattn.*``), one function each;
* ``dsattn.reference`` — their golden references;
* the hyper-parallel ``npu_*`` interface (``dsattn.hyper_parallel``), re-exported here;
* ``dsattn.testing`` — the comparison rules; ``dsattn.serving`` — serving helpers.
"""
from .native.isa import cap_onednn as _cap_onednn

_cap_onednn()                 # (DSATTN_CPU_ISA caps oneDNN too, where the process has not run it yet)

from . import ops, quant  # noqa: E402
from .common.checks import set_content_checks
from .common.softmax import set_flash_attention
from .hyper_parallel import (SparseFlashMlaFunction, npu_lightning_indexer, npu_quant_lightning_indexer,
                             npu_sparse_flash_mla,
                             npu_sparse_flash_mla_grad, npu_sparse_lightning_indexer_kl_loss_grad)
from .ops import (compressor, compressor_inference, dequant_block, dynamic_block_quant,
                  kv_quant_sparse_flash_attention, kv_rmsnorm_rope_quant_cache, lightning_indexer, quant_lightning_indexer,
                  sparse_attn_sharedkv,
                  sparse_attn_sharedkv_metadata, sparse_attn_sharedkv_packed, sparse_flash_mla, sparse_flash_mla_grad,
                  sparse_lightning_indexer_kl_loss_grad)

__version__ = "0.1.0"

__all__ = ["ops", "set_content_checks", "set_flash_attention", "SparseFlashMlaFunction", "npu_lightning_indexer", "npu_quant_lightning_indexer",
           "npu_sparse_flash_mla",
           "npu_sparse_flash_mla_grad", "npu_sparse_lightning_indexer_kl_loss_grad", "lightning_indexer",
           "sparse_flash_mla", "sparse_flash_mla_grad", "sparse_lightning_indexer_kl_loss_grad", "compressor",
           "compressor_inference", "dequant_block", "dynamic_block_quant", "kv_quant_sparse_flash_attention",
           "kv_rmsnorm_rope_quant_cache", "quant", "quant_lightning_indexer", "sparse_attn_sharedkv", "sparse_attn_sharedkv_metadata",
           "sparse_attn_sharedkv_packed"]
