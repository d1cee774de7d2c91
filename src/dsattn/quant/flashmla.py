"""FlashMLA's FP8 KV-cache layouts: readers and writers bit-exact against FlashMLA's quantiser, and
lossless conversion to and from dsattn's own packed rows (:mod:`dsattn.quant.rows`).

Both layouts quantise the "nope" part per tile with a power-of-two scale
``s = 2^ceil(log2(max(amax / 448, 1e-4)))`` (float32 arithmetic; the 1e-4 floor makes an all-zero
tile's scale 2^-13) and store ``fp8_e4m3(x / s)`` (round to nearest even); the RoPE part stays
bfloat16.

* **V3.2** (``d`` 576): 656 bytes per token, ``[512 fp8 nope | 4 fp32 scales (tiles of 128) |
  64 bf16 rope]``; a token is one row of the ``(num_blocks, block_size, 1, 656)`` cache (the block
  stride may be larger than ``block_size · 656``).
* **V4** (``d`` 512): 584 bytes per token, stored per block: ``block_size`` × 576 bytes
  ``[448 fp8 nope | 64 bf16 rope]``, then ``block_size`` × 8 bytes ``[7 ue8m0 scales (tiles of 64) |
  1 pad byte]``, the block padded to a multiple of 576 bytes.  The ``(num_blocks, block_size, 1,
  584)`` cache tensor is a view of each block's first ``block_size · 584`` bytes, so a "row" of it
  is not a token: tokens are addressed through the two regions (:func:`read_tokens`).

Dequantisation multiplies the fp8 value by its power-of-two scale, which is exact; values are
returned in bfloat16 as FlashMLA's ``dequantize_k_cache`` does (or float32 on request: the same
values).  dsattn's packed row ``[nope payload | rope 16-bit | fp32 scales]`` with the same tile
holds the same payload bytes and scales, so conversion from FlashMLA is lossless; conversion to
FlashMLA needs power-of-two scales (else ``ValueError``: such a row is not representable).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.checks import fail
from .rows import pack_kv_rows, unpack_kv_rows

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_FLOOR = 1e-4


@dataclass(frozen=True)
class FlashMLALayout:
    name: str
    d: int              # head dim of a token (nope + rope)
    d_nope: int
    d_rope: int
    tile: int
    block_major: bool   # V4: the block's nope/rope region, then its scale region

    @property
    def num_tiles(self) -> int:
        return self.d_nope // self.tile

    @property
    def scale_bytes(self) -> int:
        return 4 * self.num_tiles if not self.block_major else self.num_tiles + 1

    @property
    def row_bytes(self) -> int:
        return self.d_nope + 2 * self.d_rope + self.scale_bytes


V32 = FlashMLALayout("V3.2", 576, 512, 64, 128, False)
V4 = FlashMLALayout("V4", 512, 448, 64, 64, True)
LAYOUTS = {V32.row_bytes: V32, V4.row_bytes: V4}


def layout_of(cache: torch.Tensor, name: str = "k_cache") -> FlashMLALayout:
    """The layout of an FP8 cache ``(num_blocks, block_size, 1, 656 | 584)`` (one byte per element)."""
    if cache.dim() != 4 or cache.size(2) != 1:
        fail(name, f"expected an FP8 cache (num_blocks, block_size, 1, bytes_per_token), got {tuple(cache.shape)}")
    if cache.element_size() != 1:
        fail(name, f"dtype {cache.dtype} is not supported for an FP8 cache; expected float8_e4m3fn, uint8 or int8",
             TypeError)
    if cache.size(-1) not in LAYOUTS:
        fail(name, f"{cache.size(-1)} bytes per token is not a FlashMLA FP8 layout (656: V3.2, 584: V4)")
    return LAYOUTS[cache.size(-1)]


def tile_scales(nope: torch.Tensor, layout: FlashMLALayout) -> torch.Tensor:
    """Power-of-two scales ``[..., num_tiles]`` (float32) of the nope part ``[..., d_nope]``."""
    amax = nope.float().unflatten(-1, (layout.num_tiles, layout.tile)).abs().amax(-1) / FP8_MAX
    return torch.pow(2, amax.clamp_min(SCALE_FLOOR).log2().ceil())


def _quantize_nope(nope: torch.Tensor, scales: torch.Tensor, layout: FlashMLALayout) -> torch.Tensor:
    x = nope.float().unflatten(-1, (layout.num_tiles, layout.tile)) / scales[..., None]
    return x.flatten(-2).to(FP8)


def _check_source(k: torch.Tensor, layout: FlashMLALayout) -> None:
    if k.dim() != 4 or k.size(2) != 1 or k.size(-1) != layout.d:
        fail("k_cache", f"expected (num_blocks, block_size, 1, {layout.d}) for the {layout.name} layout, "
             f"got {tuple(k.shape)}")
    if k.dtype != torch.bfloat16:
        fail("k_cache", f"dtype {k.dtype} is not supported; expected torch.bfloat16 (the RoPE part is stored as "
             "bfloat16)", TypeError)


def quantize_cache(k: torch.Tensor, layout: FlashMLALayout) -> torch.Tensor:
    """A bf16 cache ``(num_blocks, block_size, 1, d)`` -> FlashMLA's FP8 cache of ``layout``
    (dtype float8_e4m3fn, like FlashMLA's ``quantize_k_cache``; V4's pad bytes are 0)."""
    _check_source(k, layout)
    k = k[:, :, 0]
    nope, rope = k[..., :layout.d_nope], k[..., layout.d_nope:]
    scales = tile_scales(nope, layout)                                    # [nb, bs, T]
    return assemble(_quantize_nope(nope, scales, layout), scales, rope, layout)


def assemble(payload: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor, layout: FlashMLALayout) -> torch.Tensor:
    """Fields ``payload fp8 [nb, bs, d_nope]``, ``scales fp32 [nb, bs, T]`` (powers of two) and ``rope
    bf16 [nb, bs, d_rope]`` -> the cache ``(nb, bs, 1, row_bytes)`` in ``layout``'s byte order."""
    nb, bs = payload.shape[:2]
    payload_bytes = payload.contiguous().view(torch.uint8)
    rope_bytes = rope.contiguous().view(torch.uint8)
    if not layout.block_major:
        row = torch.cat([payload_bytes, scales.contiguous().view(torch.uint8), rope_bytes], -1)
        return row.view(FP8)[:, :, None]
    body = layout.d_nope + 2 * layout.d_rope
    per_block = bs * layout.row_bytes
    padded = -(-per_block // body) * body
    raw = torch.zeros(nb, padded, dtype=torch.uint8, device=payload.device)
    raw[:, :bs * body] = torch.cat([payload_bytes, rope_bytes], -1).reshape(nb, -1)
    e8m0 = scales.to(torch.float8_e8m0fnu).view(torch.uint8)
    raw[:, bs * body:per_block] = torch.cat([e8m0, torch.zeros_like(e8m0[..., :1])], -1).reshape(nb, -1)
    return raw[:, :per_block].view(FP8).view(nb, bs, 1, layout.row_bytes)


def regions(cache: torch.Tensor, layout: FlashMLALayout):
    """V4: strided byte views ``(nope|rope [nb, bs, 576], scales [nb, bs, 8])`` of the blocks."""
    u8 = cache.view(torch.uint8)
    nb, bs = cache.shape[:2]
    if u8.stride(-1) != 1 or u8.stride(1) != layout.row_bytes or (nb > 1 and u8.stride(0) < bs * layout.row_bytes):
        fail("k_cache", f"a V4 cache must be the (num_blocks, block_size, 1, 584) view of contiguous blocks, got "
             f"strides {tuple(u8.stride())}")
    body = layout.d_nope + 2 * layout.d_rope
    base = u8.storage_offset()
    nope_rope = u8.as_strided((nb, bs, body), (u8.stride(0), body, 1), base)
    scales = u8.as_strided((nb, bs, layout.scale_bytes), (u8.stride(0), layout.scale_bytes, 1), base + bs * body)
    return nope_rope, scales


def read_tokens(cache: torch.Tensor, layout: FlashMLALayout, blk: torch.Tensor, off: torch.Tensor):
    """The fields of the tokens at ``(blk, off)`` (any shape): ``(payload fp8 [..., d_nope],
    scales fp32 [..., num_tiles], rope bf16 [..., d_rope])``.  Reads only those tokens."""
    dn = layout.d_nope
    if not layout.block_major:
        row = cache.view(torch.uint8)[blk, off, 0]                            # [..., 656]
        payload = row[..., :dn]
        scales = row[..., dn:dn + layout.scale_bytes].contiguous().view(torch.float32)
        rope = row[..., dn + layout.scale_bytes:].contiguous().view(torch.bfloat16)
    else:
        nope_rope, sc = regions(cache, layout)
        body = nope_rope[blk, off]
        payload = body[..., :dn]
        rope = body[..., dn:].contiguous().view(torch.bfloat16)
        scales = sc[blk, off][..., :layout.num_tiles].contiguous().view(torch.float8_e8m0fnu).float()
    return payload.contiguous().view(FP8), scales, rope


def dequantize_tokens(cache: torch.Tensor, layout: FlashMLALayout, blk: torch.Tensor, off: torch.Tensor,
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Tokens ``[..., d]`` in ``dtype``: ``fp8 · scale`` per tile (exact), then the RoPE part."""
    payload, scales, rope = read_tokens(cache, layout, blk, off)
    nope = payload.float().unflatten(-1, (layout.num_tiles, layout.tile)) * scales[..., None]
    return torch.cat([nope.flatten(-2).to(dtype), rope.to(dtype)], -1)


def _all_tokens(cache: torch.Tensor):
    nb, bs = cache.shape[:2]
    blk = torch.arange(nb, device=cache.device)[:, None].expand(nb, bs)
    off = torch.arange(bs, device=cache.device)[None, :].expand(nb, bs)
    return blk, off


def dequantize_cache(cache: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A whole FP8 cache -> ``(num_blocks, block_size, 1, d)`` in ``dtype``."""
    layout = layout_of(cache)
    return dequantize_tokens(cache, layout, *_all_tokens(cache), dtype)[:, :, None]


def to_packed_rows(cache: torch.Tensor) -> torch.Tensor:
    """A FlashMLA FP8 cache -> dsattn packed rows ``(num_blocks, block_size, 1, W)`` (fp8 payload,
    tile = the layout's tile, bf16 rope, fp32 scales: 656 bytes for V3.2, 604 for V4): the same
    payload bytes, scales and rope, so the dequantised keys are identical."""
    layout = layout_of(cache)
    payload, scales, rope = read_tokens(cache, layout, *_all_tokens(cache))
    return pack_kv_rows(payload, scales, rope)[:, :, None]


def from_packed_rows(rows: torch.Tensor, layout: FlashMLALayout) -> torch.Tensor:
    """dsattn packed rows (fp8 payload, ``layout``'s tile and rope, power-of-two scales) -> the
    FlashMLA cache; scales that are not powers of two (dsattn's own quantiser: amax / 448) have no
    FlashMLA representation and are a ``ValueError``."""
    if rows.dtype != FP8:
        fail("rows", f"dtype {rows.dtype} is not supported; FlashMLA caches hold float8_e4m3fn payloads", TypeError)
    if rows.dim() != 4 or rows.size(2) != 1:
        fail("rows", f"expected (num_blocks, block_size, 1, W), got {tuple(rows.shape)}")
    payload, rope, scales = unpack_kv_rows(rows[:, :, 0], layout.d_rope, torch.bfloat16, layout.tile)
    if payload.size(-1) != layout.d_nope:
        fail("rows", f"hold {payload.size(-1)} quantised columns; the {layout.name} layout has {layout.d_nope}")
    mant, _ = torch.frexp(scales)
    if not bool((mant == 0.5).all()) or (layout.block_major and not bool(
            ((scales >= 2.0 ** -127) & (scales <= 2.0 ** 127)).all())):
        fail("rows", "scales must be powers of two (in ue8m0's range for V4) to be stored in a FlashMLA cache")
    return assemble(payload.view(FP8), scales, rope, layout)
