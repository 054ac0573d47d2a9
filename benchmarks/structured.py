"""Structured outputs: what a grammar costs the engine, on SmolLM2.

1. Offline throughput: N requests (prompts of random token ids, 32..256 tokens), every one
   generating exactly `--max-tokens` tokens (ignore_eos), once all unconstrained and once
   with half of them constrained by a JSON schema of an unbounded array of objects (so no
   constrained row ends its grammar early, and every step masks along real JSON). The
   ratio of output tokens per second is the figure to read (target >= 0.9x).
2. Grammar compile time: the first grammar (which builds the tokenizer view, once per
   engine), a new schema cold, and the same schema again (the cache).
3. Mask time per step: filling and applying the token bitmask for the constrained rows,
   measured inside the engine during run 1 (median per step and per row).

    python benchmarks/structured.py [--num-prompts 32] [--max-tokens 64] [--dtype float32] [--repeats 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from slipstream import LLM, SamplingParams
from slipstream.structured import StructuredOutputsParams
from slipstream.structured.bitmask import GrammarBitmask

ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"enum": ["red", "green", "blue"]}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "color", "tags"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ITEM}


def workload(num_prompts: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 257, (num_prompts,), generator=g).tolist()
    return [torch.randint(100, vocab, (n,), generator=g).tolist() for n in lengths]


def throughput(llm: LLM, prompts, max_tokens: int, constrained: bool) -> float:
    free = SamplingParams(temperature=0.8, seed=0, max_tokens=max_tokens, ignore_eos=True)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True,
                             structured_outputs={"json": SCHEMA}) if constrained and i % 2 else free
              for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return len(prompts) * max_tokens / elapsed


def compile_times(llm: LLM) -> tuple[float, float, float]:
    """(first grammar, with the tokenizer view it builds once; a new schema; the same again) in seconds."""
    compiler = llm.engine.grammars

    def timed(spec: StructuredOutputsParams) -> float:
        start = time.perf_counter()
        compiler.submit(spec).result()
        return time.perf_counter() - start

    first = timed(StructuredOutputsParams(json=ITEM))
    spec = StructuredOutputsParams(json=SCHEMA)
    return first, timed(spec), timed(spec)


class TimedMask:
    """The engine's grammar processor, timing each call that has constrained rows."""

    def __init__(self, inner: GrammarBitmask):
        self.inner = inner
        self.times: list[tuple[float, int]] = []  # (seconds, constrained rows)

    def __call__(self, logits, meta) -> None:
        rows = sum(g is not None for g in meta.grammars or ())
        start = time.perf_counter()
        self.inner(logits, meta)
        if rows:
            self.times.append((time.perf_counter() - start, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternating; the best counts")
    args = parser.parse_args()
    llm = LLM("smollm2-135m", dtype=args.dtype, kv_cache_memory=256 * 2**20)
    first, cold, cached = compile_times(llm)
    processors = llm.engine.runner.sampler.processors
    processors[0] = timed = TimedMask(processors[0])
    prompts = workload(args.num_prompts, llm.engine.model_config.vocab_size)
    throughput(llm, prompts[:2], 4, constrained=True)  # warm-up: kernels, the schema's compiled grammar
    timed.times.clear()
    runs = {False: [], True: []}
    for _ in range(args.repeats):  # alternating, so a change in the machine's load hits both alike
        for constrained in (False, True):
            runs[constrained].append(throughput(llm, prompts, args.max_tokens, constrained))
    free, constrained = max(runs[False]), max(runs[True])
    per_step = statistics.median(t for t, _ in timed.times)
    per_row = statistics.median(t / n for t, n in timed.times)
    print(f"{args.num_prompts} requests x {args.max_tokens} tokens, {args.dtype}, half JSON-schema constrained, "
          f"best of {args.repeats}")
    print(f"  unconstrained    {free:8.1f} out tok/s")
    print(f"  half constrained {constrained:8.1f} out tok/s   ratio {constrained / free:.3f}x")
    print(f"grammar compile: first (with the tokenizer view) {first * 1e3:.0f} ms, a new schema cold "
          f"{cold * 1e3:.1f} ms, cached {cached * 1e6:.0f} us")
    print(f"mask per step: median {per_step * 1e3:.2f} ms for {statistics.median(n for _, n in timed.times):.0f} "
          f"rows, {per_row * 1e6:.0f} us per row")


if __name__ == "__main__":
    main()
