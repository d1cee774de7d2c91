"""``dsattn bench --which``: the implementation each piece takes on this machine, one line each.

It sits above the operator families (it asks each family's ``dispatch.py`` and the compiled layer),
so that :mod:`dsattn.backend`, which the families consult, imports none of them."""
from __future__ import annotations

import torch

from .backend import requested, triton_available


def describe() -> str:
    """The implementation each piece takes on this machine, one line each."""
    from . import native
    from .native import isa
    lines = [isa.describe() + f" ({isa.VARIABLE} caps it: {', '.join(isa.CLASSES)})",
             f"DSATTN_BACKEND={requested()}: "
             + ("CUDA tensors run the Triton kernels" if requested() != "torch" and triton_available()
                else "every device runs the vectorised PyTorch path")
             + (f" (this machine: {torch.cuda.get_device_name()})" if torch.cuda.is_available() else
                " (this machine: no CUDA device)"),
             "CPU attention forward: " + _cpu_attention(native.kernels()),
             "CPU indexer: " + ("compiled (dsattn/native/indexer.cpp): scores and a running top-k per row over its "
                                "keys in place (BSND, TND, paged)" if native.kernels() is not None else
                                "vectorised PyTorch"),
             "CPU attention backward: " + ("compiled (dsattn/native/attention.cpp), the same GEMM dispatch"
                                           if native.kernels() is not None else "vectorised PyTorch"),
             "CPU compressor pooling: " + ("compiled (dsattn/native/compressor.cpp): each output row's gated softmax "
                                          "over its slots in one call" if native.load() is not None else
                                          "vectorised PyTorch"),
             "sparse_flash_mla (sparse_mla.dispatch), a bf16 CPU call: " + _mla_dispatch(False)
             + "; its gradient: " + _mla_dispatch(True),
             "lightning_indexer (indexer.dispatch), a bf16 CPU call: " + _indexer_dispatch(),
             "quant_lightning_indexer (indexer.dispatch), a bf16 query over FP8 keys on the CPU: "
             + _quant_indexer_dispatch(),
             "FlashMLA's API (sparse_mla.rows), a bf16 CPU call: " + _rows_dispatch(),
             "sparse_attn_sharedkv over paged caches, a bf16 CPU call: " + _sharedkv_step(),
             "fp8_block_linear / mxfp4_linear (weights.dispatch), a bf16 CPU call: " + _quant_linear_dispatch(),
             f"metadata planner: {native.status()}"
             + ("" if native.load() is not None else "; the NumPy fast planner runs")]
    return "\n".join(lines)


def _dispatch_line(explained: list[tuple[str, list[str]]]) -> str:
    """The first implementation without reasons, and why each one before it in the order does not run."""
    skipped = []
    for name, why in explained:
        if not why:
            return name + (f" (not {', '.join(skipped)})" if skipped else "")
        skipped.append(f"{name}: {'; '.join(why)}")
    return "none (" + ", ".join(skipped) + ")"


def _indexer_dispatch() -> str:
    """The implementation ``lightning_indexer`` picks for a small bf16 CPU call."""
    from .indexer import dispatch
    from .indexer.op import _indexer_parse
    P, _, _ = _indexer_parse(torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16), torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16),
                             torch.zeros(1, 1, 16), 2, {}, True)
    return _dispatch_line(dispatch.explain(P))


def _quant_indexer_dispatch() -> str:
    """The implementation ``quant_lightning_indexer`` picks for a small CPU call over FP8 keys."""
    from .indexer import dispatch
    from .indexer.quant import parse_quant_indexer
    key = torch.zeros(1, 4, 1, 64).to(torch.float8_e4m3fn)
    P, _, _ = parse_quant_indexer(torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16), key, torch.zeros(1, 1, 16), None,
                                  torch.ones(1, 4, 1), 2, 0, {}, True)
    return _dispatch_line(dispatch.explain_quant(P)) + " (codes decoded as they are scored: no dequantised copy)"


def _rows_dispatch() -> str:
    """The implementation ``sparse_mla.rows`` picks for a small bf16 CPU call."""
    from .sparse_mla import rows
    q = torch.zeros(1, 16, 64, dtype=torch.bfloat16)
    return _dispatch_line(rows.explain(q, [torch.zeros(4, 64, dtype=torch.bfloat16)]))


