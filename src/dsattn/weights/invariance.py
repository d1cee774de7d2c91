"""The quantised linears' batch-invariant mode: every call sums each row of x in the streamed path's one order, so a
row's result does not depend on how many rows share the call or what they hold (by default calls of more than 8 rows
take the tiled GEMM path, faster for prefill, whose summation order follows M).

On where ``DSATTN_BATCH_INVARIANT=1`` (read at each call), inside :func:`batch_invariant`, under ``dsattn verify
--batch-invariance``, and in the vLLM plug-in where vLLM's own batch-invariant setting (``VLLM_BATCH_INVARIANT=1``) is.
The promise is the compiled CPU path's (dsattn's own code on every ISA cap); the PyTorch path multiplies in torch's
matmul, whose blocking follows the batch."""
from __future__ import annotations

import contextlib
import os

ENV = "DSATTN_BATCH_INVARIANT"
_ON, _OFF = ("1", "true", "on", "yes"), ("", "0", "false", "off", "no")
_forced: list[bool] = []


def requested() -> bool:
    """Whether the batch-invariant mode is on: the innermost :func:`batch_invariant`, else ``DSATTN_BATCH_INVARIANT``."""
    if _forced:
        return _forced[-1]
    value = os.environ.get(ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ValueError(f"{ENV}={value!r}: expected 1 or 0 (true / false, on / off, yes / no)")


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """Within the block the quantised linears run in the batch-invariant mode (``enabled``) or not, whatever
    ``DSATTN_BATCH_INVARIANT`` says."""
    _forced.append(bool(enabled))
    try:
        yield
    finally:
        _forced.pop()
