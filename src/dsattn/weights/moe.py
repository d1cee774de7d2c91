"""Routed experts over per-expert linears (dsattn's quantised linears, or any others): the MoE loop the vLLM plug-in's
FP8 / MXFP4 experts run.  Its golden is :func:`dsattn.weights.ref.routed_experts`."""
from __future__ import annotations

from collections.abc import Callable

import torch


def run_experts(output: torch.Tensor, x: torch.Tensor, linear: Callable, n_experts: int, half: int,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
                weights_applied: bool = False, limit: float | None = None) -> None:
    """``output`` [T, H] = sum over each token's top-k experts e of weight x down_e(silu(gate_e(x)) * up_e(x)), where
    ``linear(e, 0, x)`` is expert e's gate / up product (gate rows then up rows, ``half`` each) and ``linear(e, 1, a)``
    its down product.  The tokens of an expert go through its linears together (its weights read once a call);
    ``expert_map`` maps global expert ids to this rank's (-1: another rank's, which adds nothing here);
    ``weights_applied``: the top-k weights are already in ``x`` (vLLM's top-1 ``apply_router_weight_on_input``);
    ``limit``: DeepSeek-V4's SwiGLU clamp (gate <= limit, |up| <= limit).  Sums in fp32, the tokens' experts added in
    the order of their expert ids.  CPU tensors (the counts are read on the host)."""
    T, k = topk_ids.shape
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        ids = expert_map[ids].long()
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids[ids >= 0], minlength=n_experts).tolist()
    start = int((ids < 0).sum())                 # another rank's experts sort first
    weights = topk_weights.reshape(-1).float()
    acc = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    for e, n in enumerate(counts):
        if n == 0:                               # (an expert no token chose: its weights are not read)
            continue
        pick = order[start:start + n]
        start += n
        tokens = pick // k
        h = linear(e, 0, x[tokens])
        gate, up = h[:, :half], h[:, half:]
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        y = linear(e, 1, torch.nn.functional.silu(gate) * up).float()
        acc.index_add_(0, tokens, y if weights_applied else y * weights[pick, None])
    output.copy_(acc)
