"""Random calls of the quantised linears (``fp8_block_linear``, ``mxfp4_linear``) for the fuzz suite, ``dsattn verify``
and the batch-invariance check: one seed, one call, drawn by :class:`random.Random(seed)` and a seeded generator.

What is drawn: the format (FP8 block-scaled, MXFP4), x's dtype, M from 0 through past the streamed path's 8 rows to a
few hundred, leading dims, N and K not multiples of anything (FP8; MXFP4's K whole groups of 32), FP8 blocks from 1 x 16
to 128 x 128 (K blocks that are not whole 16-code runs: the PyTorch path), fp32 or ue8m0 scales (MXFP4's fp32 ones
powers of two or not), bias or none, and now and then a zero block or a NaN code."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .. import testing

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROWS = (0, 1, 2, 3, 5, 8, 9, 16, 17, 40, 64, 130, 257)


@dataclass
class QuantLinearCase:
    name: str
    format: str                # "fp8" | "fp4"
    x: torch.Tensor            # [..., K]
    codes: torch.Tensor        # uint8: fp8 [N, K], fp4 [N, K / 2]
    scale: torch.Tensor        # fp32, or ue8m0 bits (uint8)
    block: tuple               # fp8: [bn, bk]
    bias: torch.Tensor | None

    def call(self, x: torch.Tensor | None = None) -> torch.Tensor:
        from .. import ops
        x = self.x if x is None else x
        if self.format == "fp4":
            return ops.mxfp4_linear(x, self.codes, self.scale, self.bias)
        return ops.fp8_block_linear(x, self.codes, self.scale, list(self.block), self.bias)

    def golden(self) -> torch.Tensor:
        from ..weights import ref
        if self.format == "fp4":
            return ref.mxfp4_linear(self.x, self.codes, self.scale, self.bias)
        return ref.fp8_block_linear(self.x, self.codes, self.scale, self.block, self.bias)

    def magnitude(self) -> torch.Tensor:
        """|x| |W|^T (+ |bias|) in float64: the scale of each output's rounding (its terms' magnitudes summed)."""
        from ..weights import problem, ref
        P = (problem.parse_mxfp4_linear(self.x, self.codes, self.scale, None) if self.format == "fp4" else
             problem.parse_fp8_linear(self.x, self.codes, self.scale, list(self.block), None))
        w = ref.weight_of(P).abs()
        m = (self.x.double().abs().reshape(-1, self.x.shape[-1]) @ w.T).reshape(P.out_shape)
        return m if self.bias is None else m + self.bias.double().abs()


def quant_linear_config(seed: int, rows: int | None = None, compiled: bool = False) -> QuantLinearCase:
    """One random call (``rows``: M, else drawn; ``compiled``: FP8 K blocks of whole 16-code runs only, calls the
    compiled kernel takes)."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    fmt = rnd.choice(("fp8", "fp4"))
    dtype = rnd.choice(DTYPES)
    M = rows if rows is not None else rnd.choice(ROWS)
    N = rnd.randint(1, 300)
    if fmt == "fp8":
        blocks = ((128, 128), (128, 128), (64, 64), (32, 48), (1, 16), (16, 40), (7, 128))
        block = rnd.choice([b for b in blocks if not (compiled and b[1] % 16)])
        K = rnd.randint(1, 640)
        codes = torch.randint(0, 256, (N, K), dtype=torch.uint8, generator=g)
        codes = torch.where(codes & 0x7F == 0x7F, codes ^ 0x01, codes)          # NaN codes only where placed below
        shape = (-(-N // block[0]), -(-K // block[1]))
        if rnd.random() < 0.5:
            # ue8m0: 2^-12 .. 2^4 (fp16 outputs 2^-17 .. 2^-3: their sums stay within fp16's range)
            lo, hi = (110, 125) if dtype == torch.float16 else (115, 132)
            scale = torch.randint(lo, hi, shape, dtype=torch.uint8, generator=g)
        else:
            scale = torch.rand(shape, generator=g) * 0.02 + 1e-3
        if rnd.random() < 0.2:
            codes[:block[0], :block[1]] = 0                                        # a zero block
    else:
        block = (1, 32)
        K = 32 * rnd.randint(1, 24)
        codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
        shape = (N, K // 32)
        kind = rnd.choice(("ue8m0", "pow2", "fp32"))
        top = 0 if dtype == torch.float16 else 6          # (fp16 outputs: sums within its range)
        if kind == "ue8m0":
            scale = torch.randint(118, 128 + top, shape, dtype=torch.uint8, generator=g)
        elif kind == "pow2":
            scale = torch.exp2(torch.randint(-9, 1 + top, shape, generator=g).float())
        else:
            scale = torch.rand(shape, generator=g) * 0.5 + 0.01
    if rnd.random() < 0.15 and N > 1:
        codes[rnd.randrange(N), rnd.randrange(codes.shape[1])] = 0x7F if fmt == "fp8" else codes[0, 0]   # a NaN code
    lead = (M,) if rnd.random() < 0.7 or M % 2 else (2, M // 2)
    x = (torch.randn(*lead, K, generator=g) * rnd.choice((0.1, 1.0) if dtype == torch.float16 else (0.1, 1.0, 8.0)))
    x = x.to(dtype)
    bias = torch.randn(N, generator=g) if rnd.random() < 0.4 else None
    name = (f"{'fp8_block_linear' if fmt == 'fp8' else 'mxfp4_linear'} M={M} N={N} K={K}"
            + (f" block={list(block)}" if fmt == "fp8" else "") + f" {str(dtype).split('.')[-1]} scale="
            + ("ue8m0" if scale.dtype == torch.uint8 else "fp32") + (" bias" if bias is not None else ""))
    return QuantLinearCase(name, fmt, x, codes, scale, block, bias)


# fp32 sums: a few ulps of the products' magnitudes; 16-bit outputs add their own rounding, relative (normal values)
# or absolute (the dtype's subnormal spacing: fp16's starts at 2^-14)
_OUT_EPS = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
_OUT_TINY = {torch.float32: 2.0 ** -149, torch.bfloat16: 2.0 ** -133, torch.float16: 2.0 ** -24}


def quant_linear_close(actual: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> testing.Comparison:
    """The quantised linears' rule: every element within 2e-6 of its products' summed magnitude (fp32 summation in
    any order) plus the output dtype's rounding of the value (relative, or its subnormal spacing), NaN exactly where
    the float64 golden has one."""
    if actual.shape != want.shape:
        return testing.Comparison("quant-linear", False, float("inf"), 0.0, f"shape {list(actual.shape)} vs "
                                                                            f"{list(want.shape)}")
    nan_want, nan_got = torch.isnan(want), torch.isnan(actual)
    if not torch.equal(nan_want, nan_got):
        return testing.Comparison("quant-linear", False, float("nan"), 0.0, "NaN where the golden has none, or not "
                                                                             "where it has one")
    if actual.numel() == 0:
        return testing.Comparison("quant-linear", True, 0.0, 1.0)
    tol = 2e-6 * magnitude + _OUT_EPS[actual.dtype] * want.abs() + _OUT_TINY[actual.dtype]
    err = (actual.double() - want).abs().masked_fill(nan_want, 0.0)
    bad = err > tol.masked_fill(nan_want, 0.0)
    return testing.Comparison("quant-linear", not bool(bad.any()), float(err.max()),
                              1.0 - float(bad.double().mean()),
                              f"{int(bad.sum())} of {actual.numel()} elements past 2e-6 x |x||W| + the dtype's rounding")


def check_rows(case: QuantLinearCase):
    """The verify rows of one call against its golden."""
    from ..verify import Row
    return [Row(case.name, "y", quant_linear_close(case.call(), case.golden(), case.magnitude()))]


def check_invariance(seed: int) -> list[str]:
    """In the batch-invariant mode, on the compiled kernel (the promise is its own), the call's rows against slices of them called alone (each of a few single rows,
    and runs of rows that cross the streamed path's 8), and 1 thread against all: bit for bit."""
    from ..weights import batch_invariant
    from .invariance import _bits_equal, on_threads
    rnd = random.Random(seed)
    case = quant_linear_config(seed, rows=rnd.choice((2, 7, 9, 16, 33, 100, 257)), compiled=True)
    x = case.x.reshape(-1, case.x.shape[-1])
    M, bad = x.shape[0], []
    with batch_invariant():
        full = case.call(x)
        if torch.get_num_threads() > 1 and not _bits_equal(full, on_threads(1, lambda: case.call(x))):
            bad.append(f"{case.name}: y differs between 1 and {torch.get_num_threads()} threads")
        picks = [(i, i + 1) for i in rnd.sample(range(M), min(3, M))]
        for _ in range(3):
            i = rnd.randrange(M)
            picks.append((i, rnd.randint(i + 1, M)))
        for i, j in picks:
            if not _bits_equal(case.call(x[i:j]), full[i:j]):
                bad.append(f"{case.name}: rows {i}..{j - 1} called alone differ from their rows in the call")
    return bad
