"""Linear layers over the quantised weights the released checkpoints ship, read in place.

``mxfp4_linear``: MXFP4 weights (e2m1 codes two a byte, one ue8m0 scale per 32: DeepSeek-V4's routed experts).

``fp8_block_linear``: FP8 e4m3fn weights with one scale per block (DeepSeek-V3.2 / GLM-5's ``weight_scale_inv``,
fp32; DeepSeek-V4's ue8m0), activations in the model dtype (W8A16).  The golden (:mod:`.ref`) dequantises in
float64; the compiled CPU path (``native/weights.cpp``) decodes the codes in registers and never keeps a
dequantised copy; the PyTorch path dequantises a few rows at a time (any device).  :mod:`.dispatch` picks.

Batch invariance: rows of up to 8 (decode) are streamed, each row of x summed on its own; larger calls take the
tiled GEMM path, whose order follows M.  :func:`batch_invariant` (or ``DSATTN_BATCH_INVARIANT=1``) streams every
call: a row's bits then do not depend on M or on the rows beside it (:mod:`.invariance`).
"""
from __future__ import annotations

from . import op  # noqa: F401  (registers the op)
from .invariance import batch_invariant  # noqa: F401
from .problem import e8m0_to_float, quantize_fp8_blocks, quantize_mxfp4  # noqa: F401
