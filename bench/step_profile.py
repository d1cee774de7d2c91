"""Where a served decode step's time goes, by kind of work: the weights (linear layers), attention, the MoE loop
and the rest, from a ``torch.profiler`` capture (CPU activities) of the step; and the machine's copy bandwidth,
for the bandwidth-bound floor of a step that streams its weights.  Used by ``bench/fp8_serve.py`` in its vLLM worker
(vLLM in-process, so that the profiler sees the whole engine step).

How an op is classified: :data:`CATEGORIES` below, the one table.  How nesting is handled: :func:`claimed_events`.
"""
from __future__ import annotations

import fnmatch
import time
from collections import defaultdict

import torch

# The record_function ranges install_moe_ranges() puts around vLLM's MoE pieces: on CPU vLLM calls its MoE
# runner directly (no ``vllm::moe_forward`` custom op there), so nothing in a trace says which linears are the
# experts' without them.
MOE_GATE_RANGE = "bench::moe gate (router logits)"
MOE_TOPK_RANGE = "bench::moe top-k (routing)"
MOE_EXPERTS_RANGE = "bench::moe routed experts"

# Profiler event names (fnmatch patterns) of each kind of work.  An event counts, whole, toward the first category
# whose patterns match its name, unless an enclosing event was claimed already (claimed_events: the outermost
# classified event wins).  So the expert linears inside the MoE ranges count as MoE, not as weights, and whatever vLLM's
# attention ops run inside them counts as attention: for MLA that includes the absorbed ``kv_b_proj`` products (the
# ``aten::bmm`` of q with W_UK and of the output with W_UV, held dequantised in the model dtype) and, on CPU, the copy
# that makes each permuted W_UK / W_UV contiguous for the bmm.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("MoE", (
        "bench::moe *",                     # the ranges above: router gate, top-k, routed experts (dsattn's loop or
                                            # vLLM's kernels inside)
        "vllm::moe_forward*", "vllm::fused_experts", "vllm::fp32_router_gemm_dispatch",
        "_C::cpu_fused_moe", "_C::fused_experts_cpu", "_C::dynamic_4bit_int_moe",
        "_C::biased_topk_cpu", "_C::hash_topk_cpu",            # V4's routing kernels
    )),
    ("attention", (
        # dsattn's attention, indexer, compressor and KV-cache ops
        "dsattn::sparse_flash_mla", "dsattn::*lightning_indexer", "dsattn::sparse_attn_sharedkv*",
        "dsattn::kv_quant_sparse_flash_attention", "dsattn::compressor*", "dsattn::kv_rmsnorm_rope_quant_cache",
        # vLLM's attention layers (each backend runs inside these custom ops), the plug-in's indexer op
        # (``vllm::dsattn_dsa_indexer``) and the KV-cache writes
        "vllm::unified_*attention*", "vllm::*kv_cache_update", "vllm::*indexer*", "vllm::*sdpa*",
        # vLLM's CPU attention and cache kernels, where a backend calls them outside those ops
        "_C::*attention*", "_C::cpu_attn_*", "_C::mla_decode_kvcache", "_C::flash_mla_with_kvcache_cpu",
        "_C::concat_and_cache_mla_cpu", "_C::fp8_paged_mqa_logits_cpu", "_C::topk_transform_512_cpu",
        "_C::fused_indexer_q_rope_quant_cpu", "_C::fused_qnorm_rope_kv_insert_cpu", "_C::compress_norm_rope_store*",
        "_C_cache_ops::*",
    )),
    ("weights", (
        "dsattn::fp8_block_linear", "dsattn::mxfp4_linear",    # dsattn's quantised linears
        # vLLM's CPU GEMMs: oneDNN (dense bf16 / float32 linears, the LM head), its FP8 / int8 / int4 ones, the
        # packed-weight linear
        "_C::onednn_mm", "_C::onednn_scaled_mm", "_C::fp8_scaled_mm*", "_C::int8_scaled_mm*", "_C::int4_scaled_mm_cpu",
        "_C::weight_packed_linear", "_C::cpu_gemm_wna16", "_C::bmm_cpu",
        "aten::linear", "aten::addmm", "aten::mm", "aten::matmul",   # PyTorch's dense linears
    )),
)
SHARES = ("weights", "attention", "MoE", "rest")        # rest: the step's wall time no category claimed


def category(name: str) -> str | None:
    for cat, patterns in CATEGORIES:
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return cat
    return None


