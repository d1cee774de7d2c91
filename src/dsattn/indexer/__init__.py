"""Indexer operators: lightning_indexer and its KL-loss gradient (10-indexer)."""
from . import op  # noqa: F401  (registers the operators)
