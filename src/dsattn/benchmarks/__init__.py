"""Benchmarks behind ``dsattn bench`` and the scripts in ``bench/`` (issue: CPU performance).

Every run first measures this machine's ceilings in the same process (bf16 and fp32 GEMM
GFLOP/s, copy bandwidth), then times each workload's variants side by side and reports
ratios against those ceilings and against each other.  FLOPs count only visible keys:
``2·N1·keys·(D_qk + D_v)`` per query row for the attention forward.
"""
