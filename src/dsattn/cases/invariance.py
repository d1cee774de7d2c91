"""Batch invariance: a request's results are the same bits alone as inside any batch, on any thread count.

A configuration is one of the fuzz suite's (:mod:`dsattn.cases.fuzz`): a random batch of requests in a
random layout (BSND with ``seqused_q`` padding, TND, paged caches).  For every request ``b`` the same
call is made with request ``b`` alone (its rows, its lengths, its block-table row; a paged pool is
shared as it is, as in serving) and its rows must equal the batch call's rows of ``b`` bit for bit;
the batch call on one thread must equal the batch call on all of them.  BSND requests are also run
trimmed to their own length without ``seqused_q`` (00 §11: valid rows are the same with and
without it).

What is compared: every output with a row per query row (attention outputs, LSE / softmax
statistics, indexer indices and values, the gradients dq / dw, the L1 norms of P); gradients of the
keys (dKV, dk) over the keys only this request reads (its own BSND / TND segment, its own blocks);
not what sums over requests (dsinks).  Plans (``metadata``) are left out: a split-KV plan changes a
row's summation order by design, and the same plan row gives the same bits (the plan executor
is deterministic), which tests/test_planner.py checks.  Compressor calls are compared on their
output rows and on the state-cache rows of the request's own blocks.
"""
from __future__ import annotations

import random
from collections.abc import Callable

import torch

from . import fuzz

# argument names by role (every family's spelling)
_PER_BATCH = ("seqused_q", "seqused_k", "seqused_kv", "seqused_ori_kv", "seqused_cmp_kv", "cmp_residual_k",
              "cmp_residual_kv", "actual_seq_lengths_kv", "start_pos", "seqused")
_KV_CU = {"ori_kv": "cu_seqlens_ori_kv", "cmp_kv": "cu_seqlens_cmp_kv", "k": "cu_seqlens_k",
          "key": "actual_seq_lengths_kv"}
_ROW_NAMES = ("dout", "w", "sparse_indices", "p", "ori_sparse_indices", "cmp_sparse_indices", "ori_topk_length",
              "cmp_topk_length")


def _q_layout(kw) -> str:
    return kw.get("layout_q", kw.get("layout_query", kw.get("layout", "BSND")))


def _kv_layout(kw) -> str:
    return kw.get("layout_kv", kw.get("layout_k", "BSND"))


def _starts_ends(kw, B: int, cu_name: str, ends_only: bool = False):
    """Per-request [start, end) of TND rows from a cumulative tensor (``cu_seqlens`` [B + 1] or, for
    QSFA, cumulative ends [B])."""
    cu = kw[cu_name].to(torch.int64).tolist()
    if ends_only:
        cu = [0] + cu
    return [(cu[b], cu[b + 1]) for b in range(B)]


