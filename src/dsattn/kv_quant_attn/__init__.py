"""``kv_quant_sparse_flash_attention``: sparse MLA attention over the packed int8/fp8 cache
(40-kv-quant §4)."""
from . import op  # noqa: F401  (registers the operator)
