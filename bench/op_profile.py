"""Where the time goes: torch.profiler tables of the default attention path on a decode step
(V4-Flash CSA, B 32) and a 2K-token CSA prefill, and of the gradient on a 1K-token step.

    .venv/bin/python bench/op_profile.py
"""
import torch

from dsattn import ops
from dsattn.benchmarks import workloads


def show(title, fn, rows=10):
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    print(f"\n### {title}\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main():
    q, kw, _, _ = workloads.decode()
    show("decode CSA V4-Flash B32 (default path)", lambda: ops.sparse_flash_mla(q, **kw))
    q, kw, _ = workloads.prefill(2048)
    show("prefill CSA 2K (default path)", lambda: ops.sparse_flash_mla(q, **kw))
    q, kw, _ = workloads.prefill(1024)
    o, lse = ops.sparse_flash_mla(q, return_softmax_lse=True, **kw)
    dout = torch.randn(q.shape, dtype=q.dtype)
    show("sparse_flash_mla_grad CSA 1K", lambda: ops.sparse_flash_mla_grad(q, dout, o, lse, **kw))


if __name__ == "__main__":
    main()
