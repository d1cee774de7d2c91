"""Serving helpers: partial-state merging and the host entry point of the planner."""
from .common.softmax import merge_attention_states
from .planner.host import sparse_attn_sharedkv_metadata_host

__all__ = ["merge_attention_states", "sparse_attn_sharedkv_metadata_host"]
