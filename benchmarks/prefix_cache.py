"""Prefix caching and KV memory efficiency, measured on the real engine.

1. Shared prefix: 64 requests share a 1,024-token system prompt, each with its own 64-token
   suffix. TTFT of the first (cold) request vs the median of the rest (each sent alone
   after it, so no queueing is counted), and the whole workload submitted at once with
   prefix caching on vs off.
2. KV memory: the offline throughput workload (prompts 32..512, outputs 32..256) at block
   sizes 8, 16, 32: average internal fragmentation of paged allocation, against what a
   contiguous `max_model_len` reservation per running request would waste.
Draws KV usage over time and a per-request block map (shared blocks marked) to a PNG.

    python benchmarks/prefix_cache.py [--num-requests 64] [--out benchmarks/out]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from slipstream import SamplingParams
from slipstream.config import EngineConfig
from slipstream.engine.engine import LLMEngine
from throughput import workload


def shared_prefix_prompts(n: int, prefix_len: int, suffix_len: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(100, vocab, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(100, vocab, (suffix_len,), generator=g).tolist() for _ in range(n)]


def run_all(engine: LLMEngine, prompts, params, trace=None) -> dict[str, object]:
    """Submit everything at once, step to completion; optionally record stats per step."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", p, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        if trace is not None:
            trace.append(_snapshot(engine))
    return outputs


def _snapshot(engine: LLMEngine) -> dict:
    stats = engine.stats()
    running = engine.scheduler.running
    stats["time"] = time.monotonic()
    stats["tokens_held"] = sum(s.num_computed_tokens for s in running)
    stats["num_running"] = len(running)
    stats["tables"] = [list(s.block_table) for s in running]
    stats["refs"] = {b: engine.block_manager.blocks[b].ref_count for t in stats["tables"] for b in t}
    return stats


def ttft_cold_warm(engine: LLMEngine, prompts, params) -> tuple[float, list[float]]:
    ttfts = []
    for p in prompts:
        out = next(iter(run_all(engine, [p], params).values()))
        ttfts.append(out.metrics.ttft)
    return ttfts[0], ttfts[1:]


def shared_prefix(model: str, dtype: str, n: int, out_dir: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    results = {}
    for caching in (True, False):
        engine = LLMEngine(EngineConfig.from_kwargs(model=model, dtype=dtype, enable_prefix_caching=caching))
        prompts = shared_prefix_prompts(n, 1024, 64, engine.model_config.vocab_size)
        run_all(engine, [prompts[0][:40]], params)  # warm-up on an unrelated prompt
        if caching:
            cold, warm = ttft_cold_warm(engine, prompts[: min(n, 9)], params)
            print(f"TTFT cold {cold * 1000:.0f} ms, warm median {statistics.median(warm) * 1000:.0f} ms "
                  f"-> {cold / statistics.median(warm):.1f}x")
            engine = LLMEngine(EngineConfig.from_kwargs(model=model, dtype=dtype, enable_prefix_caching=True))
        trace = []
        start = time.monotonic()
        run_all(engine, prompts, params, trace)
        results[caching] = time.monotonic() - start
        stats = engine.stats()
        print(f"prefix caching {'on ' if caching else 'off'}: {n} requests in {results[caching]:.1f} s, "
              f"hit rate {100 * stats['prefix_cache_hit_rate']:.1f}%")
        if caching:
            plot_run(trace, engine.block_manager.num_blocks, os.path.join(out_dir, "prefix_cache.png"))
    print(f"shared-prefix workload, caching on vs off: {results[False] / results[True]:.1f}x faster")


def fragmentation(model: str, dtype: str, num_prompts: int) -> None:
    prompts, output_lens = workload(num_prompts, 49152)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    for block_size in (8, 16, 32):
        engine = LLMEngine(EngineConfig.from_kwargs(model=model, dtype=dtype, block_size=block_size,
                                                    max_num_batched_tokens=2048))
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, sp)
        paged, contiguous = [], []
        while engine.has_unfinished_requests():
            engine.step()
            s = _snapshot(engine)
            if s["num_running"]:
                paged.append(s["fragmentation"])
                contiguous.append(1 - s["tokens_held"] / (s["num_running"] * engine.max_model_len))
        print(f"block size {block_size:2d}: paged fragmentation {100 * statistics.mean(paged):.2f}% "
              f"vs contiguous max_model_len ({engine.max_model_len}) reservation {100 * statistics.mean(contiguous):.1f}% wasted")


def plot_run(trace: list[dict], num_blocks: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = trace[0]["time"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    ax1.plot([s["time"] - t0 for s in trace], [100 * s["kv_cache_usage"] for s in trace])
    ax1.set(xlabel="time (s)", ylabel="KV blocks in use (%)", title="KV cache usage, shared-prefix workload")
    snap = max(trace, key=lambda s: s["num_running"])
    for row, table in enumerate(snap["tables"]):
        colors = ["tab:orange" if snap["refs"][b] > 1 else "tab:blue" for b in table]
        ax2.scatter(table, [row] * len(table), c=colors, s=4, marker="s")
    ax2.set(xlabel=f"physical block id (of {num_blocks})", ylabel="running request",
            title="block map at peak concurrency (orange = shared)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=32, help="offline workload size for fragmentation")
    parser.add_argument("--out", default="benchmarks/out")
    args = parser.parse_args()
    print(f"model {args.model}, dtype {args.dtype}, {torch.get_num_threads()} threads")
    shared_prefix(args.model, args.dtype, args.num_requests, args.out)
    fragmentation(args.model, args.dtype, args.num_prompts)


if __name__ == "__main__":
    main()
