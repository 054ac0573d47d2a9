"""`slipstream bench throughput`: offline throughput of LLM.generate on a random workload.

N requests with random token-id prompts (lengths uniform in --min/max-input-len) and output
lengths uniform in --min/max-output-len, with ignore_eos so each generates exactly its
length, all submitted at once. Reports requests/s, output tokens/s and total (prompt +
output) tokens/s over the wall time of generate().
"""
from __future__ import annotations

import argparse
import dataclasses
import time

from slipstream.bench.workload import random_requests
from slipstream.config import EngineConfig


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-input-len", type=int, default=32)
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--min-output-len", type=int, default=32)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace, config: EngineConfig) -> dict:
    from slipstream import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(config))
    requests = random_requests(args.num_prompts, llm.engine.model_config.vocab_size,
                               (args.min_input_len, args.max_input_len), (args.min_output_len, args.max_output_len),
                               args.seed)
    params = [SamplingParams(temperature=args.temperature, max_tokens=r.output_len, ignore_eos=True, seed=args.seed + i)
              for i, r in enumerate(requests)]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(r.prompt) for r in requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"elapsed_time": elapsed, "num_requests": len(requests), "prompt_tokens": prompt_tokens,
              "output_tokens": output_tokens, "requests_per_second": len(requests) / elapsed,
              "output_tokens_per_second": output_tokens / elapsed,
              "total_tokens_per_second": (prompt_tokens + output_tokens) / elapsed}
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['output_tokens_per_second']:.1f} output tokens/s, "
          f"{result['total_tokens_per_second']:.1f} total tokens/s "
          f"({len(requests)} requests, {prompt_tokens} prompt + {output_tokens} output tokens in {elapsed:.1f} s)")
    return result