class Request:
    """How to take request ``b`` out of a batched call of one family."""

    def __init__(self, family: str, q: torch.Tensor, kw: dict, extra: dict):
        self.family, self.q, self.kw, self.extra = family, q, kw, extra
        self.lq = _q_layout(kw)
        self.lkv = _kv_layout(kw)
        self.qsfa = family == "qsfa"
        if self.lq == "BSND":
            self.B = q.size(0)
            self.q_rows = None
        else:
            name = "actual_seq_lengths_query" if self.qsfa else "cu_seqlens_q"
            self.B = kw[name].numel() - (0 if self.qsfa else 1)
            self.q_rows = _starts_ends(kw, self.B, name, ends_only=self.qsfa)

    # -- the rows of request b in an output laid out like q (BSND [B, S1, ...] / TND [T, ...])
    def valid_rows(self, b: int) -> int:
        used = self.kw.get("actual_seq_lengths_query" if self.qsfa and self.lq == "BSND" else "seqused_q")
        if self.lq == "BSND":
            n = self.q.size(1)
        else:
            s, e = self.q_rows[b]
            n = e - s
        return min(n, int(used[b])) if used is not None else n

    def rows(self, t: torch.Tensor, b: int) -> torch.Tensor:
        n = self.valid_rows(b)
        if self.lq == "BSND":
            return t[b, :n]
        s, _ = self.q_rows[b]
        return t[s:s + n]

    def _slice_q_like(self, t: torch.Tensor, b: int) -> torch.Tensor:
        if self.lq == "BSND":
            return t[b:b + 1]
        s, e = self.q_rows[b]
        return t[s:e]

    def _q_like(self, name: str, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        lead = tuple(self.q.shape[:2]) if self.lq == "BSND" else tuple(self.q.shape[:1])
        return name in _ROW_NAMES and tuple(t.shape[:len(lead)]) == lead

    def _slice_kv(self, name: str, t: torch.Tensor, b: int) -> torch.Tensor:
        if self.lkv == "BSND":
            return t[b:b + 1]
        if self.lkv == "TND":
            s, e = _starts_ends(self.kw, self.B, _KV_CU[name], ends_only=self.qsfa)[b]
            return t[s:e]
        return t                                    # paged: the pool as it is

    def alone(self, b: int, unpadded: bool = False):
        """``(q, kwargs, extra)`` of the call with request ``b`` alone (``unpadded``: without ``seqused_q``, so
        that its padding rows are computed too: the valid rows must not change, 00 §11)."""
        def one(name, t):
            if not isinstance(t, torch.Tensor):
                return t
            if name in _KV_CU:
                return self._slice_kv(name, t, b)
            if name.endswith("block_table"):
                return t[b:b + 1]
            if (name in _PER_BATCH and not (name == "actual_seq_lengths_kv" and self.qsfa and self.lkv == "TND")) or (name == "actual_seq_lengths_query" and self.lq == "BSND") \
                    or (name == "output_idx_offset" and t.dim() == 1 and t.numel() == self.B) \
                    or (name.endswith("topk_length") and t.dim() == 1 and t.numel() == self.B
                        and not self._q_like(name, t)):
                return t[b:b + 1]
            if name.startswith("cu_seqlens") or (name == "actual_seq_lengths_query" and self.lq == "TND") \
                    or (name == "actual_seq_lengths_kv" and self.qsfa and self.lkv == "TND"):
                cu = t.to(torch.int64)
                if self.qsfa:                       # cumulative ends
                    s = int(cu[b - 1]) if b else 0
                    return torch.tensor([int(cu[b]) - s], dtype=t.dtype)
                return torch.tensor([0, int(cu[b + 1]) - int(cu[b])], dtype=t.dtype)
            if self._q_like(name, t):
                return self._slice_q_like(t, b)
            return t
        kw = {k: one(k, v) for k, v in self.kw.items() if k != "metadata"}
        extra = {k: one(k, v) for k, v in self.extra.items()}
        if unpadded:
            kw.pop("seqused_q", None)
        return self._slice_q_like(self.q, b), kw, extra

    def can_unpad(self) -> bool:
        """BSND with padding rows, and caches whose every block is mapped (the fuzz suite leaves blocks only
        padding rows would read unmapped)."""
        # (QSFA's actual_seq_lengths_query is no padding mark: it places the rows in causal modes)
        return (self.lq == "BSND" and "seqused_q" in self.kw
                and not any(k.endswith("block_table") for k in self.kw))

    # -- the keys only request b reads: (batch tensor's rows, alone tensor's rows) for a KV-shaped output
    def own_keys(self, name: str, batch_t: torch.Tensor, alone_t: torch.Tensor, b: int):
        if self.lkv == "BSND":
            return batch_t[b], alone_t[0]
        if self.lkv == "TND":
            s, e = _starts_ends(self.kw, self.B, _KV_CU[name], ends_only=self.qsfa)[b]
            return batch_t[s:e], alone_t
        table = next(v for k, v in self.kw.items() if k.endswith("block_table") and
                     (name != "cmp_kv" or k.startswith("cmp")) and (name != "ori_kv" or not k.startswith("cmp")))
        blocks = [int(x) for x in table[b].tolist() if 0 <= int(x) < batch_t.size(0)]
        blocks = sorted(set(blocks))
        return batch_t[blocks], alone_t[blocks]


# ----------------------------------------------------------------------------- the calls


def _rows_form(t: torch.Tensor, layout: str) -> torch.Tensor:
    """LSE-like outputs ``[B, 1, S1, H]`` / ``[1, T, H]`` with the query rows first."""
    return t.transpose(1, 2) if layout == "BSND" else t.transpose(0, 1)


def _call(family: str, q, kw, extra):
    """``(row outputs {name: tensor laid out like q}, key outputs {name: (kv name, tensor)})``."""
    from .. import ops
    lq = _q_layout(kw)
    if family == "mla":
        out, lse = ops.sparse_flash_mla(q, return_softmax_lse=True, **kw)
        rows = {"attn_out": out, "softmax_lse": _rows_form(lse, lq)}
        if any(k.endswith("block_table") for k in kw):         # (the gradient takes no paged caches)
            return rows, {}
        dq, dori, dcmp, _, l1o, l1c = ops.sparse_flash_mla_grad(q, extra["dout"], out, lse, **kw)
        keys = {"d_ori_kv": ("ori_kv", dori)}
        if "cmp_kv" in kw:
            keys["d_cmp_kv"] = ("cmp_kv", dcmp)
        return dict(rows, dq=dq, ori_l1=l1o, cmp_l1=l1c), keys
    if family in ("sharedkv", "packed"):
        fn = ops.sparse_attn_sharedkv if family == "sharedkv" else ops.sparse_attn_sharedkv_packed
        out, lse = fn(q, **{k: v for k, v in kw.items() if k != "metadata"})
        return {"attn_out": out}, {}
    if family == "indexer":
        idx, val = ops.lightning_indexer(q, extra["k"], extra["w"], extra["topk"], **kw)
        return {"indices": idx, "values": val}, {}
    if family == "kl":
        dq, dk, dw, y = ops.sparse_lightning_indexer_kl_loss_grad(q, extra["k"], extra["w"], extra["sparse_indices"],
                                                                  extra["p"], **kw)
        return {"dq": dq, "dw": dw, "softmax_out": y}, {"dk": ("k", dk)}
    if family == "qsfa":
        out = ops.kv_quant_sparse_flash_attention(q, extra["key"], extra["key"], extra["sparse_indices"], **kw)
        rows = {"attention_out": out[0]}
        if kw.get("return_softmax_lse"):
            rows.update(softmax_max=_rows_form(out[1], lq), softmax_sum=_rows_form(out[2], lq))
        return rows, {}
    raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    return torch.equal(a, b)


def on_threads(n: int, fn: Callable):
    """fn() run with torch set to n threads, then the count as it was."""
    was = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(was)


# families whose key gradients are compared by default
KEY_GRADS_INVARIANT = ("kl", "mla")


def check_attention(family: str, seed: int, key_grads: bool | None = None) -> list[str]:
    """The failures (empty when invariant) of one fuzz configuration of ``family``."""
    if key_grads is None:
        key_grads = family in KEY_GRADS_INVARIANT
    case = fuzz.draw(family, seed)
    kw = {k: v for k, v in case.kwargs.items() if k != "metadata"}
    req = Request(family, case.q, kw, dict(case.extra))
    rows, keys = _call(family, case.q, kw, req.extra)
    lead = tuple(case.q.shape[:2] if req.lq == "BSND" else case.q.shape[:1])
    rows = {k: v for k, v in rows.items() if tuple(v.shape[:len(lead)]) == lead}   # (absent outputs are empty)
    if not key_grads:
        keys = {}
    bad = []
    if torch.get_num_threads() > 1:
        rows1, keys1 = on_threads(1, lambda: _call(family, case.q, kw, req.extra))
        for name in rows:
            if not _bits_equal(rows[name], rows1[name]):
                bad.append(f"{case.name}: {name} differs between 1 and {torch.get_num_threads()} threads")
        for name in keys:
            if not _bits_equal(keys[name][1], keys1[name][1]):
                bad.append(f"{case.name}: {name} differs between 1 and {torch.get_num_threads()} threads")
    rnd = random.Random(seed)
    compared = 0
    for b in range(req.B):
        if req.valid_rows(b) == 0:
            continue
        for unpadded in [False] + ([True] if req.can_unpad() and rnd.random() < 0.5 else []):
            q1, kw1, extra1 = req.alone(b, unpadded)
            got_rows, got_keys = _call(family, q1, kw1, extra1)
            compared += 1
            for name, t in rows.items():
                want = req.rows(t, b)
                got = got_rows[name][0, :want.size(0)] if req.lq == "BSND" else got_rows[name][:want.size(0)]
                if not _bits_equal(got, want):
                    bad.append(f"{case.name}: request {b} {name} alone{' without seqused_q' if unpadded else ''} "
                               f"differs from its rows in the batch")
            for name, (kv, t) in (keys.items() if not unpadded else ()):   # (unpadded, padding rows read keys too)
                mine, alone = req.own_keys(kv, t, got_keys[name][1], b)
                if not _bits_equal(mine, alone):
                    bad.append(f"{case.name}: request {b} {name} over its own keys differs alone")
    return bad


def _compressor_call(args, kw):
    """``(cmp_kv, state_cache after the call, dx)`` of ``compressor`` on fresh copies of ``args``."""
    from .. import ops
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    x = args[0].requires_grad_()
    out = ops.compressor(x, *args[1:], **kw)
    g = torch.cos(out.detach().float() * 3.0).to(out.dtype)     # a function of each row: equal rows, equal g
    (dx,) = torch.autograd.grad(out, x, g, allow_unused=True) if out.numel() else (torch.zeros_like(x),)
    return out.detach(), args[3], dx if dx is not None else torch.zeros_like(x)


def check_compressor(seed: int) -> list[str]:
    """The compressor's output rows, the state-cache rows of the request's own blocks and dx of its rows:
    alone (its rows, lengths, start position and table row; the same state pool) against the batch."""
    case = fuzz.draw("compressor", seed)
    x, kw = case.args[0], dict(case.kwargs)
    r = case.args[5]
    B = kw["start_pos"].numel()
    packed = x.dim() == 2
    cu = kw["cu_seqlens"].to(torch.int64).tolist() if packed else None
    used = kw.get("seqused")
    sp = kw["start_pos"].to(torch.int64).tolist()
    su = [(cu[b + 1] - cu[b]) if packed else (int(used[b]) if used is not None else x.size(1)) for b in range(B)]
    if packed and used is not None:
        su = [min(a, int(u)) for a, u in zip(su, used)]
    n = [(sp[b] + su[b]) // r - sp[b] // r for b in range(B)]
    out, state, dx = _compressor_call(case.args, kw)
    bad = []
    if torch.get_num_threads() > 1:
        out1, state1, dx1 = on_threads(1, lambda: _compressor_call(case.args, kw))
        for name, a, b in (("cmp_kv", out, out1), ("state_cache", state, state1), ("dx", dx, dx1)):
            if not _bits_equal(a, b):
                bad.append(f"{case.name}: {name} differs between 1 and {torch.get_num_threads()} threads")
    table = kw.get("state_block_table")
    for b in range(B):
        if su[b] == 0:
            continue
        kw1 = dict(kw, start_pos=kw["start_pos"][b:b + 1])
        if table is not None:
            kw1["state_block_table"] = table[b:b + 1]
        if used is not None:
            kw1["seqused"] = used[b:b + 1]
        if packed:
            kw1["cu_seqlens"] = torch.tensor([0, cu[b + 1] - cu[b]], dtype=kw["cu_seqlens"].dtype)
            x1 = x[cu[b]:cu[b + 1]]
        else:
            x1 = x[b:b + 1]
        out1, state1, dx1 = _compressor_call((x1,) + tuple(case.args[1:]), kw1)
        first = sum(n[:b]) if packed else 0
        mine = out[first:first + n[b]] if packed else out[b, :n[b]]
        alone = out1[:n[b]] if packed else out1[0, :n[b]]
        if not _bits_equal(mine, alone):
            bad.append(f"{case.name}: request {b} cmp_kv alone differs from its rows in the batch")
        rows_dx = dx[cu[b]:cu[b] + su[b]] if packed else dx[b, :su[b]]
        alone_dx = dx1[:su[b]] if packed else dx1[0, :su[b]]
        if not _bits_equal(rows_dx, alone_dx):
            bad.append(f"{case.name}: request {b} dx alone differs from its rows in the batch")
        if table is not None:                    # the state rows of its own blocks
            blocks = sorted({int(v) for v in table[b].tolist() if 0 <= int(v) < state.size(0)})
            if not _bits_equal(state[blocks], state1[blocks]):
                bad.append(f"{case.name}: request {b} state_cache rows differ alone")
    return bad


FAMILIES = ("mla", "sharedkv", "packed", "indexer", "kl", "qsfa", "compressor", "weights")


def check(family: str, seed: int, key_grads: bool | None = None) -> list[str]:
    """The failures of one configuration (empty: every request's rows gave the same bits alone, and
    the batch on one thread the same as on all)."""
    if family == "compressor":
        return check_compressor(seed)
    if family == "weights":                      # the quantised linears, in their batch-invariant mode
        from .weights import check_invariance
        return check_invariance(seed)
    return check_attention(family, seed, key_grads)


def check_seeds(family: str, seeds) -> tuple[int, list[str]]:
    """``(configurations, failures)`` over ``seeds``; a failure line ends with its reproduction."""
    failures, n = [], 0
    for seed in seeds:
        n += 1
        for line in check(family, seed):
            failures.append(f"{line}  [repro: dsattn verify --batch-invariance 1 --family {family} --seed {seed}]")
    return n, failures
