"""The golden references: the spec's math in plain, device-agnostic PyTorch, one function
per operator with the operator's signature (plus ``compute_dtype`` / ``emulate_rounding``)."""
from .indexer.ref import lightning_indexer, sparse_lightning_indexer_kl_loss_grad
from .sparse_mla.ref import sparse_flash_mla, sparse_flash_mla_grad

__all__ = ["lightning_indexer", "sparse_lightning_indexer_kl_loss_grad", "sparse_flash_mla",
           "sparse_flash_mla_grad"]
