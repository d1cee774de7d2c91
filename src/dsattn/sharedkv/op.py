"""Registration of ``dsattn::sparse_attn_sharedkv`` (20 §4), its packed-cache variant
``dsattn::sparse_attn_sharedkv_packed`` (a library extension) and
``dsattn::sparse_attn_sharedkv_metadata`` (50 §1.1).

With ``metadata`` the attention executes the plan core by core (:mod:`.execute`); the plan is
read on the host, which on an accelerator means one small device-to-host copy, so during CUDA
graph capture (or on fake tensors) the same result is computed without walking the plan.
Without ``metadata`` the rows are computed directly.  Results never depend on the plan.
"""
from __future__ import annotations

import torch

from .._registry import register
from ..backend import use_triton
from ..common.checks import content_checks_enabled
from .. import native
from ..planner import fast as fast_planner, native as native_planner
from ..planner.params import TABLE_SIZE, plan_params
from ..planner.table import encode
from ..quant.rows import PackedKV
from ..sparse_mla import dispatch as mla_dispatch
from . import compiled
from .execute import execute, read_plan
from .problem import parse_sharedkv

SHAREDKV_SCHEMA = (
    "sparse_attn_sharedkv(Tensor q, *, Tensor? ori_kv=None, Tensor? cmp_kv=None, "
    "Tensor? ori_sparse_indices=None, Tensor? cmp_sparse_indices=None, "
    "Tensor? ori_block_table=None, Tensor? cmp_block_table=None, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, "
    "Tensor? seqused_q=None, Tensor? seqused_kv=None, Tensor? sinks=None, Tensor? metadata=None, "
    "float softmax_scale=0.0, int cmp_ratio=0, int ori_mask_mode=4, int cmp_mask_mode=3, "
    'int ori_win_left=127, int ori_win_right=0, str layout_q="BSND", str layout_kv="PA_ND", '
    "bool return_softmax_lse=False, Tensor? cmp_topk_length=None) -> (Tensor, Tensor)")
# ``cmp_topk_length`` (last, keyword-only) is a library extension of the CANN schema: the per-request or
# per-row cap of the compressed walk of sparse_flash_mla (20 §2.8), for FlashMLA's ``topk_length``.

# Library extension (not a CANN operator): the same call over packed int8 / float8_e4m3fn caches.
# The CANN DSV4 quantised shared-KV kernel (640-byte rows) is a different packing (00 §2).
PACKED_SCHEMA = SHAREDKV_SCHEMA.replace("sparse_attn_sharedkv(", "sparse_attn_sharedkv_packed(").replace(
    "Tensor? cmp_topk_length=None)", "Tensor? cmp_topk_length=None, int kv_rope_dim=64, int kv_tile_size=64)")

METADATA_SCHEMA = (
    "sparse_attn_sharedkv_metadata(int num_heads_q, int num_heads_kv, int head_dim, *, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, "
    "Tensor? seqused_q=None, Tensor? seqused_kv=None, int batch_size=0, int max_seqlen_q=0, "
    "int max_seqlen_kv=0, int ori_topk=0, int cmp_topk=0, int cmp_ratio=-1, int ori_mask_mode=4, "
    "int cmp_mask_mode=3, int ori_win_left=127, int ori_win_right=0, "
    'str layout_q="BSND", str layout_kv="PA_ND", bool has_ori_kv=True, bool has_cmp_kv=True, '
    "str? device=None, int aic_core_num=24, int aiv_core_num=48, bool support_fd=False) -> Tensor")


def _walkable(metadata, q) -> bool:
    return metadata is not None and content_checks_enabled(metadata, q)


def _kernel(q, packed=None, **kw):
    out = compiled.run(q, packed, kw)                         # decode-sized paged calls: one compiled step
    if out is not None:
        return out, q.new_zeros((0,), dtype=torch.float32)
    P = parse_sharedkv(q, packed=packed, **kw)
    metadata = kw.get("metadata")
    empty = q.new_zeros((0,), dtype=torch.float32)
    if metadata is not None and use_triton(q.device):
        from . import triton as triton_kernels                # imported only when Triton runs
        if triton_kernels.supports(P):
            if _walkable(metadata, q):                        # content checks: the plan must fit the call
                read_plan(P, metadata, check=True)
            return triton_kernels.execute(P, metadata), empty
    if _walkable(metadata, q):
        return execute(P, metadata), empty
    out, _ = mla_dispatch.forward(P, False)
    return out, empty


def _fake(q, packed=None, **kw):
    parse_sharedkv(q, content=False, packed=packed, **kw)
    return torch.empty_like(q), q.new_empty((0,), dtype=torch.float32)


def _packed_kernel(q, *, kv_rope_dim=64, kv_tile_size=64, **kw):
    """Packed rows ``[quantised D - kv_rope_dim | rope 16-bit | fp32 scales]``
    (:func:`dsattn.quant.quantize_kv_rows`); only the rows a query reads are dequantised."""
    return _kernel(q, packed=PackedKV(kv_rope_dim, kv_tile_size), **kw)


def _packed_fake(q, *, kv_rope_dim=64, kv_tile_size=64, **kw):
    return _fake(q, packed=PackedKV(kv_rope_dim, kv_tile_size), **kw)


def build_table(num_heads_q, num_heads_kv, head_dim, *, allow_device=True, **kw) -> torch.Tensor:
    """The plan as a CPU int32 ``(1024,)`` tensor: the compiled planner when the native layer is
    loaded (:mod:`dsattn.native`), else the NumPy fast planner; both byte-identical to the golden."""
    module = native.load()
    if module is not None:
        return native_planner.plan_table(module, num_heads_q, num_heads_kv, head_dim, allow_device=allow_device, **kw)
    return encode(fast_planner.plan(plan_params(num_heads_q, num_heads_kv, head_dim, allow_device=allow_device, **kw)))


def _metadata_kernel(num_heads_q, num_heads_kv, head_dim, **kw):
    device = kw.pop("device", None)
    table = build_table(num_heads_q, num_heads_kv, head_dim, **kw)
    return table if device is None else table.to(device)


def _metadata_fake(num_heads_q, num_heads_kv, head_dim, **kw):
    device = kw.get("device")
    return torch.empty((TABLE_SIZE,), dtype=torch.int32, device=device or "cpu")


register(SHAREDKV_SCHEMA, _kernel, _fake)
register(PACKED_SCHEMA, _packed_kernel, _packed_fake)
register(METADATA_SCHEMA, _metadata_kernel, _metadata_fake)
