"""How many 8k-token sequences one kv_cache_memory serves at once, per kv_cache_dtype, counted by the engine.

For each dtype: SmolLM2 (bf16) with `--memory` bytes of KV cache and room for 64 sequences in the scheduler
gets `--requests` requests at once, each a distinct 7,936-token prompt asking for 256 tokens (8,192 in all),
and runs until all have answered. Counted after every step: how many running sequences hold their whole context in the cache
(every token but the one just sampled); the table gives the most, the preemptions (sequences the scheduler admitted and
then sent back for want of blocks). Not arithmetic: staging, block rounding and the scheduler's
admission are all in the count.

    python benchmarks/kv_capacity.py [--memory 536870912] [--requests 16] [--dtypes bfloat16 tq4 tq3 tq2.5]
"""
from __future__ import annotations

import argparse

import torch

from slipstream import LLM, SamplingParams

# 8,192 in all, SmolLM2's context; outputs long enough that the first sequences still decode when the last
# prompt is in (with 64 tokens they finished first, and the count measured throughput, not memory)
PROMPT, OUTPUT = 7936, 256


def capacity(dtype: str, memory: int, requests: int) -> tuple[int, int]:
    """(most sequences holding their whole context at once, preemptions)."""
    llm = LLM("smollm2-135m", dtype="bfloat16", kv_cache_dtype=dtype, kv_cache_memory=memory, max_num_seqs=64,
              max_model_len=PROMPT + OUTPUT)
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    for i in range(requests):
        engine.add_request(str(i), torch.randint(100, 40000, (PROMPT,), generator=g).tolist(),
                           SamplingParams(max_tokens=OUTPUT, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()  # then: the running sequences whose every token but the newest has K/V in the cache
        most = max(most, sum(seq.num_uncomputed_tokens == 1 for seq in engine.scheduler.running))
    return most, llm.stats()["num_preemptions"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory", type=int, default=512 * 2**20, help="kv_cache_memory in bytes")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "tq4", "tq3", "tq2.5"])
    args = parser.parse_args()
    rows = []
    for dtype in args.dtypes:
        rows.append((dtype, *capacity(dtype, args.memory, args.requests)))
        print(f"{dtype}: {rows[-1][1]} at once, {rows[-1][2]} preemptions", flush=True)
    base = rows[0][1] if rows[0][0] == "bfloat16" else None
    print(f"\n| kv_cache_dtype | 8k-token sequences in the cache at once, {args.memory / 2**20:.0f} MiB | vs bf16 | "
          f"preemptions of {args.requests} requests |\n|---|---|---|---|")
    for dtype, most, preempted in rows:
        print(f"| {dtype} | {most} | {f'{most / base:.1f}x' if base else ''} | {preempted} |")


if __name__ == "__main__":
    main()
