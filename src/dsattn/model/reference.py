"""A dense float64 reference of :class:`DeepseekV4Attention` for one request's whole history:
full attention with the spec's visibility rules as masks (window band, causal compressed
entries, for CSA the given top-k lists walked as 20 §1.2 says), the compressor through its
golden in float64, no caches."""
from __future__ import annotations

import torch

from .. import reference as golden
from ..common.masks import sparse_walk
from .config import rope_tables


def _rms(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(layer, t, positions, inverse=False):
    cos, sin = rope_tables(layer.freqs, int(positions.max()) + 1 if positions.numel() else 1)
    cos, sin = cos.double()[positions], sin.double()[positions]
    if t.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    R = layer.cfg.rope_dim
    u = t[..., -R:]
    even, odd = u[..., 0::2], u[..., 1::2]
    partner = torch.stack((-odd, even), -1).flatten(-2)
    rot = u * cos + partner * (-sin if inverse else sin)
    return torch.cat([t[..., :-R], rot], -1)


def reference_layer(layer, X: torch.Tensor, topk: torch.Tensor | None = None, rows=None) -> torch.Tensor:
    """Outputs ``[len(rows), hidden]`` (float64) of the query rows ``rows`` (default: all) of one
    request whose token history is ``X [L, hidden]``; ``topk [len(rows), K]`` for a CSA layer."""
    c, w, r = layer.cfg, layer.master, layer.ratio
    X = X.double()
    L = X.size(0)
    rows = torch.arange(L) if rows is None else rows
    pos = torch.arange(L)
    qr = _rms(X @ w["wq_a"].T, w["q_norm"], c.eps)
    q = (qr @ w["wq_b"].T).view(L, c.heads, c.head_dim)
    q = _rope(layer, q * torch.rsqrt((q * q).mean(-1, keepdim=True) + c.eps), pos)
    kv = _rope(layer, _rms(X @ w["wkv"].T, w["kv_norm"], c.eps), pos)
    cmp = None
    if r:
        n_out = min(L, L // r + 1)
        cos, sin = rope_tables(layer.freqs, max(n_out * r, 1))
        cos, sin = cos.double()[torch.arange(n_out) * r], sin.double()[torch.arange(n_out) * r]
        state = torch.zeros(1, 1, 2 * layer.coff * c.head_dim, dtype=torch.float64)
        cmp = golden.compressor_inference(X, w["cmp_wkv"], w["cmp_wgate"], state, w["cmp_ape"], w["cmp_norm"], sin,
                                          cos, c.rope_dim, r, cu_seqlens=torch.tensor([0, L], dtype=torch.int32),
                                          coff=layer.coff, norm_eps=c.eps, rotary_mode=2)[:L // r]
    out = []
    for n, i in enumerate(rows.tolist()):
        keys = [kv[max(0, i - c.window + 1):i + 1]]
        if r:
            thr = (i + 1) // r
            if r == 4:
                sel = [j for _, j in sparse_walk(topk[n].tolist(), thr, thr)]
                keys.append(cmp[sel] if sel else cmp[:0])
            else:
                keys.append(cmp[:thr])
        K = torch.cat(keys)
        s = c.softmax_scale * (q[i] @ K.T)
        m = torch.maximum(s.max(-1).values, w["sinks"])
        e = torch.exp(s - m[:, None])
        o = (e @ K) / (e.sum(-1) + torch.exp(w["sinks"] - m))[:, None]
        out.append(o)
    o = _rope(layer, torch.stack(out), rows, inverse=True)
    G = c.o_groups
    o = torch.einsum("tgk,gok->tgo", o.reshape(len(rows), G, -1), w["wo_a"]).reshape(len(rows), -1)
    return o @ w["wo_b"].T
