"""Synthetic workloads shared by the benchmarks: random and shared-prefix token-id prompts.

Prompts are token ids drawn uniformly from [0, vocab_size), so their lengths are exact
without a tokenizer and any server that accepts token-id prompts can be measured. A
workload depends only on its arguments and seed.
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class SampleRequest:
    prompt: list[int]
    output_len: int


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's --random-range-ratio: lengths uniform in [length * (1 - r), length * (1 + r)]."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio={range_ratio!r} is invalid; it must be in [0, 1)")
    return max(1, round(length * (1 - range_ratio))), max(1, round(length * (1 + range_ratio)))


def random_requests(num: int, vocab_size: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    seed: int = 0) -> list[SampleRequest]:
    """`num` prompts of random tokens, lengths uniform in the given inclusive ranges."""
    _check(num, vocab_size, input_len, output_len)
    rng = random.Random(seed)
    return [SampleRequest(_tokens(rng, vocab_size, rng.randint(*input_len)), rng.randint(*output_len))
            for _ in range(num)]


def shared_prefix_requests(num: int, vocab_size: int, prefix_len: int, num_prefixes: int, input_len: tuple[int, int],
                           output_len: tuple[int, int], seed: int = 0) -> list[SampleRequest]:
    """Prompts = one of `num_prefixes` shared prefixes (round robin) + a random suffix of `input_len` tokens."""
    _check(num, vocab_size, input_len, output_len)
    if prefix_len < 1 or num_prefixes < 1:
        raise ValueError(f"prefix_len={prefix_len} and num_prefixes={num_prefixes} must both be >= 1")
    rng = random.Random(seed)
    prefixes = [_tokens(rng, vocab_size, prefix_len) for _ in range(num_prefixes)]
    return [SampleRequest(prefixes[i % num_prefixes] + _tokens(rng, vocab_size, rng.randint(*input_len)),
                          rng.randint(*output_len)) for i in range(num)]


def _tokens(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def _check(num: int, vocab_size: int, input_len: tuple[int, int], output_len: tuple[int, int]) -> None:
    if num < 1:
        raise ValueError(f"num_prompts={num} must be >= 1")
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    for name, (low, high) in (("input length", input_len), ("output length", output_len)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} range {low}..{high} is invalid; it must satisfy 1 <= low <= high")
