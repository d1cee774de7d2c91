"""Argument validation shared by every operator.

Every error message starts with the offending argument's name (00-overview §10), e.g.
``"cmp_residual_kv: value 5 at batch 1 is not in [0, cmp_ratio=4)"``.

Two kinds of checks exist:

* *shape checks* look only at dtypes, ranks and sizes; they run everywhere, including
  in the fake (meta) kernels used by ``torch.compile``/``torch.export``;
* *content checks* read tensor values (monotone ``cu_seqlens``, lengths within extents,
  residual ranges, dereferenced table entries).  They are on by default, switched off by
  :func:`set_content_checks`, and skipped automatically while a CUDA stream is being
  captured or when tensors are fake, because reading device data forces a sync.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DTYPE_NAMES = "bfloat16, float16 or float32"

_content_checks = True


def set_content_checks(enabled: bool) -> None:
    """Turn the value-reading (content) checks on or off for all operators."""
    global _content_checks
    if not isinstance(enabled, bool):
        fail("enabled", f"expected True or False, got {enabled!r}", TypeError)
    _content_checks = enabled


def content_checks_enabled(*tensors: torch.Tensor | None) -> bool:
    """True when content checks should run for a call on ``tensors``."""
    if not _content_checks:
        return False
    for t in tensors:
        if t is None:
            continue
        if t.device.type == "meta" or is_fake(t):
            return False
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
    return True


def is_fake(t: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, FakeTensor)


def fail(arg: str, msg: str, exc: type[Exception] = ValueError):
    raise exc(f"{arg}: {msg}")


def check_float(arg: str, t: torch.Tensor, allow_f64: bool = False) -> None:
    """Activation dtype: bf16 / fp16 / fp32, plus float64 where the operator allows it (the
    library's gradient-check extension of the attention ops)."""
    ok = FLOAT_DTYPES + ((torch.float64,) if allow_f64 else ())
    if t.dtype not in ok:
        names = _DTYPE_NAMES.replace(" or ", ", ") + " or float64" if allow_f64 else _DTYPE_NAMES
        fail(arg, f"dtype {t.dtype} is not supported; expected {names}", TypeError)


def stat_dtype(q: torch.Tensor) -> torch.dtype:
    """Dtype of statistics, sinks and fp32 outputs: float32, or float64 for float64 queries
    (the gradient-check extension: everything specified as float32 becomes float64)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def check_tensor(arg: str, t) -> None:
    """A required tensor argument."""
    if not isinstance(t, torch.Tensor):
        fail(arg, f"expected a tensor, got {type(t).__name__}", TypeError)


def check_dtype(arg: str, t: torch.Tensor | None, dtype: torch.dtype, why: str = "") -> None:
    if t is not None and t.dtype != dtype:
        extra = f" ({why})" if why else ""
        fail(arg, f"dtype {t.dtype} is not supported; expected {dtype}{extra}", TypeError)


def check_int32(arg: str, t: torch.Tensor | None) -> None:
    check_dtype(arg, t, torch.int32)


def check_rank(arg: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        fail(arg, f"expected a {rank}-D tensor for layout {layout}, got shape {tuple(t.shape)}")


def check_choice(arg: str, value, choices) -> None:
    if value not in choices:
        fail(arg, f"value {value!r} is not one of {list(choices)}")


def check_int_range(arg: str, value: int, lo: int, hi: int) -> None:
    if not (lo <= value <= hi):
        fail(arg, f"value {value} is not in [{lo}, {hi}]")


def check_batch_vector(arg: str, t: torch.Tensor | None, B: int) -> None:
    """A per-batch int32 ``[B]`` tensor (seqused_*, cmp_residual_*)."""
    if t is None:
        return
    check_int32(arg, t)
    if t.dim() != 1 or t.size(0) != B:
        fail(arg, f"expected shape [B]=[{B}], got {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    dev = None
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if dev is None:
            dev, first = t.device, name
        elif t.device != dev:
            fail(name, f"is on {t.device} but {first} is on {dev}; all tensors must be on one device")


def host_ints(t: torch.Tensor) -> list[int]:
    """Values of a small int tensor, for content checks and the reference only."""
    return [int(v) for v in t.detach().cpu().tolist()]


def check_slots(slot_mapping: torch.Tensor, num_slots: int, name: str = "slot_mapping") -> None:
    """Content check of a cache write's flat slots: each is -1 (not written) or in ``[0, num_slots)``.
    One pass over the tensor (a write can carry a whole prefill's tokens), then the first bad entry."""
    if slot_mapping.numel() == 0:
        return
    s = slot_mapping.detach()
    bad = (s < -1) | (s >= num_slots)
    if bool(bad.any()):
        i = int(bad.to(torch.int8).argmax())
        fail(name, f"value {int(s[i])} at row {i} is neither -1 nor a slot in [0, {num_slots})")
