"""`slipstream bench latency`: TTFT at a prompt length, and TPOT at a batch size, offline.

TTFT: one request of --input-len prompt tokens alone in the engine, until its first token.
TPOT: --batch-size requests of --input-len prompt tokens and --output-len output tokens
(ignore_eos) submitted together; each request's mean time per output token after the
first. Every iteration uses fresh random prompts, so the prefix cache never helps, and
the first --num-iters-warmup iterations are not counted. Times come from the engine's
per-request metrics (RequestOutput.metrics).
"""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from slipstream.bench.workload import random_requests
from slipstream.config import EngineConfig


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace, config: EngineConfig) -> dict:
    from slipstream import LLM, SamplingParams

    if args.output_len < 2:
        raise ValueError(f"--output-len={args.output_len} must be >= 2 to measure TPOT")
    llm = LLM(**dataclasses.asdict(config))
    vocab = llm.engine.model_config.vocab_size

    def prompts(n: int, iteration: int) -> list[list[int]]:
        lengths = (args.input_len, args.input_len)
        return [r.prompt for r in random_requests(n, vocab, lengths, (1, 1), seed=args.seed * 7919 + iteration)]

    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    decode = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    ttfts, tpots = [], []
    for i in range(args.num_iters_warmup + args.num_iters):
        ttft = llm.generate(prompts(1, 2 * i), first, use_tqdm=False)[0].metrics.ttft
        batch = llm.generate(prompts(args.batch_size, 2 * i + 1), decode, use_tqdm=False)
        if i >= args.num_iters_warmup:
            ttfts.append(ttft)
            tpots.extend(o.metrics.tpot for o in batch)
    result = {"input_len": args.input_len, "output_len": args.output_len, "batch_size": args.batch_size,
              **_stats("ttft", ttfts), **_stats("tpot", tpots)}
    print(f"TTFT, prompt of {args.input_len} tokens, alone: "
          + _line(result, "ttft"))
    print(f"TPOT, batch of {args.batch_size} (prompt {args.input_len}, output {args.output_len}): "
          + _line(result, "tpot") + f" -> {args.batch_size / (result['mean_tpot_ms'] / 1000):.1f} output tok/s")
    return result


def _stats(name: str, seconds: list[float]) -> dict:
    ms = np.array(seconds) * 1000
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"p90_{name}_ms": float(np.percentile(ms, 90)), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def _line(result: dict, name: str) -> str:
    return ", ".join(f"{k} {result[f'{k}_{name}_ms']:.1f} ms" for k in ("mean", "median", "p90", "p99"))
