"""Speculative decoding (n-gram, or a draft model) on SmolLM2: tokens/s with and without, in one run, alternated.

Workloads, greedy, chat template:
- grounded: "repeat this code" over Python standard-library source read at run time
  (inspect.getsource), which the repo does not ship: the output copies its input;
- open-ended: short essays on random topics: little to copy.
Each at a single stream and at batch 8. Two engines (same weights, same cache size) run
each workload in turn, --repeats times, plain and speculative alternated; the figures are
medians of output tokens / wall time and / process CPU time (the CPU time is less disturbed
by other processes on a shared machine), their ratios, and the acceptance.

    python benchmarks/speculative.py [--num-speculative-tokens 4] [--max-tokens 128] [--repeats 3]
    python benchmarks/speculative.py --draft-model smollm2-135m --draft-quantization int4  # the model's int4 copy

--measure-cost instead measures the Speculator's VERIFY_COST: process CPU time per step with 1 to 4
drafts per row that are always rejected (one token per step, like a plain decode) over a plain
decode step, at 1 to 16 decoding rows of --cost-context prompt tokens each.
"""
from __future__ import annotations

import argparse
import inspect
import random
import statistics
import time

import torch

from slipstream import LLM, SamplingParams
from slipstream.speculative.ngram import StatelessProposer

MODULES = ["textwrap", "shlex", "bisect", "heapq", "colorsys", "fnmatch", "queue", "glob"]
TOPICS = ["lighthouses", "bread baking", "volcanoes", "chess openings", "honeybees", "city parks", "old maps",
          "rain forests", "jazz", "bicycles", "tea", "glaciers", "comets", "libraries", "trains", "coral reefs"]


def grounded(n: int, chars: int) -> list[list[dict]]:
    prompts = []
    for name in MODULES[:n]:
        source = inspect.getsource(__import__(name))
        start = source.find("\ndef ")  # the first function: code, not the module docstring
        code = source[start + 1:start + 1 + chars]
        prompts.append([{"role": "user", "content": f"Repeat this Python code exactly:\n\n{code}"}])
    return prompts


def open_ended(n: int, seed: int) -> list[list[dict]]:
    topics = random.Random(seed).sample(TOPICS, n)
    return [[{"role": "user", "content": f"Write a short essay about {t}."}] for t in topics]


def run(llm: LLM, prompts, max_tokens: int) -> tuple[float, float, int, list]:
    """(wall seconds, process CPU seconds, output tokens, outputs) of one chat call."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    wall, cpu = time.perf_counter(), time.process_time()
    outs = llm.chat(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, sum(len(o.outputs[0].token_ids) for o in outs), outs


class Rejected(StatelessProposer):
    """`drafts` drafts of token 0 (<|endoftext|>), which greedy text here never produces."""

    drafts = 4

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        return [0] * min(k, self.drafts)


def measure_cost(engines: dict[str, LLM], repeats: int, context: int) -> None:
    """The Speculator's VERIFY_COST: process CPU time of steps whose rows each verify 1-4 rejected drafts
    (one token per step, as a plain decode) over plain decode steps, at 1 to 16 rows of `context` tokens."""
    from slipstream.speculative import speculator
    speculator.VERIFY_COST = ((10**6, (0.0,) * 4),)  # verification free: every step verifies every draft
    engines["spec"].engine.speculator.proposer = proposer = Rejected()
    params = SamplingParams(temperature=0, max_tokens=41, ignore_eos=True)
    for batch in (1, 2, 4, 8, 16):
        prompts = [[100 + (i * 31 + 7 * b) % 40000 for i in range(context)] for b in range(batch)]
        for llm in engines.values():
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # prompts cached
        costs = []
        for proposer.drafts in range(1, 5):
            ratios = []
            for _ in range(repeats):
                cpu = {}
                for key, llm in engines.items():
                    start = time.process_time()
                    llm.generate(prompts, params, use_tqdm=False)
                    cpu[key] = time.process_time() - start
                ratios.append(cpu["spec"] / cpu["plain"])
            costs.append(statistics.median(ratios))
        print(f"({batch}, ({', '.join(f'{c:.2f}' for c in costs)})),  # 1-4 drafts per row", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--code-chars", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--draft-model", default=None,
                        help="speculate with this draft model (method draft_model) instead of n-gram lookup")
    parser.add_argument("--draft-quantization", default=None, help="the draft's weights, e.g. int4 (a copy of the target)")
    parser.add_argument("--measure-cost", action="store_true")
    parser.add_argument("--cost-context", type=int, default=256, help="prompt tokens of each row (--measure-cost)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    if args.draft_model:
        spec = {"method": "draft_model", "model": args.draft_model, "quantization": args.draft_quantization,
                "num_speculative_tokens": args.num_speculative_tokens}
    memory = (256 if args.measure_cost else 64) * 2**20  # measuring: 16 rows of 256 tokens and their drafts fit
    engines = {"plain": LLM(args.model, kv_cache_memory=memory),
               "spec": LLM(args.model, kv_cache_memory=memory, speculative_config=spec)}
    print(f"{args.model}, {torch.get_num_threads()} threads, greedy, max_tokens {args.max_tokens}, {spec}")
    if args.measure_cost:
        return measure_cost(engines, args.repeats, args.cost_context)
    print(f"| workload | batch | plain tok/s (wall / CPU) | {spec['method']} tok/s (wall / CPU) | ratio wall | ratio CPU "
          "| acceptance | mean accepted length | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, make in (("grounded", lambda n: grounded(n, args.code_chars)), ("open-ended", lambda n: open_ended(n, 0))):
        for batch in (1, 8):
            prompts = make(batch)
            for llm in engines.values():
                run(llm, prompts, 8)  # warm-up: kernels, caches
            rates = {k: ([], []) for k in engines}
            outs = {}
            for _ in range(args.repeats):
                for key, llm in engines.items():
                    wall, cpu, tokens, outs[key] = run(llm, prompts, args.max_tokens)
                    rates[key][0].append(tokens / wall)
                    rates[key][1].append(tokens / cpu)
            med = {k: (statistics.median(w), statistics.median(c)) for k, (w, c) in rates.items()}
            m = [o.metrics for o in outs["spec"]]
            drafts, draft_tokens = sum(x.num_drafts for x in m), sum(x.num_draft_tokens for x in m)
            accepted = sum(x.num_accepted_tokens for x in m)
            same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs["plain"], outs["spec"]))
            print(f"| {name} | {batch} | {med['plain'][0]:.1f} / {med['plain'][1]:.1f} | {med['spec'][0]:.1f} / "
                  f"{med['spec'][1]:.1f} | {med['spec'][0] / med['plain'][0]:.2f}x | "
                  f"{med['spec'][1] / med['plain'][1]:.2f}x | "
                  f"{accepted / draft_tokens if draft_tokens else 0:.0%} | "
                  f"{1 + accepted / drafts if drafts else 1:.2f} | {same}/{batch} |", flush=True)


if __name__ == "__main__":
    main()
