"""Quantisation error of the packed MLA cache (40-kv-quant), as reported in issue 3's note.

Writes T random bf16 latents through ``kv_rmsnorm_rope_quant_cache`` (int8 and fp8 payloads)
and compares the dequantised K (nope part) with the RMS-normed bf16 latent it encodes.

    .venv/bin/python bench/quant_error.py [--tokens 4096]
"""
import argparse

import torch

import dsattn
from dsattn import quant


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    T = ap.parse_args().tokens
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(T, 576, generator=g).bfloat16()
    theta = torch.rand(T, 64, generator=g)
    x = kv[:, :512].float()
    nope = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16().float()
    print(f"{'payload':<14} {'max rel':>8} {'mean rel':>9} {'max rel (|x|>=10% row max)':>27} "
          f"{'mean rel (same)':>16} {'row-norm rel':>13} {'max abs':>8}")
    for dt in (torch.int8, torch.float8_e4m3fn):
        cache = torch.zeros(T, 1, 1, quant.row_width(512, 64), dtype=dt)
        packed = dsattn.ops.kv_rmsnorm_rope_quant_cache(kv, torch.ones(512), torch.cos(theta), torch.sin(theta),
                                                        cache, torch.arange(T))
        _, v = quant.dequant_kv_rows(packed, 64, torch.float32, rope_dtype=torch.bfloat16)
        err = (v - nope).abs()
        rel = err / nope.abs().clamp(min=1e-12)
        big = nope.abs() >= 0.1 * nope.abs().amax(-1, keepdim=True)
        row = ((v - nope).norm(dim=-1) / nope.norm(dim=-1)).mean()
        print(f"{str(dt).split('.')[-1]:<14} {rel.max():8.3g} {rel.mean():9.3g} {rel[big].max():27.3g} "
              f"{rel[big].mean():16.3g} {row:13.3g} {err.max():8.3g}")
    print(f"bytes per token: bf16 row (576 x 2) = 1152, packed int8/fp8 row = {quant.row_width(512, 64)} "
          f"-> {1152 / quant.row_width(512, 64):.2f}x more tokens per cache byte")


if __name__ == "__main__":
    main()
