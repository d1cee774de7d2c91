"""One Python function per registered operator, with exactly the schema's signature.

Each calls ``torch.ops.dsattn.<name>``; the signatures are read from the registered schemas
(``dsattn._registry.op_function``), so the two cannot drift apart.
"""
from __future__ import annotations

from . import indexer as _indexer, sparse_mla as _sparse_mla  # noqa: F401  (register the ops)
from ._registry import op_function

lightning_indexer = op_function("lightning_indexer")
sparse_lightning_indexer_kl_loss_grad = op_function("sparse_lightning_indexer_kl_loss_grad")
sparse_flash_mla = op_function("sparse_flash_mla")
sparse_flash_mla_grad = op_function("sparse_flash_mla_grad")

__all__ = ["lightning_indexer", "sparse_lightning_indexer_kl_loss_grad", "sparse_flash_mla",
           "sparse_flash_mla_grad"]
