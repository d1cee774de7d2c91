"""``DeepseekV4Attention``: one attention layer (00 §3) over paged caches (60-serving).

Composed only of the library's operators: window rows are written with ``store_rows``; a
compressed layer runs ``compressor_inference`` (slots and rotary rows from
``compressor_metadata``); a CSA layer also runs the indexer compressor and
``lightning_indexer``; the attention is ``sparse_attn_sharedkv`` with the step's plan for the
layer type.  Every length the step needs comes from CPU mirrors (:class:`StepInputs`).

``kv_cache_dtype=torch.int8`` (or ``torch.float8_e4m3fn``) keeps the window and compressed
KV caches as packed rows (:func:`dsattn.quant.quantize_kv_rows`: the nope part quantised in
tiles of ``cfg.kv_quant_tile``, the rope part 16-bit, fp32 scales) and attends with
``sparse_attn_sharedkv_packed``, which dequantises only the rows it reads.  Indexer keys and
compressor states keep their own dtypes (60 §1: quantised indexer caches are out of scope,
the state is float32).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..common.memory import cache_zeros
from ..common.rope import rms_norm, rotary
from ..quant.block import PAYLOAD_DTYPES
from ..quant.rows import quantize_kv_rows, row_width
from ..serving import compressor_metadata, sparse_attn_sharedkv_metadata_host, store_rows
from .config import V4AttentionConfig, rope_frequencies, rope_tables

INTERLEAVE = 2


@dataclass
class StepInputs:
    """One step of a batch, device tensors plus the CPU mirrors they were made from."""
    cu_seqlens_q: torch.Tensor        # [B+1] int32 (device)
    cu_seqlens_q_cpu: torch.Tensor
    seqused_kv: torch.Tensor          # [B] int32 L_b (device)
    seqused_kv_cpu: torch.Tensor
    start_pos: torch.Tensor           # [B] int32 P_b
    positions: torch.Tensor           # [T] int64 absolute position of every new token
    raw_table: torch.Tensor           # [B, pages] int32: window cache and compressor state (block 0 = dummy)
    cmp_table: torch.Tensor           # [B, pages] int32: compressed and indexer-key caches
    window_slots: torch.Tensor        # [T] int64 flat slots of the new tokens' window rows
    plans: dict                       # ratio -> int32 (1024,) plan


@dataclass
class LayerCaches:
    window: torch.Tensor                       # [pages, page, 1, d]
    cmp: torch.Tensor | None = None            # [pages, page, 1, d]
    index_keys: torch.Tensor | None = None     # [pages, page, 1, index_dim]
    state: torch.Tensor | None = None          # fp32 [pages, page, 2·coff·d]
    index_state: torch.Tensor | None = None    # fp32 [pages, page, 2·2·index_dim]


# official tensor name (relative to a layer's ``attn`` module) -> this layer's weight key
OFFICIAL_NAMES = {
    "wq_a.weight": "wq_a", "q_norm.weight": "q_norm", "wq_b.weight": "wq_b", "wkv.weight": "wkv",
    "kv_norm.weight": "kv_norm", "attn_sink": "sinks", "wo_a.weight": "wo_a", "wo_b.weight": "wo_b",
    "compressor.wkv.weight": "cmp_wkv", "compressor.wgate.weight": "cmp_wgate", "compressor.ape": "cmp_ape",
    "compressor.norm.weight": "cmp_norm",
    "indexer.wq_b.weight": "idx_wq_b", "indexer.weights_proj.weight": "idx_w",
    "indexer.compressor.wkv.weight": "idx_wkv", "indexer.compressor.wgate.weight": "idx_wgate",
    "indexer.compressor.ape": "idx_ape", "indexer.compressor.norm.weight": "idx_norm",
}


def compressor_overlap(ratio: int) -> int:
    """``coff`` of the layer type's compressors: 2 (overlapping groups) for CSA, 1 for HCA."""
    return 2 if ratio == 4 else 1


