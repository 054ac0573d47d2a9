"""Passkey retrieval swept over depth and context length, each kv_cache_dtype against the bf16 cache.

The haystack is license text that the project neither ships nor calibrates on (benchmarks/
kv_defaults.py's prose, read at run time); a sentence stating a five-digit key is put at each
depth, and the prompt ends by asking for it. A hit is the key in the greedy answer; each cell's margin is
the answer's first token's log-probability less the best other token's there (below 0, the greedy answer
starts otherwise: how near a cell is to flipping, for the bf16 cache as for the others). SmolLM2 (or
--model gemma3-270m, for its 32k context give --lengths) in bf16 with prefix caching on: prompts
of one sweep share the haystack before their needle, so each is prefilled from its needle on (in
1,024-token chunks, attention reading the cache).

    python benchmarks/kv_passkey.py [--lengths 1024 2048 4096 8000] [--depths 10] [--rows bfloat16 tq4 tq3 tq2.5]
                                    [--model smollm2-135m]
"""
from __future__ import annotations

import argparse
import time

from kv_defaults import prose
from slipstream import LLM, SamplingParams

QUESTION = "\n\nWhat is the pass key? The pass key is"
TOP = 20  # log-probabilities kept at the answer's first position


def needle(key: str) -> str:
    return f"\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"


def prompts(tokenizer, lengths: list[int], depths: int) -> list[tuple[int, float, str, int, list[int]]]:
    """(length, depth, key, the answer's first token, token ids) for every cell; depths from 0.05 to 0.95."""
    haystack = tokenizer(prose()).input_ids
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids  # Gemma's BOS only at the start
    cells = []
    for length in lengths:
        for d in range(depths):
            depth = (d + 0.5) / depths
            key = str(10000 + (7919 * (length + d)) % 90000)
            inserted = tokenizer(needle(key), add_special_tokens=False).input_ids
            body = haystack[:length - len(inserted) - len(question)]
            at = int(len(body) * depth)
            first = tokenizer(f" {key}", add_special_tokens=False).input_ids[0]
            cells.append((length, depth, key, first, body[:at] + inserted + body[at:] + question))
    return cells


def sweep(model: str, kv_dtype: str, cells, memory: int) -> dict[tuple[int, float], tuple[bool, float]]:
    """(hit, margin) per (length, depth)."""
    longest = max(len(ids) for *_, ids in cells)
    llm = LLM(model, kv_cache_dtype=kv_dtype, max_model_len=longest + 16, kv_cache_memory=memory,
              max_num_seqs=1, max_num_batched_tokens=1024)
    hits = {}
    for length, depth, key, first, ids in cells:
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, logprobs=TOP), use_tqdm=False)[0]
        hits[length, depth] = key in out.outputs[0].text, margin(out.outputs[0].logprobs[0], first)
    return hits


def margin(logprobs: dict, first: int) -> float:
    """`first`'s log-probability less the best other token's; outside the top TOP it counts as the last of
    them (so the margin is at most that)."""
    others = max(lp.logprob for token, lp in logprobs.items() if token != first)
    own = logprobs[first].logprob if first in logprobs else min(lp.logprob for lp in logprobs.values())
    return own - others


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[1024, 2048, 4096, 8000])
    parser.add_argument("--depths", type=int, default=10)
    parser.add_argument("--rows", nargs="*", default=["bfloat16", "tq4", "tq3", "tq2.5"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--memory", type=int, default=2**30, help="kv_cache_memory (bytes)")
    args = parser.parse_args()
    tokenizer = LLM(args.model, kv_cache_memory=2**22).get_tokenizer()
    cells = prompts(tokenizer, args.lengths, args.depths)
    results = {}
    for row in args.rows:
        start = time.monotonic()
        results[row] = sweep(args.model, row, cells, args.memory)
        found = sum(hit for hit, _ in results[row].values())
        print(f"{row}: {found}/{len(cells)} ({time.monotonic() - start:.0f} s)", flush=True)
    print_hits(results, args.lengths, args.depths)
    print_margins(results, args.lengths, args.depths)


def print_hits(results: dict, lengths: list[int], depths: int) -> None:
    print("\n| kv_cache_dtype | " + " | ".join(f"{n} tokens" for n in lengths) + " | all | misses (length, depth) |")
    print("|---|" + "---|" * (len(lengths) + 2))
    for row, cells in results.items():
        per_length = [sum(hit for (n, _), (hit, _) in cells.items() if n == length) for length in lengths]
        misses = [f"({n}, {d:.2f})" for (n, d), (hit, _) in cells.items() if not hit]
        print(f"| {row} | " + " | ".join(f"{h}/{depths}" for h in per_length)
              + f" | {sum(per_length)}/{len(cells)} | {' '.join(misses) or '-'} |")


def print_margins(results: dict, lengths: list[int], depths: int) -> None:
    print("\nThe answer's first-token margin (nats; below 0 the greedy answer starts otherwise), by depth:\n")
    print("| kv_cache_dtype | length | " + " | ".join(f"{(d + 0.5) / depths:.2f}" for d in range(depths)) + " |")
    print("|---|---|" + "---|" * depths)
    for row, cells in results.items():
        for length in lengths:
            margins = [m for (n, _), (_, m) in cells.items() if n == length]
            print(f"| {row} | {length} | " + " | ".join(f"{m:+.2f}" for m in margins) + " |")


if __name__ == "__main__":
    main()
