"""Quantised indexer keys: int8 or FP8 e4m3 values with one fp32 scale per token, as serving stacks
keep the lightning indexer's key cache (``quant_lightning_indexer`` reads them in place).

Formats (the key tensor's dtype says which): ``torch.int8`` (scale ``amax / 127``, the Ascend pool) and
``torch.float8_e4m3fn`` (scale ``amax / 448``, vLLM / DeepGEMM), one scale per token over its D values,
quantised by the library's per-tile rule (:func:`dsattn.quant.block.quantize_tiles` with one tile per
token: correctly rounded fp32 division, int8 rounds half to even, FP8 saturates; an all-zero token gets
scale 0, where vLLM floors amax at 1e-4: such a token decodes to 0 either way).  A key decodes as
``fp32(value) x scale``.

Where the scales lie (``key_scale_layout``):

* ``"separate"``: values ``[..., 1, D]``, scales in their own tensor ``[..., 1]`` (fp32 or fp16), the
  Ascend call's ``key`` / ``key_dequant_scale``;
* ``"row"``: each key row is its D value bytes, then its fp32 scale (4 bytes): ``[..., 1, D + 4]``;
* ``"block"`` (paged only): each block holds its tokens' values (``block_size x D`` bytes), then their
  fp32 scales (``block_size x 4`` bytes), vLLM's indexer cache: ``[num_blocks, block_size, 1, D + 4]``,
  ``[num_blocks, block_size, D + 4]`` or ``[num_blocks, block_size x (D + 4)]``, any block stride.

:class:`IndexKeyPool` is where every token's values and scale lie in bytes, for the kernels that
decode keys as they read them; :func:`store_index_keys` writes tokens into a paged cache of any of the
three layouts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.checks import check_choice, check_slots, content_checks_enabled, fail
from .block import quantize_tiles

KEY_DTYPES = (torch.int8, torch.float8_e4m3fn)
SCALE_LAYOUTS = ("separate", "row", "block")
SCALE_DTYPES = (torch.float32, torch.float16)
SCALE_BYTES = 4


def check_key_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype == torch.uint8:
        fail(name, "is uint8: view it as torch.int8 or torch.float8_e4m3fn to say which format its bytes hold",
             TypeError)
    if t.dtype not in KEY_DTYPES:
        fail(name, f"dtype {t.dtype} is not a quantised key format; expected torch.int8 or torch.float8_e4m3fn",
             TypeError)


def quantize_index_keys(k: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """Float keys ``[..., D]`` -> ``(values [..., D] of dtype, scales fp32 [...])``, one scale per token."""
    if dtype not in KEY_DTYPES:
        fail("dtype", f"expected torch.int8 or torch.float8_e4m3fn, got {dtype}", TypeError)
    if not k.is_floating_point() or k.dim() < 1 or k.size(-1) < 1:
        fail("k", f"expected a float tensor [..., D], got {k.dtype} {tuple(k.shape)}", TypeError)
    values, scales = quantize_tiles(k, dtype, k.size(-1))
    return values, scales[..., 0]


def dequantize_index_keys(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``fp32(values) x scales`` per token -> fp32 ``[..., D]`` (the keys the indexer scores)."""
    check_key_dtype("values", values)
    return values.float() * scales.float()[..., None]


