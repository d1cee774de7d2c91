"""``compressor_inference`` post-processing (30-compressor §3): RMSNorm of every emitted entry,
then RoPE on its last ``rope_head_dim`` dims, each rounded to x's dtype as an unfused model
would hold it."""
from __future__ import annotations

import torch

from ..common.checks import check_dtype, fail, stat_dtype
from ..common.rope import check_rotary_args, rms_norm, rotary
from .problem import CompressorProblem


def check_inference_args(pb: CompressorProblem, norm_weight, rope_sin, rope_cos, rope_head_dim, norm_eps,
                         rotary_mode):
    """Check §6's inference arguments; return the rotary tables as ``[N_out, R]`` views."""
    check_rotary_args(rope_head_dim, rotary_mode, pb.D, norm_eps)
    if norm_weight.dtype not in (torch.float32, pb.x.dtype, stat_dtype(pb.x)):
        fail("norm_weight", f"dtype {norm_weight.dtype} is not supported; expected float32 or {pb.x.dtype}",
             TypeError)
    if tuple(norm_weight.shape) != (pb.D,):
        fail("norm_weight", f"expected shape [D={pb.D}], got {tuple(norm_weight.shape)}")
    tables = []
    for name, t in (("rope_sin", rope_sin), ("rope_cos", rope_cos)):
        check_dtype(name, t, stat_dtype(pb.x))
        ok_shapes = {(pb.N_out, rope_head_dim)}
        if not pb.packed:
            ok_shapes.add((pb.B, pb.out_rows_per_batch, rope_head_dim))
        if tuple(t.shape) not in ok_shapes:
            want = " or ".join(str(list(s)) for s in sorted(ok_shapes, key=len))
            fail(name, f"expected shape {want} (one row per output row, width rope_head_dim), got {tuple(t.shape)}")
        tables.append(t.reshape(pb.N_out, rope_head_dim))
    return tables[0], tables[1]


def normalize_and_rotate(pb: CompressorProblem, C: torch.Tensor, rows: torch.Tensor, norm_weight, sin, cos,
                         rope_head_dim: int, norm_eps: float, rotary_mode: int) -> torch.Tensor:
    """Entries ``C`` (compute dtype ``[n, D]``) at output ``rows`` -> post-processed, x dtype."""
    xdt, cd, D, R = pb.x.dtype, C.dtype, pb.D, rope_head_dim
    y = rms_norm(C.to(xdt).to(cd), norm_weight, norm_eps).to(xdt)
    if R == 0:
        return y
    rope = rotary(y[:, D - R:].to(cd), cos[rows], sin[rows], rotary_mode).to(xdt)
    return torch.cat([y[:, :D - R], rope], dim=1)
