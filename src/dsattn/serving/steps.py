"""Per-step inputs of 60-serving §3.2 and §4, built on the host from CPU mirrors
(:func:`build_cu_seqlens_q_cpu`, :func:`build_seqused_kv_cpu`) or on the device with fixed
shapes and no host read (:func:`compressor_metadata`)."""
from __future__ import annotations

import torch

from ..common.checks import content_checks_enabled, fail, host_ints

MODES = ("prefill", "extend", "decode", "verify", "draft_extend")


INT32_MAX = 2**31 - 1


def _count(arg: str, v, lo: int) -> int:
    """A host integer argument (batch size, tokens per request) >= ``lo``."""
    if isinstance(v, bool) or not isinstance(v, int):
        fail(arg, f"expected an int, got {type(v).__name__}", TypeError)
    if v < lo:
        fail(arg, f"must be >= {lo}, got {v}")
    return v


def _cpu_ints(arg: str, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(arg, f"expected a CPU integer tensor, got {type(t).__name__}", TypeError)
    if t.device.type != "cpu":
        fail(arg, f"must be a CPU tensor (a mirror of scheduler state), got device {t.device}")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        fail(arg, f"dtype {t.dtype} is not supported; expected an integer dtype", TypeError)
    return t


def build_cu_seqlens_q_cpu(mode: str, *, seq_lens_cpu=None, batch_size=None, tokens_per_req=None,
                           new_tokens_cpu=None) -> torch.Tensor:
    """CPU int32 ``cu_seqlens_q`` with the leading 0 (60 §3.2).

    prefill / extend: ``[0, cumsum(seq_lens_cpu)]`` where ``seq_lens_cpu`` holds the per-request
    *new-token* (extend) counts (``new_tokens_cpu`` is an alias); decode: ``arange(0, B + 1)``;
    verify / draft_extend: ``arange(0, B·n + 1, n)``."""
    if mode not in MODES:
        fail("mode", f"value {mode!r} is not one of {list(MODES)}")
    if mode in ("prefill", "extend"):
        if seq_lens_cpu is not None and new_tokens_cpu is not None:
            fail("new_tokens_cpu", "is an alias of seq_lens_cpu; pass only one of them")
        lens = seq_lens_cpu if seq_lens_cpu is not None else new_tokens_cpu
        if lens is None:
            fail("seq_lens_cpu", f"is required for mode {mode!r} (the per-request new-token counts)")
        lens = _cpu_ints("seq_lens_cpu", lens)
        if lens.dim() != 1 or bool((lens < 0).any()):
            fail("seq_lens_cpu", "expected a 1-D tensor of non-negative new-token counts")
        cu = torch.cumsum(lens.to(torch.int64), 0)
        if cu.numel() and int(cu[-1]) > INT32_MAX:
            fail("seq_lens_cpu", f"the total of {int(cu[-1])} new tokens does not fit the int32 cu_seqlens_q")
        return torch.cat([torch.zeros(1, dtype=torch.int32), cu.to(torch.int32)])
    if batch_size is None:
        fail("batch_size", f"is required for mode {mode!r}")
    _count("batch_size", batch_size, 0)
    if mode == "decode":
        if batch_size > INT32_MAX:
            fail("batch_size", f"value {batch_size} does not fit the int32 cu_seqlens_q")
        return torch.arange(0, batch_size + 1, dtype=torch.int32)
    if tokens_per_req is None:
        fail("tokens_per_req", f"is required for mode {mode!r}")
    _count("tokens_per_req", tokens_per_req, 1)
    if batch_size * tokens_per_req > INT32_MAX:
        fail("batch_size", f"{batch_size} requests x {tokens_per_req} tokens do not fit the int32 cu_seqlens_q")
    return torch.arange(0, batch_size * tokens_per_req + 1, tokens_per_req, dtype=torch.int32)


def build_seqused_kv_cpu(final_seq_lens_cpu: torch.Tensor, batch_size: int, *, clamp_min: int = 1) -> torch.Tensor:
    """CPU int32 ``[batch_size]``: the final per-request KV lengths, clamped to >= ``clamp_min``
    (graph-replay padding requests get one key, the dummy slot)."""
    t = _cpu_ints("final_seq_lens_cpu", final_seq_lens_cpu)
    _count("batch_size", batch_size, 0)
    _count("clamp_min", clamp_min, 0)
    if t.dim() == 1 and t.numel() and (int(t.min()) < 0 or int(t.max()) > INT32_MAX):
        fail("final_seq_lens_cpu", f"values must be in [0, {INT32_MAX}], got [{int(t.min())}, {int(t.max())}]")
    if t.dim() != 1 or t.size(0) < batch_size:
        fail("final_seq_lens_cpu", f"expected a 1-D tensor with at least batch_size={batch_size} entries, "
             f"got shape {tuple(t.shape)}")
    return t[:batch_size].to(torch.int32).clamp(min=clamp_min)


def compressor_metadata(rope_cos, rope_sin, cu_seqlens, start_pos, kv_block_table, *, kv_block_size,
                        compress_ratio, num_rows, seqused=None, slot_mapping_format="flat"):
    """Rotary rows and compressed-cache slots of the compressor's packed 2-D output (60 §4).

    Returns ``(cos [num_rows, R], sin [num_rows, R], slots)``; ``slots`` int32 ``[num_rows]``
    ("flat": ``page·kv_block_size + offset``) or ``[num_rows, 2]`` ("block_offset").  Padding rows:
    cos 1, sin 0, slot -1 / (-1, kv_block_size - 1).  Fixed shapes, computed on the tensors'
    device without reading them on the host."""
    _count("num_rows", num_rows, 0)
    if slot_mapping_format not in ("flat", "block_offset"):
        fail("slot_mapping_format", f"value {slot_mapping_format!r} is not one of ['flat', 'block_offset']")
    R = rope_cos.size(-1)
    out_cos = torch.empty(num_rows, R, dtype=rope_cos.dtype, device=rope_cos.device)
    out_sin = torch.empty_like(out_cos)
    shape = (num_rows,) if slot_mapping_format == "flat" else (num_rows, 2)
    out_slots = torch.empty(shape, dtype=torch.int32, device=rope_cos.device)
    compressor_metadata_out(rope_cos, rope_sin, cu_seqlens, start_pos, kv_block_table, kv_block_size=kv_block_size,
                            compress_ratio=compress_ratio, num_rows=num_rows, seqused=seqused,
                            slot_mapping_format=slot_mapping_format, out_cos=out_cos, out_sin=out_sin,
                            out_slot_mapping=out_slots)
    return out_cos, out_sin, out_slots


def _check_compressor_metadata(max_positions, cu_seqlens, start_pos, kv_block_table, seqused, bs, r, num_rows):
    """Content checks (host reads; skipped during graph capture): what the fixed-shape computation
    would otherwise clamp or wrap silently."""
    cu, sp = host_ints(cu_seqlens), host_ints(start_pos)
    if cu[0] != 0:
        fail("cu_seqlens", f"must start at 0, got {cu[0]}")
    ext = [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
    for b, e in enumerate(ext):
        if e < 0:
            fail("cu_seqlens", f"must be non-decreasing, got {cu[b]} then {cu[b + 1]} at batch {b}")
    su = ext if seqused is None else host_ints(seqused)
    table = kv_block_table.cpu()
    total = 0
    for b, (s, n, e) in enumerate(zip(sp, su, ext)):
        if s < 0:
            fail("start_pos", f"value {s} at batch {b} is negative")
        if not 0 <= n <= e:
            fail("seqused", f"value {n} at batch {b} is not in [0, {e}] (the batch's rows in cu_seqlens)")
        first, end = s // r, (s + n) // r                       # compressed entries [first, end) emitted
        total += end - first
        if end > first and (end - 1) * r >= max_positions:
            fail("start_pos", f"batch {b} emits compressed position {(end - 1) * r}, beyond the rope table's "
                 f"{max_positions} rows")
        for col in range(first // bs, -(-end // bs)) if end > first else ():
            if col >= table.size(1) or int(table[b, col]) < 0:
                entry = "missing" if col >= table.size(1) else int(table[b, col])
                fail("kv_block_table", f"entry [{b}, {col}] is {entry} but batch {b} writes compressed entries "
                     f"{max(first, col * bs)}..{min(end, (col + 1) * bs) - 1} there")
    if total > num_rows:
        fail("num_rows", f"value {num_rows} is smaller than the {total} compressed rows this call emits")


def compressor_metadata_out(rope_cos, rope_sin, cu_seqlens, start_pos, kv_block_table, *, kv_block_size,
                            compress_ratio, num_rows, seqused=None, slot_mapping_format="flat", out_cos,
                            out_sin, out_slot_mapping) -> None:
    """:func:`compressor_metadata` into fixed buffers (graph replay)."""
    if slot_mapping_format not in ("flat", "block_offset"):
        fail("slot_mapping_format", f"value {slot_mapping_format!r} is not one of ['flat', 'block_offset']")
    for name, t in (("rope_cos", rope_cos), ("rope_sin", rope_sin)):
        if t.dtype != torch.float32 or t.dim() != 2:
            fail(name, f"expected a float32 [max_positions, R] table, got {t.dtype} {tuple(t.shape)}", TypeError)
    for name, t in (("cu_seqlens", cu_seqlens), ("start_pos", start_pos), ("kv_block_table", kv_block_table),
                    ("seqused", seqused)):
        if t is not None and t.dtype != torch.int32:
            fail(name, f"dtype {t.dtype} is not supported; expected torch.int32", TypeError)
    _count("compress_ratio", compress_ratio, 1)
    _count("kv_block_size", kv_block_size, 1)
    _count("num_rows", num_rows, 0)
    if rope_sin.shape != rope_cos.shape:
        fail("rope_sin", f"shape {tuple(rope_sin.shape)} does not match rope_cos' {tuple(rope_cos.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        fail("cu_seqlens", f"expected shape [B+1], got {tuple(cu_seqlens.shape)}")
    B = cu_seqlens.numel() - 1
    if tuple(start_pos.shape) != (B,):
        fail("start_pos", f"expected shape [B]=[{B}] (B from cu_seqlens), got {tuple(start_pos.shape)}")
    if kv_block_table.dim() != 2 or kv_block_table.size(0) != B:
        fail("kv_block_table", f"expected shape [B={B}, pages], got {tuple(kv_block_table.shape)}")
    if seqused is not None and tuple(seqused.shape) != (B,):
        fail("seqused", f"expected shape [B]=[{B}], got {tuple(seqused.shape)}")
    R_out = rope_cos.size(-1)
    for name, t, shape in (("out_cos", out_cos, (num_rows, R_out)), ("out_sin", out_sin, (num_rows, R_out)),
                           ("out_slot_mapping", out_slot_mapping,
                            (num_rows,) if slot_mapping_format == "flat" else (num_rows, 2))):
        if tuple(t.shape) != shape:
            fail(name, f"expected shape {list(shape)}, got {tuple(t.shape)}")
    if content_checks_enabled(rope_cos, cu_seqlens, start_pos, kv_block_table, seqused):
        _check_compressor_metadata(rope_cos.size(0), cu_seqlens, start_pos, kv_block_table, seqused,
                                   kv_block_size, compress_ratio, num_rows)
    dev = rope_cos.device
    r = compress_ratio
    su = (cu_seqlens[1:] - cu_seqlens[:-1]) if seqused is None else seqused
    sp = start_pos.to(torch.int64)
    g0 = sp // r
    n = (sp + su.to(torch.int64)) // r - g0
    off = torch.cumsum(n, 0) - n
    rows = torch.arange(num_rows, device=dev)
    b = torch.searchsorted(torch.cumsum(n, 0), rows, right=True)
    live = b < B
    bc = b.clamp(max=max(B - 1, 0))
    cp = torch.where(live, g0[bc] + rows - off[bc], torch.zeros_like(rows)) if B else torch.zeros_like(rows)
    pos = (cp * r).clamp(max=rope_cos.size(0) - 1)
    out_cos.copy_(torch.where(live[:, None], rope_cos[pos], torch.ones((), device=dev)))
    out_sin.copy_(torch.where(live[:, None], rope_sin[pos], torch.zeros((), device=dev)))
    col = (cp // kv_block_size).clamp(max=kv_block_table.size(1) - 1)
    page = kv_block_table[bc, col].to(torch.int64) if B else torch.zeros_like(rows)
    offset = cp % kv_block_size
    if slot_mapping_format == "flat":
        out_slot_mapping.copy_(torch.where(live, page * kv_block_size + offset, torch.full_like(rows, -1)))
    else:
        out_slot_mapping.copy_(torch.stack([torch.where(live, page, torch.full_like(rows, -1)),
                                            torch.where(live, offset, torch.full_like(rows, kv_block_size - 1))], 1))
