"""Serving helpers.  For now: merging partial attention states by LSE (60-serving §7.2)."""
from .common.softmax import merge_attention_states

__all__ = ["merge_attention_states"]
