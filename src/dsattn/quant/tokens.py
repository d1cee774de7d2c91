"""Packed key tokens as the attention kernels read them: where each token's quantised payload, 16-bit
rope part and tile scales lie in a byte buffer, for dsattn's packed rows and FlashMLA's FP8 cache
layouts alike.  The compiled CPU kernel decodes the listed tokens as it gathers them
(dsattn/native/attention.cpp, ``PackedFormat``: the same fields); :meth:`PackedTokens.dequantize`
is the same decode in PyTorch for the other paths.  Either way a token is ``payload x scale`` per
tile in fp32, rounded once to the query dtype, then its rope part (the golden's dequant_kv_rows)."""
from __future__ import annotations

import dataclasses

import torch

from ..common.checks import fail
from .flashmla import layout_of
from .rows import nope_width, rope_bytes_dtype

FP8 = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class PackedTokens:
    """``data``: the bytes (uint8, 1-D, contiguous); token ``t`` has its body at ``(t // bs) ·
    block_stride + (t % bs) · body_stride`` (payload at + ``payload_off``, rope at + ``rope_off``) and
    its scales at ``(t // bs) · block_stride + scale_region + (t % bs) · scale_stride``."""

    data: torch.Tensor
    tokens: int
    N: int
    R: int
    tile: int
    fp8: bool
    ue8m0: bool
    rope_fp16: bool
    bs: int
    block_stride: int
    body_stride: int
    payload_off: int
    rope_off: int
    scale_region: int
    scale_stride: int

    @property
    def D(self) -> int:
        return self.N + self.R

    @property
    def device(self) -> torch.device:
        return self.data.device

    def fields(self) -> list[int]:
        """The compiled kernel's description (``PackedFormat::from``)."""
        return [self.tokens, self.N, self.R, self.tile, int(self.fp8), int(self.ue8m0), int(self.rope_fp16), self.bs,
                self.block_stride, self.body_stride, self.payload_off, self.rope_off, self.scale_region,
                self.scale_stride]

    @staticmethod
    def from_rows(rows: torch.Tensor, rope_head_dim: int, tile: int, q_dtype: torch.dtype) -> "PackedTokens | None":
        """dsattn's packed rows ``[..., W]`` (int8 / fp8 payload, rope 16-bit, fp32 scales), token =
        row in row-major order; None where the rows do not lie one after another."""
        fields = PackedTokens.row_fields(rows, rope_head_dim, tile, q_dtype)
        return None if fields is None else PackedTokens(rows.view(torch.uint8).reshape(-1), *fields)

    @staticmethod
    def row_fields(rows: torch.Tensor, rope_head_dim: int, tile: int, q_dtype: torch.dtype) -> tuple | None:
        """:meth:`from_rows`' fields after ``data`` (its :meth:`fields`), without making the byte view: the
        compiled steps, which take the rows themselves, need only these (a one-request decode step's
        Python is a good part of its time)."""
        W = rows.size(-1)
        if not rows.is_contiguous():
            return None
        N = nope_width(W, rope_head_dim, tile)
        return (rows.numel() // max(W, 1), N, rope_head_dim, tile, rows.dtype == FP8, False,
                rope_bytes_dtype(q_dtype) == torch.float16, 1, W, 0, 0, N, N + 2 * rope_head_dim, 0)

    @staticmethod
    def from_flashmla(cache: torch.Tensor, name: str = "k_cache") -> "PackedTokens":
        """A FlashMLA FP8 cache ``(num_blocks, block_size, 1, 656 | 584)``, token = block · block_size + offset."""
        layout = layout_of(cache, name)
        u8 = cache.view(torch.uint8)
        nb, bs = cache.shape[:2]
        if u8.stride(-1) != 1 or u8.stride(1) != layout.row_bytes or (nb > 1 and u8.stride(0) < bs * layout.row_bytes):
            fail(name, f"expected the (num_blocks, block_size, 1, {layout.row_bytes}) view of whole blocks, got "
                 f"strides {tuple(u8.stride())}")
        block_stride = u8.stride(0) if nb > 1 else bs * layout.row_bytes
        span = (nb - 1) * block_stride + bs * layout.row_bytes if nb else 0
        data = u8.as_strided((span,), (1,))
        dn, dr = layout.d_nope, layout.d_rope
        if layout.block_major:                   # V4: bodies [nope | rope] then the block's ue8m0 scales
            body = dn + 2 * dr
            return PackedTokens(data, nb * bs, dn, dr, layout.tile, True, True, False, bs, block_stride, body, 0, dn,
                                bs * body, layout.scale_bytes)
        return PackedTokens(data, nb * bs, dn, dr, layout.tile, True, False, False, bs, block_stride,   # V3.2
                            layout.row_bytes, 0, dn + layout.scale_bytes, dn, layout.row_bytes)

    def dequantize(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Tokens ``[*index.shape, D]`` in ``dtype`` (index ``-1``: a zero row)."""
        valid = index >= 0
        t = torch.where(valid, index, torch.zeros_like(index)).to(torch.int64)
        blk = torch.div(t, self.bs, rounding_mode="floor") * self.block_stride
        inner = t % self.bs
        body = blk + inner * self.body_stride
        scales_at = blk + self.scale_region + inner * self.scale_stride
        dev = self.data.device

        def take(start: torch.Tensor, n: int) -> torch.Tensor:
            return self.data[start[..., None] + torch.arange(n, device=dev)]

        payload = take(body + self.payload_off, self.N)
        values = payload.view(FP8).float() if self.fp8 else payload.view(torch.int8).float()
        T = self.N // self.tile
        if self.ue8m0:
            scales = take(scales_at, T).contiguous().view(torch.float8_e8m0fnu).float()
        else:
            scales = take(scales_at, 4 * T).contiguous().view(torch.float32)
        nope = (values.unflatten(-1, (T, self.tile)) * scales[..., None]).flatten(-2).to(dtype)
        rope = take(body + self.rope_off, 2 * self.R).contiguous().view(
            torch.float16 if self.rope_fp16 else torch.bfloat16).to(dtype)
        rows = torch.cat([nope, rope], -1)
        return torch.where(valid[..., None], rows, torch.zeros((), dtype=dtype, device=dev))