def kv_row_bytes(cfg: V4AttentionConfig, kv_dtype: torch.dtype) -> int:
    """Bytes of one window / compressed KV row stored as ``kv_dtype`` (int8 / fp8: packed)."""
    if kv_dtype in PAYLOAD_DTYPES:
        return row_width(cfg.head_dim - cfg.rope_dim, cfg.rope_dim, cfg.kv_quant_tile)
    return cfg.head_dim * kv_dtype.itemsize


def _w(g, *shape, scale):
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


class DeepseekV4Attention:
    """Weights as plain tensors: float64 masters (``master``, random from ``seed`` or loaded with
    :meth:`load_state_dict`) and their casts to the layer dtype (``w``)."""

    def __init__(self, cfg: V4AttentionConfig, ratio: int, *, seed: int = 0, dtype=torch.float32,
                 max_positions: int = 4096, kv_cache_dtype: torch.dtype | None = None):
        if ratio not in (0, 4, 128):
            raise ValueError(f"ratio: value {ratio} is not one of [0, 4, 128]")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"dtype: {dtype} is not supported; expected torch.float16, torch.bfloat16, "
                            "torch.float32 or torch.float64")
        if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
            raise ValueError(f"max_positions: expected an int >= 1, got {max_positions!r}")
        if kv_cache_dtype not in (None, dtype) + PAYLOAD_DTYPES:
            raise TypeError(f"kv_cache_dtype: {kv_cache_dtype} is not supported; expected None (the layer dtype "
                            f"{dtype}), torch.int8 or torch.float8_e4m3fn")
        self.cfg, self.ratio, self.dtype = cfg, ratio, dtype
        self.kv_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
        self.packed = self.kv_dtype in PAYLOAD_DTYPES
        kv_row_bytes(cfg, self.kv_dtype)                        # validates a packed row's tiling
        g = torch.Generator().manual_seed(seed)
        c, h = cfg, cfg.hidden
        self.master = dict(
            wq_a=_w(g, c.q_lora_rank, h, scale=h ** -0.5), q_norm=1 + 0.1 * _w(g, c.q_lora_rank, scale=1),
            wq_b=_w(g, c.heads * c.head_dim, c.q_lora_rank, scale=c.q_lora_rank ** -0.5),
            wkv=_w(g, c.head_dim, h, scale=h ** -0.5), kv_norm=1 + 0.1 * _w(g, c.head_dim, scale=1),
            sinks=_w(g, c.heads, scale=1.0),
            wo_a=_w(g, c.o_groups, c.o_lora_rank, c.heads // c.o_groups * c.head_dim,
                    scale=(c.heads // c.o_groups * c.head_dim) ** -0.5),
            wo_b=_w(g, h, c.o_groups * c.o_lora_rank, scale=(c.o_groups * c.o_lora_rank) ** -0.5))
        if ratio:
            coff = compressor_overlap(ratio)
            self.coff = coff
            self.master.update(cmp_wkv=_w(g, coff * c.head_dim, h, scale=h ** -0.5),
                               cmp_wgate=_w(g, coff * c.head_dim, h, scale=h ** -0.5),
                               cmp_ape=_w(g, ratio, coff * c.head_dim, scale=0.5),
                               cmp_norm=1 + 0.1 * _w(g, c.head_dim, scale=1))
        if ratio == 4:
            Di = c.index_dim
            self.master.update(idx_wkv=_w(g, 2 * Di, h, scale=h ** -0.5), idx_wgate=_w(g, 2 * Di, h, scale=h ** -0.5),
                               idx_ape=_w(g, 4, 2 * Di, scale=0.5), idx_norm=1 + 0.1 * _w(g, Di, scale=1),
                               idx_wq_b=_w(g, c.index_heads * Di, c.q_lora_rank, scale=c.q_lora_rank ** -0.5),
                               idx_w=_w(g, c.index_heads, h, scale=h ** -0.5))
        self.freqs = rope_frequencies(cfg, ratio > 0)
        self.cos, self.sin = rope_tables(self.freqs, max_positions)
        self._cast_weights()

    def _cast_weights(self):
        fp32 = ("sinks", "cmp_ape", "idx_ape")                     # float32 by the operators' contracts
        self.w = {k: (v.float() if k in fp32 else v.to(self.dtype)) for k, v in self.master.items()}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The weights under the official DeepSeek-V4 tensor names, relative to the layer's ``attn``
        module (a checkpoint stores them as ``layers.{i}.attn.<name>`` or
        ``model.layers.{i}.attn.<name>``): ``wo_a.weight`` is the ``[o_groups·o_lora_rank,
        heads·head_dim / o_groups]`` linear weight."""
        out = {}
        for name, key in OFFICIAL_NAMES.items():
            if key in self.master:
                t = self.master[key]
                out[name] = t.reshape(-1, t.size(-1)) if key == "wo_a" else t
        return out

    def load_state_dict(self, state_dict: dict, prefix: str = "") -> None:
        """Load the official-name weights found under ``prefix`` (e.g. ``"model.layers.2.attn."``);
        every name this layer type has must be present with its shape, and no other name under
        the prefix may be.  Floating-point tensors only (dequantise FP8 checkpoint weights first)."""
        want = self.state_dict()
        got = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        missing = sorted(set(want) - set(got))
        if missing:
            raise ValueError(f"state_dict: missing {[prefix + m for m in missing]} for a ratio-{self.ratio} layer")
        extra = sorted(set(got) - set(want))
        if extra:
            raise ValueError(f"state_dict: unexpected {[prefix + e for e in extra]} for a ratio-{self.ratio} layer")
        for name, t in got.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.element_size() < 2:
                raise TypeError(f"state_dict: {prefix + name} must be a float16 / bfloat16 / float32 / float64 "
                                f"tensor, got {getattr(t, 'dtype', type(t))} (dequantise FP8 weights first)")
            if tuple(t.shape) != tuple(want[name].shape):
                raise ValueError(f"state_dict: {prefix + name} has shape {tuple(t.shape)}, expected "
                                 f"{tuple(want[name].shape)} for this config")
        for name, t in got.items():
            key = OFFICIAL_NAMES[name]
            self.master[key] = t.detach().to(torch.float64).reshape(self.master[key].shape).clone()
        self._cast_weights()

    # ------------------------------------------------------------------ caches
    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one window / compressed KV cache row."""
        return kv_row_bytes(self.cfg, self.kv_dtype)

    def new_caches(self, num_pages: int) -> LayerCaches:
        c, p, dt = self.cfg, self.cfg.page_size, self.dtype
        kv_width = self.kv_row_bytes if self.packed else c.head_dim
        caches = LayerCaches(window=cache_zeros(num_pages, p, 1, kv_width, dtype=self.kv_dtype))
        if self.ratio:
            caches.cmp = cache_zeros(num_pages, p, 1, kv_width, dtype=self.kv_dtype)
            caches.state = cache_zeros(num_pages, p, 2 * self.coff * c.head_dim, dtype=torch.get_default_dtype())
        if self.ratio == 4:
            caches.index_keys = cache_zeros(num_pages, p, 1, c.index_dim, dtype=dt)
            caches.index_state = cache_zeros(num_pages, p, 4 * c.index_dim, dtype=torch.get_default_dtype())
        return caches

    # ------------------------------------------------------------------ forward
    def _rope(self, t: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        R = self.cfg.rope_dim
        cos, sin = self.cos[positions], self.sin[positions]
        if t.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        rot = rotary(t[..., -R:].float(), cos, -sin if inverse else sin, INTERLEAVE).to(t.dtype)
        return torch.cat([t[..., :-R], rot], -1)

    def _cache_rows(self, rows: torch.Tensor, clock) -> torch.Tensor:
        """KV rows ``[T, D]`` as the cache stores them ``[T, 1, width]``."""
        if not self.packed:
            return rows[:, None]
        with clock("quantize_kv_rows"):
            return quantize_kv_rows(rows, self.cfg.rope_dim, self.kv_dtype, self.cfg.kv_quant_tile)[:, None]

    def _check_input(self, x, step) -> None:
        """Shape / dtype checks only (no device read): x is ``[T, hidden]`` in the layer dtype with
        one row per new token of the step."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a tensor, got {type(x).__name__}")
        if x.dtype != self.dtype:
            raise TypeError(f"x: dtype {x.dtype} is not supported; expected the layer dtype {self.dtype}")
        if x.dim() != 2 or x.size(1) != self.cfg.hidden:
            raise ValueError(f"x: expected shape [T, hidden={self.cfg.hidden}], got {tuple(x.shape)}")
        if not isinstance(step, StepInputs):
            raise TypeError(f"step: expected StepInputs (PagedBatch.step), got {type(step).__name__}")
        if x.size(0) != step.positions.numel():
            raise ValueError(f"x: has {x.size(0)} rows but the step has {step.positions.numel()} new tokens")

    def forward(self, x: torch.Tensor, step: StepInputs, caches: LayerCaches,
                timer: dict | None = None) -> torch.Tensor:
        """``timer``: optional dict that accumulates seconds per operator."""
        c, w, r = self.cfg, self.w, self.ratio
        self._check_input(x, step)
        clock = _Clock(timer)
        T = x.size(0)
        B = step.cu_seqlens_q.numel() - 1
        qr = rms_norm((x @ w["wq_a"].T).float(), w["q_norm"].float(), c.eps).to(x.dtype)
        q = (qr @ w["wq_b"].T).view(T, c.heads, c.head_dim).float()
        q = (q * torch.rsqrt((q * q).mean(-1, keepdim=True) + c.eps)).to(x.dtype)
        q = self._rope(q, step.positions)
        kv = rms_norm((x @ w["wkv"].T).float(), w["kv_norm"].float(), c.eps).to(x.dtype)
        kv = self._rope(kv, step.positions)
        kv_rows = self._cache_rows(kv, clock)
        with clock("store_rows"):
            store_rows(caches.window, kv_rows, step.window_slots)
        attn_kw = dict(ori_kv=caches.window, ori_block_table=step.raw_table, cu_seqlens_q=step.cu_seqlens_q,
                       seqused_kv=step.seqused_kv, sinks=w["sinks"], metadata=step.plans.get(r),
                       softmax_scale=c.softmax_scale, ori_win_left=c.window - 1, layout_q="TND", layout_kv="PA_ND")
        if r:
            num_rows = min(T, T // r + B)
            with clock("compressor_metadata"):
                cos, sin, slots = compressor_metadata(self.cos, self.sin, step.cu_seqlens_q, step.start_pos,
                                                      step.cmp_table, kv_block_size=c.page_size,
                                                      compress_ratio=r, num_rows=num_rows)
            common = dict(state_block_table=step.raw_table, cu_seqlens=step.cu_seqlens_q, start_pos=step.start_pos)
            with clock("compressor_inference"):
                ckv = torch.ops.dsattn.compressor_inference(x, w["cmp_wkv"], w["cmp_wgate"], caches.state, w["cmp_ape"],
                                               w["cmp_norm"].float(), sin, cos, c.rope_dim, r, coff=self.coff,
                                               norm_eps=c.eps, rotary_mode=INTERLEAVE, **common)
            cmp_rows = self._cache_rows(ckv, clock)
            with clock("store_rows"):
                store_rows(caches.cmp, cmp_rows, slots)
            attn_kw.update(cmp_kv=caches.cmp, cmp_block_table=step.cmp_table, cmp_ratio=r)
            if r == 4:
                with clock("compressor_inference"):
                    ik = torch.ops.dsattn.compressor_inference(x, w["idx_wkv"], w["idx_wgate"], caches.index_state,
                                                  w["idx_ape"], w["idx_norm"].float(), sin, cos, c.rope_dim, 4,
                                                  coff=2, norm_eps=c.eps, rotary_mode=INTERLEAVE, **common)
                with clock("store_rows"):
                    store_rows(caches.index_keys, ik[:, None], slots)
                iq = self._rope((qr @ w["idx_wq_b"].T).view(T, c.index_heads, c.index_dim), step.positions)
                iw = (x @ w["idx_w"].T).float() * (c.index_dim ** -0.5 * c.index_heads ** -0.5)
                with clock("lightning_indexer"):
                    top, _ = torch.ops.dsattn.lightning_indexer(
                        iq, caches.index_keys, iw, c.index_topk, cu_seqlens_q=step.cu_seqlens_q,
                        seqused_k=torch.div(step.seqused_kv, 4, rounding_mode="floor"),
                        cmp_residual_k=step.seqused_kv % 4, block_table=step.cmp_table, layout_q="TND",
                        layout_k="PA_BBND", mask_mode=3, cmp_ratio=4)
                attn_kw["cmp_sparse_indices"] = top
                self.last_topk = top
        if self.packed:
            with clock("sparse_attn_sharedkv_packed"):
                o, _ = torch.ops.dsattn.sparse_attn_sharedkv_packed(q, kv_rope_dim=c.rope_dim,
                                                                    kv_tile_size=c.kv_quant_tile, **attn_kw)
        else:
            with clock("sparse_attn_sharedkv"):
                o, _ = torch.ops.dsattn.sparse_attn_sharedkv(q, **attn_kw)
        o = self._rope(o, step.positions, inverse=True)
        G = c.o_groups
        o = torch.einsum("tgk,gok->tgo", o.reshape(T, G, -1), w["wo_a"]).reshape(T, -1)
        return o @ w["wo_b"].T


class _Clock:
    """Accumulates wall seconds per name into a dict (or does nothing without one)."""

    def __init__(self, sink: dict | None):
        self.sink, self.name = sink, None

    def __call__(self, name: str):
        self.name = name
        return self

    def __enter__(self):
        if self.sink is not None:                  # no clock reads otherwise (graph capture, compile)
            self.t = time.perf_counter()

    def __exit__(self, *exc):
        if self.sink is not None:
            self.sink[self.name] = self.sink.get(self.name, 0.0) + time.perf_counter() - self.t


class PagedBatch:
    """Requests of a serving simulation: page allocation (page 0 is the reserved dummy), block
    tables, slots, CPU mirrors, and the per-step plans; nothing here reads device memory.

    Raw pages hold a request's window KV rows and compressor state rows (one table for both).
    With ``release_old_pages`` a step first returns the raw pages that no layer can read any more
    (60 §1): pages wholly below :meth:`first_needed_position`; their table entries become -1.
    Compressed and indexer-key pages are kept (every compressed entry stays readable).
    """

    def __init__(self, cfg: V4AttentionConfig, num_pages: int, max_pages_per_req: int, *,
                 release_old_pages: bool = False):
        for name, v, lo in (("num_pages", num_pages, 2), ("max_pages_per_req", max_pages_per_req, 1)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
            if v < lo:
                raise ValueError(f"{name}: must be >= {lo} (page 0 is the reserved dummy page), got {v}")
        self.cfg = cfg
        self.free = list(range(num_pages - 1, 0, -1))
        self.raw_pages: dict = {}
        self.cmp_pages: dict = {}
        self.lengths: dict = {}
        self.max_pages = max_pages_per_req
        self.release_old_pages = release_old_pages

    def _ensure(self, pages: dict, rid, n_entries: int):
        need = -(-n_entries // self.cfg.page_size)
        lst = pages.setdefault(rid, [])
        if need > self.max_pages:
            raise RuntimeError(f"PagedBatch: request {rid!r} needs {need} pages, more than max_pages_per_req="
                               f"{self.max_pages}")
        while len(lst) < need:
            if not self.free:
                raise RuntimeError("PagedBatch: out of pages")
            lst.append(self.free.pop())

    def first_needed_position(self, prefix: int, ratios=(0, 4, 128)) -> int:
        """Lowest raw position a step over a cached ``prefix`` reads: the window of its first query
        (``prefix - window + 1``) and, for each compressed layer type, the compressor state of the
        open group and, with overlap, the group before it (``(prefix // r - (coff - 1)) · r``)."""
        lo = prefix - self.cfg.window + 1
        for r in ratios:
            if r:
                lo = min(lo, (prefix // r - (compressor_overlap(r) - 1)) * r)
        return max(lo, 0)

    def _release(self, rid, prefix: int, ratios) -> None:
        pages = self.raw_pages.get(rid, [])
        for col in range(min(self.first_needed_position(prefix, ratios) // self.cfg.page_size, len(pages))):
            if pages[col] >= 0:
                self.free.append(pages[col])
                pages[col] = -1

    def finish(self, rid) -> None:
        """Return every page of a finished request."""
        for pages in (self.raw_pages.pop(rid, []), self.cmp_pages.pop(rid, [])):
            self.free.extend(p for p in pages if p >= 0)
        self.lengths.pop(rid, None)

    def pages_held(self, rid) -> int:
        return sum(p >= 0 for p in self.raw_pages.get(rid, [])) + len(self.cmp_pages.get(rid, []))

    def step(self, requests: list, new_tokens: list[int], heads: int, ratios=(0, 4, 128),
             pad_to: int | None = None) -> StepInputs:
        """The step's inputs.  ``pad_to`` (decode under graph replay) appends padding requests up to
        a batch bucket: one query token each, key length clamped to 1 (the dummy page 0), window slot
        -1, compressor start 0 over block 0 (not backed): they read only the dummy page and write
        nothing."""
        from ..serving import build_cu_seqlens_q_cpu, build_seqused_kv_cpu
        cfg = self.cfg
        requests, new_tokens = list(requests), list(new_tokens)
        if len(new_tokens) != len(requests):
            raise ValueError(f"new_tokens: expected one count per request ({len(requests)}), got {len(new_tokens)}")
        if len(set(requests)) != len(requests):
            raise ValueError(f"requests: each request may appear once per step, got {requests}")
        for rid, n in zip(requests, new_tokens):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"new_tokens: the count of request {rid!r} must be an int >= 0, got {n!r}")
        pad = 0 if pad_to is None else pad_to - len(requests)
        if pad < 0:
            raise ValueError(f"pad_to: {pad_to} is smaller than the {len(requests)} requests of the step")
        P = [self.lengths.get(rid, 0) for rid in requests]
        L = [p + n for p, n in zip(P, new_tokens)]
        if self.release_old_pages:
            for rid, p in zip(requests, P):
                self._release(rid, p, ratios)
        for rid, length in zip(requests, L):
            self._ensure(self.raw_pages, rid, length)
            self._ensure(self.cmp_pages, rid, length // 4 + 1)
            self.lengths[rid] = length
        B = len(requests) + pad
        # (host bookkeeping in NumPy: one array op per step, not a few torch calls per request)
        raw = np.zeros((B, self.max_pages), dtype=np.int32)
        cmpt = np.full((B, self.max_pages), -1, dtype=np.int32)
        for b, rid in enumerate(requests):
            raw[b, :len(self.raw_pages[rid])] = self.raw_pages[rid]
            cmpt[b, :len(self.cmp_pages[rid])] = self.cmp_pages[rid]
        P, L, new_tokens = P + [0] * pad, L + [0] * pad, list(new_tokens) + [1] * pad
        cu = build_cu_seqlens_q_cpu("prefill", seq_lens_cpu=torch.tensor(new_tokens))
        used = build_seqused_kv_cpu(torch.tensor(L), B)              # padding: clamped to 1 key
        # every new token's batch and position, then its window slot through the raw page table
        n_new = np.asarray(new_tokens, dtype=np.int64)
        tok_b = np.repeat(np.arange(B), n_new)
        starts = np.cumsum(n_new) - n_new
        pos = np.arange(int(n_new.sum()), dtype=np.int64) - starts[tok_b] + np.asarray(P, dtype=np.int64)[tok_b]
        slots = raw[tok_b, pos // cfg.page_size].astype(np.int64) * cfg.page_size + pos % cfg.page_size
        if pad:
            slots[-pad:] = -1                                         # padding tokens write no window row
        positions, slots = torch.from_numpy(pos), torch.from_numpy(slots)
        raw, cmpt = torch.from_numpy(raw), torch.from_numpy(cmpt)
        plans = {}
        for r in ratios:
            if r == 0:
                kw = dict(has_cmp_kv=False, cmp_ratio=1)
            else:
                kw = dict(cmp_ratio=r, cmp_topk=cfg.index_topk if r == 4 else 0)
            plans[r] = sparse_attn_sharedkv_metadata_host(heads, 1, cfg.head_dim, "TND", "PA_ND", cu, used,
                                                          ori_win_left=cfg.window - 1, **kw)
        return StepInputs(cu, cu, used, used, torch.tensor(P, dtype=torch.int32), positions.long(), raw, cmpt,
                          slots.long(), plans)