def pack_index_rows(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The ``"row"`` layout: ``[..., D + 4]`` of the values' dtype, each row its values then its fp32 scale."""
    check_key_dtype("values", values)
    s = scales.to(torch.float32).contiguous()[..., None].view(torch.uint8)          # [..., 4]
    return torch.cat([values.view(torch.uint8), s], -1).view(values.dtype)


def pack_index_blocks(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The ``"block"`` layout from ``values [nb, bs, D]`` and ``scales [nb, bs]``: ``[nb, bs x (D + 4)]``
    of the values' dtype, each block its tokens' values, then their fp32 scales."""
    check_key_dtype("values", values)
    nb = values.size(0)
    s = scales.to(torch.float32).contiguous().view(torch.uint8).reshape(nb, -1)
    return torch.cat([values.contiguous().view(torch.uint8).reshape(nb, -1), s], 1).view(values.dtype)


def _float_view(base: torch.Tensor, byte_offset: int, size: tuple, byte_strides: tuple) -> torch.Tensor:
    """fp32 values at byte offsets of ``base``'s storage (offset and strides multiples of 4)."""
    out = torch.empty(0, dtype=torch.float32, device=base.device)
    return out.set_(base.untyped_storage(), byte_offset // 4, size, tuple(s // 4 for s in byte_strides))


@dataclass
class IndexKeyPool:
    """Token ``r`` (flat, ``r = block x bs + slot``) has its D value bytes at ``values[r // bs, r % bs]``
    and its scale at ``scales[r // bs, r % bs]``: strided views of the caller's own memory (no copy),
    whose strides the compiled kernel reads."""

    dtype: torch.dtype          # int8 / float8_e4m3fn
    D: int
    blocks: int
    bs: int
    values: torch.Tensor        # uint8 [blocks, bs, D] view
    scales: torch.Tensor        # [blocks, bs] view, fp32 (or fp16 for "separate")

    @property
    def rows(self) -> int:
        return self.blocks * self.bs

    def gather(self, block: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Decoded fp32 keys ``[..., D]`` of the tokens at ``(block, slot)``."""
        v = self.values[block, slot].view(self.dtype)
        return v.float() * self.scales[block, slot].float()[..., None]

    def dequantize(self) -> torch.Tensor:
        """Every token decoded: fp32 ``[blocks, bs, D]`` (the golden's keys)."""
        return self.values.view(self.dtype).float() * self.scales.float()[..., None]


def _strided(u: torch.Tensor, size: tuple, strides: tuple) -> torch.Tensor:
    return torch.as_strided(u, size, strides, u.storage_offset())


def _check_aligned(name: str, what: str, value: int) -> None:
    if value % SCALE_BYTES:
        fail(name, f"{what} of {value} bytes is not a multiple of 4: the fp32 scales it holds must be aligned")


def index_key_pool(key: torch.Tensor, key_dequant_scale: torch.Tensor | None, layout: str, scale_layout: str,
                   D: int) -> IndexKeyPool:
    """Validate the key cache of ``layout`` (``"BSND"`` ``[B, S2, 1, *]``, ``"TND"`` ``[T2, 1, *]``,
    ``"PA_BBND"`` paged) in ``scale_layout`` for queries of head dim ``D``, and describe it.  Blocks are
    the batches (BSND), the tokens (TND, block size 1) or the cache blocks (paged)."""
    check_choice("key_scale_layout", scale_layout, SCALE_LAYOUTS)
    check_key_dtype("key", key)
    paged = layout == "PA_BBND"
    if scale_layout == "block" and not paged:
        fail("key_scale_layout", f"'block' holds a paged cache's blocks; layout_k {layout!r} has none (use 'separate' "
             "or 'row')")
    if scale_layout != "separate" and key_dequant_scale is not None:
        fail("key_dequant_scale", f"must be None with key_scale_layout={scale_layout!r} (the scales are in key)")
    if scale_layout == "separate" and key_dequant_scale is None:
        fail("key_dequant_scale", "is required with key_scale_layout='separate' (or give keys with their scales "
             "in place: key_scale_layout 'row' or 'block')")
    width = D if scale_layout == "separate" else D + SCALE_BYTES
    u = key.view(torch.uint8)
    if scale_layout == "block" and key.dim() == 2:
        if key.size(1) % width or key.size(1) == 0:
            fail("key", f"a [num_blocks, block bytes] block cache needs block bytes = block_size x (D + 4) = "
                 f"block_size x {width}; got {key.size(1)}")
        if key.stride(1) != 1:
            fail("key", "each block's bytes must lie one after another (stride 1 in the last dim)")
        blocks, bs, block_stride, row_stride = key.size(0), key.size(1) // width, key.stride(0), width
    else:
        rank = 3 if layout == "TND" else 4
        shapes = {"BSND": "[B, S2, 1, {w}]", "TND": "[T2, 1, {w}]", "PA_BBND": "[num_blocks, block_size, 1, {w}]"}
        ok_rank = key.dim() == rank or (scale_layout == "block" and key.dim() == 3)
        if not ok_rank or key.size(-1) != width or (key.dim() == rank and key.size(-2) != 1):
            extra = " (or [num_blocks, block_size, {w}], [num_blocks, block bytes])" if scale_layout == "block" else ""
            fail("key", f"expected {(shapes[layout] + extra).format(w=width)} for key_scale_layout={scale_layout!r} "
                 f"and head dim {D} ({'D' if width == D else 'D + 4 scale bytes'} per row), got {tuple(key.shape)}")
        if key.stride(-1) != 1:
            fail("key", "each key row's bytes must lie one after another (stride 1 in the last dim)")
        if layout == "TND":
            blocks, bs, block_stride, row_stride = key.size(0), 1, key.stride(0), key.stride(0)
        else:
            blocks, bs, block_stride, row_stride = key.size(0), key.size(1), key.stride(0), key.stride(1)
        if scale_layout == "block" and row_stride != width and bs > 1:
            fail("key", f"a block's rows must lie one after another ({width} bytes apart), got stride {row_stride}")
    if paged and bs < 1:
        fail("key", f"block_size {bs} must be >= 1")
    if blocks and bs and block_stride < (bs * width if scale_layout == "block" else 1):
        fail("key", f"block stride {block_stride} bytes cannot hold a block of {bs} x {width} bytes")
    if scale_layout == "block":
        values = _strided(u, (blocks, bs, D), (block_stride, D, 1))
        _check_aligned("key", "the block stride", block_stride)
        _check_aligned("key", "the byte offset", u.storage_offset())
        scales = _float_view(u, u.storage_offset() + bs * D, (blocks, bs), (block_stride, SCALE_BYTES))
    else:
        values = _strided(u, (blocks, bs, D), (block_stride, row_stride, 1))
        if scale_layout == "row":
            for what, v in (("the row stride", row_stride), ("the block stride", block_stride),
                            ("the byte offset", u.storage_offset())):
                _check_aligned("key", what, v)
            scales = _float_view(u, u.storage_offset() + D, (blocks, bs), (block_stride, row_stride))
        else:
            scales = _separate_scales(key_dequant_scale, key, layout, blocks, bs)
    return IndexKeyPool(key.dtype, D, blocks, bs, values, scales)


def _separate_scales(s: torch.Tensor, key: torch.Tensor, layout: str, blocks: int, bs: int) -> torch.Tensor:
    if not isinstance(s, torch.Tensor):
        fail("key_dequant_scale", f"expected a tensor, got {type(s).__name__}", TypeError)
    if s.dtype not in SCALE_DTYPES:
        fail("key_dequant_scale", f"dtype {s.dtype} is not supported; expected torch.float32 or torch.float16",
             TypeError)
    want = tuple(key.shape[:-1])
    if tuple(s.shape) != want:
        fail("key_dequant_scale", f"expected one scale per key row, shape {list(want)}, got {tuple(s.shape)}")
    if s.device != key.device:
        fail("key_dequant_scale", f"is on {s.device} but key is on {key.device}")
    if layout == "TND":
        return s[:, 0].view(blocks, 1) if blocks else s.new_empty((0, 1))
    return s[:, :, 0]


def store_index_keys(k: torch.Tensor, slot_mapping: torch.Tensor, key_cache: torch.Tensor,
                     key_scale_cache: torch.Tensor | None = None, *, key_scale_layout: str = "separate") -> torch.Tensor:
    """Quantise float keys ``k [T, D]`` to the cache's format (its dtype) and write token ``t`` at flat slot
    ``slot_mapping[t]`` (``block x block_size + offset``; -1: not written) of a paged key cache in
    ``key_scale_layout``; ``key_scale_cache`` ``[num_blocks, block_size, 1]`` holds the scales of a
    ``"separate"`` cache.  Returns the scales written (fp32 ``[T]``)."""
    if not isinstance(k, torch.Tensor) or not k.is_floating_point() or k.dim() != 2:
        fail("k", f"expected a float [T, D] tensor, got {getattr(k, 'dtype', type(k))} "
             f"{tuple(getattr(k, 'shape', ()))}", TypeError)
    if slot_mapping.dtype not in (torch.int32, torch.int64) or tuple(slot_mapping.shape) != (k.size(0),):
        fail("slot_mapping", f"expected int32 / int64 [T={k.size(0)}], got {slot_mapping.dtype} "
             f"{tuple(slot_mapping.shape)}")
    pool = index_key_pool(key_cache, key_scale_cache, "PA_BBND", key_scale_layout, k.size(1))
    values, scales = quantize_index_keys(k, key_cache.dtype)
    slots = slot_mapping.to(torch.int64)
    if k.size(0) == 0:
        return scales
    if content_checks_enabled(k, slot_mapping):
        check_slots(slot_mapping, pool.rows)
    keep = slots >= 0
    # skipped tokens rewrite the first kept token's slot with its bytes (no data-dependent shapes: no
    # host sync on an accelerator); with none kept, token 0 rewrites slot 0 with what it holds
    first = torch.argmax(keep.to(torch.int8)).reshape(1)
    keep0 = keep.index_select(0, first)
    slot0 = torch.where(keep0, slots.index_select(0, first), torch.zeros_like(slots[:1]))
    slots = torch.where(keep, slots, slot0)
    block, slot = slots // pool.bs, slots % pool.bs
    b0, s0 = slot0 // pool.bs, slot0 % pool.bs
    v = values.view(torch.uint8)
    v0 = torch.where(keep0[:, None], v.index_select(0, first), pool.values[b0, s0])
    sc = scales.to(pool.scales.dtype)
    sc0 = torch.where(keep0, sc.index_select(0, first), pool.scales[b0, s0])
    pool.values[block, slot] = torch.where(keep[:, None], v, v0)
    pool.scales[block, slot] = torch.where(keep, sc, sc0)
    return scales
