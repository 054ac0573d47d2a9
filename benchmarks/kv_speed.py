"""KV-cache dtypes where memory binds: TurboQuant's names against the bf16 cache, every figure from one run.

Rows (the dtypes alternated within each of --repeats rounds; medians; the models' weights widened to bf16, or with
`--weights as-stored` kept as the GGUF file stores them, the engine's default):
- prefill 8k: one 8,000-token prompt on SmolLM2 in the engine's default chunks, so that every chunk after the
  first attends to a compressed prefix: seconds, and the bf16 cache's time over this one's;
- prefill 8k, Gemma 3: the same on Gemma 3 270M (15 of its 18 layers see only their 512-token window);
- batch 16 x 4k: 16 sequences of 4,096 prompt tokens on SmolLM2 decoding together: tok/s over the steps in which
  all of them decode (the first round prefills and is not counted; later rounds hit the prefix cache);
- batch 4 x 16k: the same with 4 sequences of 16,384 tokens on Gemma 3 270M (its global layers read it all);
- one 16k, Gemma 3: one such sequence alone, a single user's long context;
- one short: one sequence of 128 prompt tokens on SmolLM2 (TurboQuant must not cost where memory is plenty).

    python benchmarks/kv_speed.py [--rows "prefill 8k" ...] [--dtypes bfloat16 tq4 tq3 tq2.5] [--repeats 3]
                                  [--weights as-stored] [--threads 1 --clock cpu]
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

import timing
from slipstream import LLM, SamplingParams

# row: (model, sequences, prompt tokens, decode tokens timed)
ROWS = {"prefill 8k": ("smollm2-135m", 1, 8000, 0), "prefill 8k, Gemma 3": ("gemma3-270m", 1, 8000, 0),
        "batch 16 x 4k": ("smollm2-135m", 16, 4096, 32),
        "batch 4 x 16k": ("gemma3-270m", 4, 16384, 32), "one 16k, Gemma 3": ("gemma3-270m", 1, 16384, 32),
        "one short": ("smollm2-135m", 1, 128, 64)}
DTYPES = ["bfloat16", "tq4", "tq3", "tq2.5"]
KV_MEMORY = 2 * 2**30  # the bf16 cache holds 16 x 4k on SmolLM2 and 4 x 16k on Gemma 3
clock = time.perf_counter


def build(row: str, kv_dtype: str, weights: str) -> LLM:
    model, seqs, prompt, decode = ROWS[row]
    return LLM(model, dtype="bfloat16" if weights == "bfloat16" else "auto", kv_cache_dtype=kv_dtype,
               kv_cache_memory=KV_MEMORY, max_num_seqs=seqs, max_model_len=prompt + decode + 16,
               enable_prefix_caching=decode > 0)


def prompts(row: str, seed: int) -> list[list[int]]:
    _, seqs, prompt, _ = ROWS[row]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (prompt,), generator=g).tolist() for _ in range(seqs)]


def prefill_seconds(llm: LLM, row: str, round_: int) -> float:
    """A prompt the cache has not seen (prefix caching is off for this row anyway)."""
    start = clock()
    llm.generate(prompts(row, 1000 + round_), SamplingParams(max_tokens=1), use_tqdm=False)
    return clock() - start


def decode_rate(llm: LLM, row: str, round_: int) -> float:
    """tok/s of the steps in which every sequence decodes (none prefilling, none finished); the same prompts
    every round, so that later rounds find them in the prefix cache and decode in step."""
    seqs, decode = ROWS[row][1], ROWS[row][3]
    engine = llm.engine
    for i, ids in enumerate(prompts(row, 0)):
        engine.add_request(f"{round_}-{i}", ids, SamplingParams(max_tokens=decode, ignore_eos=True))
    tokens, seconds = 0, 0.0
    while engine.has_unfinished_requests():
        start = clock()
        outputs = engine.step()
        if len(outputs) == seqs and all(len(out.outputs[0].token_ids) > 1 for out in outputs):
            tokens, seconds = tokens + seqs, seconds + clock() - start
    return tokens / seconds if tokens else math.nan  # the first round's prefills leave no such step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--dtypes", nargs="*", default=DTYPES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weights", choices=["bfloat16", "as-stored"], default="bfloat16")
    timing.add_arguments(parser)
    args = parser.parse_args()
    global clock
    clock = timing.clock_of(args)
    table = []
    for row in args.rows:
        engines = {dtype: build(row, dtype, args.weights) for dtype in args.dtypes}
        measure = decode_rate if ROWS[row][3] else prefill_seconds
        figures: dict[str, list[float]] = {dtype: [] for dtype in args.dtypes}
        for round_ in range(args.repeats + (measure is decode_rate)):  # decode: a first round to fill the cache
            for dtype, llm in engines.items():
                value = measure(llm, row, round_)
                if measure is prefill_seconds or round_:
                    figures[dtype].append(value)
                print(f"{row} round {round_} {dtype}: {value:.2f}", flush=True)
        del engines
        for dtype, values in figures.items():
            median = statistics.median(values)
            base = statistics.median(figures["bfloat16"]) if "bfloat16" in figures else None
            ratio = None if base is None else (base / median if measure is prefill_seconds else median / base)
            table.append((row, dtype, median, "s" if measure is prefill_seconds else "tok/s", ratio))
    print(f"\n| row | kv_cache_dtype | median of {args.repeats} | vs bf16 cache |\n|---|---|---|---|")
    for row, dtype, median, unit, ratio in table:
        print(f"| {row} | {dtype} | {median:.2f} {unit} | {'' if ratio is None else f'{ratio:.2f}x'} |")


if __name__ == "__main__":
    main()
