"""Two-branch sparse attention: sparse_flash_mla and its gradient (20-sparse-flash-mla)."""
from . import op  # noqa: F401  (registers the operators)
