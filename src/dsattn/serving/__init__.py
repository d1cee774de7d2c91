"""Serving helpers (60-serving): partial-state merging, the host planner entry point, cache
writes by slot, the int32-safe last-location lookup, per-step CPU mirrors and the
compressor's rotary rows and slots, and key-sharded context parallelism."""
from ..common.softmax import merge_attention_states
from ..planner.host import sparse_attn_sharedkv_metadata_host
from .caches import get_last_loc, store_rows
from .context_parallel import context_parallel_attention, shard_partial
from .steps import build_cu_seqlens_q_cpu, build_seqused_kv_cpu, compressor_metadata, compressor_metadata_out

__all__ = ["merge_attention_states", "sparse_attn_sharedkv_metadata_host", "store_rows", "get_last_loc",
           "build_cu_seqlens_q_cpu", "build_seqused_kv_cpu", "compressor_metadata", "compressor_metadata_out",
           "context_parallel_attention", "shard_partial"]
