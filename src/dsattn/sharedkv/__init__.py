"""``sparse_attn_sharedkv`` (the serving form of sparse MLA over paged caches) and its
load-balancing plan ``sparse_attn_sharedkv_metadata`` (20 §4, 50)."""
from . import op  # noqa: F401  (registers the operators)