def _sharedkv_step() -> str:
    """Whether a paged ``sparse_attn_sharedkv`` call (and FlashMLA's sparse decode) takes the one-step path."""
    from .sharedkv import compiled
    why = compiled.reasons(torch.zeros(1, 16, 64, dtype=torch.bfloat16), {"ori_kv": torch.zeros(1, 4, 1, 64),
                                                                           "layout_q": "TND"})
    return ("one compiled step (dsattn/native/sharedkv.cpp), the Python path for the calls it declines"
            if not why else "the Python path (" + "; ".join(why) + ")") + \
        "; FlashMLA's sparse decode takes its own step (flashmla.cpp) wherever its compiled implementation runs"


def _mla_dispatch(grad: bool) -> str:
    """The implementation ``sparse_flash_mla`` (or its gradient) picks for a small bf16 CPU call."""
    from .sparse_mla import dispatch
    from .sparse_mla.problem import parse_mla
    P = parse_mla(torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16), ori_kv=torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16))
    return _dispatch_line(dispatch.explain(P, grad))


def _quant_linear_dispatch() -> str:
    """The implementation the quantised linears pick for a bf16 CPU call, its streamed route and the mode."""
    from .weights import dispatch, invariance
    from .weights.problem import parse_fp8_linear
    P = parse_fp8_linear(torch.zeros(1, 128, dtype=torch.bfloat16), torch.zeros(16, 128, dtype=torch.uint8),
                         torch.ones(1, 1), [128, 128], None)
    line = _dispatch_line(dispatch.explain(P))
    if dispatch.choose(P).name != "compiled":
        return line
    from .native import isa
    route = ("vdpbf16ps" if isa.bf16_units() else "fp32 FMA") + " for bf16 x"
    mode = ("every call streamed (batch-invariant mode, DSATTN_BATCH_INVARIANT)" if invariance.requested() else
            "calls of more than 8 rows tiled on the GEMM path (DSATTN_BATCH_INVARIANT=1 streams every call: "
            "batch-invariant)")
    return f"{line}: up to 8 rows streamed ({route}), {mode}"


def _cpu_attention(module) -> str:
    if module is None:
        return "vectorised PyTorch (the compiled kernels are not loaded)"
    gemm = {m: module.attention_gemm(m) for m in ("bfloat16", "float16")}
    from . import native
    requested = native.gemm_requested()
    forced = f" (forced: DSATTN_NATIVE_GEMM={requested})" if requested != "best" else ""
    how = {"amx": "half-precision products, fp32 sums (AMX: oneDNN's ukernel)",
           "avx512bf16": "bf16 products, fp32 sums (AVX512-BF16: dsattn's register-tiled vdpbf16ps micro-kernel)"
                         + forced,
           "onednn": "bf16 products, fp32 sums (AVX512-BF16: oneDNN's avx512_core_bf16 ukernel)" + forced,
           "fp32": "widened to fp32 GEMMs" + (forced if requested == "fp32" else
                                              f" (CPU class {module.cpu_isa()}: no 16-bit products)")}.get
    return (f"compiled (dsattn/native/attention.cpp): bf16 {how(gemm['bfloat16'])}{_bf16_choice(module)}; "
            f"fp16 {how(gemm['float16'])}; "
            "fp32 GEMMs for fp32; packed int8 / fp8 caches (dsattn's rows, FlashMLA's V3.2 / V4 layouts) decoded "
            "token by token as the kernel gathers them; fp64 queries and the flash opt-in keep vectorised PyTorch")


def _bf16_choice(module) -> str:
    """On an AVX512-BF16 CPU without AMX: the two kernels' rates on the attention's shapes, as the process timed them."""
    c = module.bf16_gemm_choice()
    if not c["measured"]:
        return ""
    theirs = f"oneDNN's avx512_core_bf16 {c['onednn_gflops']:.0f}" if c["onednn_runs"] else "oneDNN's: " + c["why"]
    return (f" [timed once on the attention's GEMM shapes, one thread: micro-kernel {c['own_gflops']:.0f} GFLOP/s, "
            f"{theirs}; the process runs {c['chosen']}: {c['why']}]")
