"""Passkey retrieval swept over depth and context length, each kv_cache_dtype against the bf16 cache.

The haystack is license text that the project neither ships nor calibrates on (benchmarks/
kv_defaults.py's prose, read at run time); a sentence stating a five-digit key is put at each
depth, and the prompt ends by asking for it. A hit is the key in the greedy answer. SmolLM2 (or
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


def needle(key: str) -> str:
    return f"\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"


def prompts(tokenizer, lengths: list[int], depths: int) -> list[tuple[int, float, str, list[int]]]:
    """(length, depth, key, token ids) for every cell of the sweep; depths from 0.05 to 0.95."""
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
            cells.append((length, depth, key, body[:at] + inserted + body[at:] + question))
    return cells


def sweep(model: str, kv_dtype: str, cells, memory: int) -> dict[tuple[int, float], bool]:
    longest = max(len(ids) for *_, ids in cells)
    llm = LLM(model, kv_cache_dtype=kv_dtype, max_model_len=longest + 16, kv_cache_memory=memory,
              max_num_seqs=1, max_num_batched_tokens=1024)
    hits = {}
    for length, depth, key, ids in cells:
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        hits[length, depth] = key in out.outputs[0].text
    return hits


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
        print(f"{row}: {sum(results[row].values())}/{len(cells)} ({time.monotonic() - start:.0f} s)", flush=True)
    print("\n| kv_cache_dtype | " + " | ".join(f"{n} tokens" for n in args.lengths) + " | all | misses (length, depth) |")
    print("|---|" + "---|" * (len(args.lengths) + 2))
    for row, hits in results.items():
        per_length = [sum(hit for (n, _), hit in hits.items() if n == length) for length in args.lengths]
        misses = [f"({n}, {d:.2f})" for (n, d), hit in hits.items() if not hit]
        print(f"| {row} | " + " | ".join(f"{h}/{args.depths}" for h in per_length)
              + f" | {sum(per_length)}/{len(hits)} | {' '.join(misses) or '-'} |")


if __name__ == "__main__":
    main()