def claimed_events(events):
    """(category, event) for each event a category claims: walking each call tree from its root, the first (outermost)
    event on a path whose name is classified is claimed whole (its inclusive CPU time) and what it calls is not looked
    at; an unclassified event is opened.  Why inclusive time of the outermost, not each op's self time: self time would
    count fp8_block_linear's inner copies and the attention op's inner bmm under their own ATen names (rest, or
    weights), and the experts' linears as weights; the outermost event says which layer the time was spent for, and no
    time is counted twice because a claimed event's descendants are never visited.  The time of unclassified events
    outside any claimed one (norms, RoPE, the sampler, the scheduler, Python) is what "rest" gets."""
    stack = [e for e in events if e.cpu_parent is None]
    while stack:
        event = stack.pop()
        cat = category(event.name)
        if cat is not None:
            yield cat, event
        else:
            stack.extend(event.cpu_children)


def split_step(prof, wall_s: float) -> dict:
    """One profiled step: ``{"ms": {share: ms}, "ops": {category: {claimed event's name: ms}}}``; the shares add up
    to the step's wall time (``rest`` = the wall time no category claimed)."""
    ms, ops = defaultdict(float), defaultdict(lambda: defaultdict(float))
    for cat, event in claimed_events(prof.events()):
        ms[cat] += event.cpu_time_total / 1e3
        ops[cat][event.name] += event.cpu_time_total / 1e3
    ms["rest"] = wall_s * 1e3 - sum(ms[c] for c in SHARES if c != "rest")
    return {"ms": {c: ms[c] for c in SHARES}, "ops": {c: dict(names) for c, names in ops.items()}}


def profile_step(step):
    """Run ``step()`` under torch's profiler (CPU activities): (its result, :func:`split_step` of it).  The wall time
    is taken inside the capture, so it includes the profiler's own cost (a few microseconds an op)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        result = step()
        wall = time.perf_counter() - t
    return result, split_step(prof, wall)


def merge_splits(splits: list[dict], top: int = 3) -> dict:
    """Several profiled steps: ``steps``, ``wall_ms`` (all of them), ``share`` (each share's fraction of that wall
    time) and ``top_ops`` (each category's ``top`` largest claimed events: [name, ms a step], largest first)."""
    ms, ops = defaultdict(float), defaultdict(lambda: defaultdict(float))
    for split in splits:
        for share, v in split["ms"].items():
            ms[share] += v
        for cat, names in split["ops"].items():
            for name, v in names.items():
                ops[cat][name] += v / len(splits)
    wall = sum(ms.values())
    return {"steps": len(splits), "wall_ms": wall, "share": {c: ms[c] / wall for c in SHARES},
            "top_ops": {cat: sorted(([n, v] for n, v in names.items()), key=lambda nv: -nv[1])[:top]
                        for cat, names in ops.items()}}


class MoeRanges:
    """Puts the MoE record_function ranges (MOE_*_RANGE) around vLLM's MoE pieces of a loaded model, by instance:
    each router gate (``GateLinear``), and each MoE runner's top-k (``router.select_experts``) and routed experts
    (``routed_experts.forward_modular`` / ``forward_monolithic``).  The shared expert (a dense MLP run beside them) gets
    no range: its linears count as weights.  While ``counting`` is set, the number of distinct experts each top-k
    picks is appended to ``distinct`` (what a step's routed-expert weight reads depend on)."""

    def __init__(self, model: torch.nn.Module):
        self.layers = 0
        self.counting = False
        self.distinct: list[int] = []
        for module in model.modules():
            if type(module).__name__ == "GateLinear":
                self._wrap(module, "forward", MOE_GATE_RANGE)
            router, experts = getattr(module, "router", None), getattr(module, "routed_experts", None)
            if router is not None and experts is not None:
                self.layers += 1
                self._wrap(router, "select_experts", MOE_TOPK_RANGE, self._count)
                self._wrap(experts, "forward_modular", MOE_EXPERTS_RANGE)
                self._wrap(experts, "forward_monolithic", MOE_EXPERTS_RANGE)

    def _count(self, result) -> None:
        if self.counting:
            topk_ids = result[1]
            self.distinct.append(int(topk_ids.unique().numel()))

    @staticmethod
    def _wrap(obj, name: str, label: str, after=None) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            return

        def wrapped(*args, **kwargs):
            with torch.profiler.record_function(label):
                result = fn(*args, **kwargs)
            if after is not None:
                after(result)
            return result
        setattr(obj, name, wrapped)             # on the instance: the class (shared with other models) is untouched


def copy_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """Best of ``repeats`` copies of a ``mib`` MiB tensor with torch's current threads, in GB/s counted as STREAM
    counts a copy (bytes read + bytes written): what this process can stream, to set a decode step's weight reads
    against.  The first copy (page faults of the destination) is not timed."""
    src = torch.ones(mib << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best / 1e9
