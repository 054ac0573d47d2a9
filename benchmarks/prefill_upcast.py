"""512-token prefill on SmolLM2 (bf16) with large GEMMs in bf16 vs upcast to fp32.

A/B in one process: the same engine alternates `backends.cpu.linear.UPCAST_MIN_ROWS` between
"never" and its default, five times, and prints medians and the ratio.

    python benchmarks/prefill_upcast.py
"""
from __future__ import annotations

import statistics
import time

import torch

import slipstream.backends.cpu.linear as linear
from slipstream import LLM, SamplingParams


def main() -> None:
    llm = LLM("smollm2-135m", dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=1024)
    prompt = torch.randint(100, 49152, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=1)

    def prefill() -> float:
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    default = linear.UPCAST_MIN_ROWS
    prefill()  # warm-up
    times = {"bf16 GEMM": [], "fp32 upcast": []}
    for _ in range(5):
        linear.UPCAST_MIN_ROWS = 10**9
        times["bf16 GEMM"].append(prefill())
        linear.UPCAST_MIN_ROWS = default
        times["fp32 upcast"].append(prefill())
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:12s} 512-token prefill: median {median * 1000:.0f} ms = {512 / median:.0f} tok/s")
    ratio = statistics.median(times["bf16 GEMM"]) / statistics.median(times["fp32 upcast"])
    print(f"upcast / bf16 speed: {ratio:.2f}x ({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
