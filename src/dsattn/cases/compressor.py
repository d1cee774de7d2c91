"""Cases for ``compressor`` / ``compressor_inference``: ragged batches that start mid-group
(history read back from the state cache), tails that do not fill a group, both cache modes
with unbacked locations, and NaN in every state row and x row the call must not read."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import NAN, _pack_rows, _randn


@dataclass
class CompressorCase:
    name: str
    args: tuple                  # (x, wkv, wgate, state_cache, ape, cmp_ratio)
    kwargs: dict
    inference: dict = field(default_factory=dict)   # norm_weight, rope_sin, rope_cos, rope_head_dim, ...

    def clone_args(self):
        """Fresh copies of the positional args (the state cache is written in place)."""
        return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in self.args)

    def inference_args(self):
        x, wkv, wgate, state, ape, r = self.clone_args()
        inf = self.inference
        kw = dict(self.kwargs, norm_eps=inf["norm_eps"], rotary_mode=inf["rotary_mode"])
        return (x, wkv, wgate, state, ape, inf["norm_weight"], inf["rope_sin"], inf["rope_cos"],
                inf["rope_head_dim"], r), kw


def _history_start(sp: int, r: int, coff: int) -> int:
    """First position a call starting at ``sp`` reads from the state cache."""
    return max(0, (sp // r - (coff - 1)) * r)


def compressor_case(*, D: int = 32, coff: int = 2, r: int = 4, H: int = 24, dtype=torch.bfloat16,
                    packed: bool = False, starts=(0, 5, 3), lengths=(13, 7, 0), cache_mode: int = 1,
                    block_size: int = 8, seed: int = 0, rope_head_dim: int = 8, rotary_mode: int = 2,
                    skip_writes: bool = True) -> CompressorCase:
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    rows = [_randn(g, su, H, dtype=dtype) for su in lengths]
    kw: dict = dict(coff=coff, cache_mode=cache_mode, start_pos=torch.tensor(starts, dtype=torch.int32))
    if packed:
        x, kw["cu_seqlens"] = _pack_rows(rows, "TND", None, tail=2)
    else:
        x, _ = _pack_rows(rows, "BSND", max(lengths) + 1)
        kw["seqused"] = torch.tensor(lengths, dtype=torch.int32)
    wkv = _randn(g, coff * D, H, dtype=dtype, scale=H ** -0.5)
    wgate = _randn(g, coff * D, H, dtype=dtype, scale=H ** -0.5)
    ape = _randn(g, r, coff * D, scale=0.5)
    W = 2 * coff * D
    if cache_mode == 1:
        nblk = [max(1, -(-(sp + su) // block_size)) for sp, su in zip(starts, lengths)]
        total = 1 + sum(nblk) + 2                                  # block 0 is reserved
        state = torch.full((total, block_size, W), NAN)
        table = torch.zeros((B, max(nblk) + 1), dtype=torch.int32)
        perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
        for b, (sp, su) in enumerate(zip(starts, lengths)):
            lo = _history_start(sp, r, coff)
            for j in range(nblk[b]):
                blk = perm.pop()
                first, last = j * block_size, (j + 1) * block_size
                if last <= lo:
                    continue                                       # never read: not backed
                if skip_writes and first >= sp and last <= sp + su and j % 2:
                    continue                                       # a block this call need not write
                table[b, j] = blk
                for p in range(max(first, lo), min(last, sp)):
                    state[blk, p % block_size] = _randn(g, W)
    else:
        width = coff * r + max(lengths) + 1
        nrows = sum(coff * r + su for su in lengths) + 3
        state = torch.full((nrows, 1, W), NAN)
        table = torch.full((B, width), -1, dtype=torch.int32)
        perm = torch.randperm(nrows, generator=g).tolist()
        for b, (sp, su) in enumerate(zip(starts, lengths)):
            lo = _history_start(sp, r, coff)
            for c in range(coff * r + su):
                p = sp - coff * r + c
                if p < lo or (skip_writes and p >= sp and c % 3 == 2):
                    continue
                row = perm.pop()
                table[b, c] = row
                if p < sp:
                    state[row, 0] = _randn(g, W)
        block_size = 1
    kw["state_block_table"] = table
    name = (f"C{D}-coff{coff}-r{r}-{'2D' if packed else '3D'}-mode{cache_mode}-{str(dtype).split('.')[-1]}")
    case = CompressorCase(name, (x, wkv, wgate, state, ape, r), kw)
    n_out = (min(x.size(0), x.size(0) // r + B),) if packed else (B, -(-x.size(1) // r))
    theta = torch.rand(*n_out, rope_head_dim, generator=g) * 6.3        # unpaired per-dimension tables
    case.inference = dict(norm_weight=_randn(g, D, scale=0.3) + 1.0, rope_sin=torch.sin(theta),
                          rope_cos=torch.cos(theta * 1.1), rope_head_dim=rope_head_dim, norm_eps=1e-6,
                          rotary_mode=rotary_mode)
    return case
