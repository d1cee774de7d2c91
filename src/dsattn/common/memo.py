"""Per-tensor memos: a decode loop passes the same cache tensors every step, so what is derived from a
cache's layout alone (a descriptor of where its tokens lie, checked once) is kept with the tensor.

An entry is keyed by the tensor object itself -- a weak reference, so that when the tensor is freed its
entry goes and a new tensor at the same address never finds an old one -- and by its shape, strides,
storage offset and dtype, plus whatever else the derivation read (``extra``)."""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch


class TensorMemo:
    def __init__(self):
        self._entries: dict[int, tuple] = {}

    def get(self, t: torch.Tensor, extra: tuple, make: Callable[[], object]):
        """``make()``, or what it returned for this very tensor in this layout with the same ``extra``."""
        key = (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, extra)
        hit = self._entries.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == key:
            return hit[2]
        value = make()
        entries = self._entries
        entries[id(t)] = (weakref.ref(t, lambda _, i=id(t): entries.pop(i, None)), key, value)
        return value

    def __contains__(self, t_id: int) -> bool:
        """Whether an entry is held for the tensor of this ``id``."""
        return t_id in self._entries
