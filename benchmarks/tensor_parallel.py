"""Tensor parallelism on one CPU: TP=1 with T threads against TP=2 with T/2 threads per rank.

The same model (default: the bundled SmolLM2-135M, bf16), the same workload, each
configuration in its own process (a rank sets torch's thread count for its whole process),
runs alternated and repeated; the table gives medians and the last line TP=2 / TP=1.

- decode, batch B: B sequences of a short prompt; after their prefill step, the steps until
  all have N tokens are timed (tok/s = B * N / that time);
- all-reduce: on rank 0, the time inside the all-reduces and all-gathers per decode step
  (shared memory, or gloo; waiting for the other rank included: what a step pays for the
  split), and the bytes one step all-reduces: 2 x layers x B x hidden x the activation
  dtype's size; broadcast: the time rank 0 spends sending the step's inputs (gloo).

TP=1 runs the fused native decode stack where the backend has one; TP=2 cannot (every layer
needs its all-reduces), so the ratio includes that.

`--moe` runs benchmarks/moe.py's synthetic Mixtral (8 experts, top-2) and adds TP=2 with
expert parallelism (4 whole experts per rank) beside TP=2 inside the experts.

    python benchmarks/tensor_parallel.py [--model smollm2-135m | --moe] [--threads 2] [--batches 1 16]
                                         [--decode-tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

clock = time.perf_counter


def child(args: argparse.Namespace) -> None:
    from slipstream import LLM, SamplingParams
    from slipstream.distributed.parallel_state import group

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, tensor_parallel_size=args.tp, max_num_seqs=max(args.batches), enable_prefix_caching=False,
              enable_expert_parallel=args.expert_parallel)
    engine, spent = llm.engine, {"comm": 0.0, "broadcast": 0.0}
    shm = group().shm
    for owner, name, key in ((dist, "all_reduce", "comm"), (dist, "all_gather", "comm"), (dist, "broadcast", "broadcast"),
                             (shm, "all_reduce", "comm"), (shm, "all_gather", "comm")):
        if owner is not None:
            setattr(owner, name, _timed(getattr(owner, name), spent, key))
    config = engine.model_config
    results = {}
    for batch in args.batches:
        params = SamplingParams(temperature=0, max_tokens=args.decode_tokens + 1, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"{batch}-{i}", [1 + (i * 7 + j) % 1000 for j in range(16)], params)
        engine.step()  # every prefill
        spent.update(comm=0.0, broadcast=0.0)
        steps, start = 0, clock()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        elapsed = clock() - start
        results[batch] = {"tok_s": batch * args.decode_tokens / elapsed, "comm_ms": 1e3 * spent["comm"] / steps,
                          "broadcast_ms": 1e3 * spent["broadcast"] / steps, "step_ms": 1e3 * elapsed / steps,
                          "bytes": 2 * config.num_hidden_layers * batch * config.hidden_size * engine.dtype.itemsize}
    print("RESULT", json.dumps(results), flush=True)
    engine.shutdown()


def _timed(fn, spent: dict[str, float], key: str):
    def timed(*a, **k):
        start = clock()
        try:
            return fn(*a, **k)
        finally:
            spent[key] += clock() - start
    return timed


# name -> (ranks, experts split by expert); expert parallelism only for --moe
CONFIGS = {"TP=1": (1, False), "TP=2": (2, False), "TP=2 EP": (2, True)}


def run(args: argparse.Namespace, name: str) -> dict:
    tp, expert_parallel = CONFIGS[name]
    threads = args.threads if tp == 1 else max(1, args.threads // tp)
    cmd = [sys.executable, __file__, "--child", "--tp", str(tp), "--threads", str(threads), "--model", args.model,
           "--decode-tokens", str(args.decode_tokens), "--batches", *map(str, args.batches)]
    out = subprocess.run(cmd + ["--expert-parallel"] * expert_parallel, capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("RESULT"))
    return {int(b): r for b, r in json.loads(line.split(" ", 1)[1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--moe", action="store_true",
                        help="benchmarks/moe.py's synthetic Mixtral instead of --model, and TP=2 with expert parallelism")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--expert-parallel", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.moe:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from moe import build_checkpoint

            build_checkpoint(tmp, 8)
            args.model = tmp
        names = list(CONFIGS) if args.moe else ["TP=1", "TP=2"]
        runs = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                runs[name].append(run(args, name))
    print(f"{'synthetic Mixtral (benchmarks/moe.py)' if args.moe else args.model}, {args.threads} threads in all, "
          f"{args.decode_tokens} decode tokens, median of {args.repeats}")
    print("batch  config   tok/s    ms/step  all-reduce ms/step  broadcast ms/step  bytes all-reduced/step")
    keys = ("tok_s", "step_ms", "comm_ms", "broadcast_ms")
    for batch in args.batches:
        med = {name: {k: statistics.median(r[batch][k] for r in runs[name]) for k in keys} for name in names}
        for name in names:
            m = med[name]
            print(f"{batch:5d}  {name:7s}  {m['tok_s']:7.1f}  {m['step_ms']:7.2f}  {m['comm_ms']:18.2f}  "
                  f"{m['broadcast_ms']:17.2f}  {runs[name][0][batch]['bytes'] if name != 'TP=1' else 0:>22,}")
        print(f"batch {batch}: " + ", ".join(f"{name} / TP=1 decode {med[name]['tok_s'] / med['TP=1']['tok_s']:.2f}x"
                                             for name in names[1:]))


if __name__ == "__main__":
    main()
