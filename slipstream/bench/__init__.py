"""Benchmarks: `slipstream bench serve | throughput | latency` (workloads shared in workload.py)."""
