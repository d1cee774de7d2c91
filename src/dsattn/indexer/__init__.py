"""Indexer operators: lightning_indexer, its KL-loss gradient (10-indexer) and quant_lightning_indexer
(quantised keys read in place)."""
from . import op, quant  # noqa: F401  (registers the operators)
