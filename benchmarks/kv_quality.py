"""KV-cache dtypes on SmolLM2: memory, quality and speed, every figure from this run.

For each kv_cache_dtype: bytes per token (all layers, K+V) and ratio vs bf16; perplexity
and mean KL divergence of next-token distributions against the float32 cache on real
English text (docstrings of the Python standard library, read at run time), fed in
chunks of 64 tokens so that attention READS the compressed cache; passkey retrieval at a
2k-token context (also chunked); decode tok/s at a 2k context against the bf16 cache;
and how many 2k-token sequences fit one fixed kv_cache_memory (with kv_cache_recent_tokens
or kv_cache_sink_tokens, counting the 16-bit staging of that many sequences). Plots quality
vs bits.

    python benchmarks/kv_quality.py [--tokens 1024] [--out benchmarks/out] [--skip-speed] [--rows NAME ...]
    python benchmarks/kv_quality.py --speed-only [--rows NAME ...] [--repeats 2] [--threads 1 --clock cpu]
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import statistics
import time

import torch

import timing
from slipstream import LLM, SamplingParams
from slipstream.kvcache.cache import KVCache
from slipstream.kvcache.dtype import parse_kv_cache_dtype

DTYPES = ["float32", "bfloat16", "fp8", "tq4", "tq3.5", "tq3", "tq2.5", "tq2", "tq4-qjl", "tq3-qjl"]
# (dtype, first/last layers, newest tokens, first tokens of each sequence: all kept in 16 bits)
KNOBS = [("tq3", 2, 0, 0), ("tq4", 0, 0, 4), ("tq3", 0, 0, 4), ("tq3", 0, 64, 0),
         ("tq4", 0, 64, 4), ("tq3", 0, 64, 4), ("tq2.5", 0, 64, 4)]
SPEED = ["bfloat16", "fp8", "tq4", "tq3", "tq2.5", "tq3 recent 64 sinks 4"]
SHAPES = [(3, 64)] * 30  # SmolLM2-135M: 30 layers, 3 KV heads of dim 64
CHUNK = 64
MEMORY = 256 * 2**20
clock = time.perf_counter


def english_text() -> str:
    import argparse as a, collections, json, logging, pathlib, subprocess, unittest
    return "\n\n".join(inspect.getdoc(m) or "" for m in (a, collections, json, logging, pathlib, subprocess, unittest))


def next_token_scores(llm: LLM, ids: list[int], keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each next token's negative log-likelihood [n-1], log-softmax rows of the last `keep` positions
    [keep, vocab]), taken chunk by chunk as the engine computes the prompt's logits."""
    model, nll, kept, seen = llm.engine.runner.model, [], [], [0]
    targets, first_kept = torch.tensor(ids[1:] + [0]), len(ids) - 1 - keep
    original = model.compute_logits

    def scored(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        start, rows = seen[0], logits.float().log_softmax(-1)
        seen[0] += len(rows)
        nll.append(-rows.gather(1, targets[start:start + len(rows)].unsqueeze(1)).squeeze(1))
        if start + len(rows) > first_kept:
            kept.append(rows[max(first_kept - start, 0):])
        return logits

    model.compute_logits = scored
    try:
        llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        model.compute_logits = original
    return torch.cat(nll)[:len(ids) - 1], torch.cat(kept)[:keep]


def quality(kv_dtype: str, dense_layers: int, recent: int, sinks: int, ids: list[int],
            reference: torch.Tensor | None):
    llm = LLM("smollm2-135m", dtype="float32", kv_cache_dtype=kv_dtype, kv_cache_dense_layers=dense_layers,
              kv_cache_recent_tokens=recent, kv_cache_sink_tokens=sinks, max_num_seqs=4, max_num_batched_tokens=CHUNK, enable_prefix_caching=False)
    nll, logprobs = next_token_scores(llm, ids, len(ids) - 1)
    ppl = math.exp(nll.mean().item())
    kl = 0.0 if reference is None else (reference.exp() * (reference - logprobs)).sum(-1).mean().item()
    return llm, logprobs, ppl, kl


def passkey(llm: LLM, context: int, trials: int = 4) -> float:
    tok = llm.get_tokenizer()
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    hits = 0
    for t in range(trials):
        key = str(10000 + 7919 * (t + 1) % 90000)
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        body = tok(filler * (context // 20)).input_ids[: context - 60]
        depth = len(body) * (t + 1) // (trials + 1)
        prompt = (body[:depth] + tok(needle).input_ids + body[depth:] +
                  tok(" What is the pass key? The pass key is").input_ids)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        hits += key in out.outputs[0].text
    return hits / trials


def sequences_that_fit(kv_dtype: str, dense_layers: int, recent: int, sinks: int, context: int) -> int:
    """Most sequences of `context` tokens in MEMORY, counting 16-bit staging for that many sequences."""
    spec = parse_kv_cache_dtype(kv_dtype, torch.bfloat16)
    fits = lambda n: KVCache(SHAPES, spec, torch.bfloat16, MEMORY, 16, torch.device("meta"), dense_layers,
                             recent, n, sinks).num_blocks * 16 // context >= n
    n = 1
    while fits(n + 1):
        n += 1
    return n


def decode_speed(kv_dtype: str, recent: int, sinks: int, context: int, new_tokens: int = 48) -> float:
    """Decode tok/s of one sequence after a `context`-token prompt, timed by `clock` from the first token on."""
    llm = LLM("smollm2-135m", dtype="bfloat16", kv_cache_dtype=kv_dtype, kv_cache_recent_tokens=recent,
              kv_cache_sink_tokens=sinks, max_num_seqs=4, max_num_batched_tokens=512)
    prompt = torch.randint(100, 49152, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    engine = llm.engine
    engine.add_request("speed", prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    while not any(out.outputs[0].token_ids for out in engine.step()):  # prefill
        pass
    start = clock()
    while engine.has_unfinished_requests():
        engine.step()
    return (new_tokens - 1) / (clock() - start)


def speed_only(names: list[str], context: int, repeats: int) -> None:
    """Decode speed alone, the rows alternated `repeats` times; each row's best and median (prefill and
    long-context decode: benchmarks/kv_speed.py)."""
    specs = {_name(*spec): spec for spec in [(d, 0, 0, 0) for d in DTYPES] + KNOBS}
    speeds: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names:
            kv_dtype, _, recent, sinks = specs[name]
            speeds[name].append(decode_speed(kv_dtype, recent, sinks, context))
            print(f"repeat {repeat} {name:22s} {speeds[name][-1]:6.2f} tok/s", flush=True)
    best = {name: max(s) for name, s in speeds.items()}
    median = {name: statistics.median(s) for name, s in speeds.items()}
    print(f"\n| kv_cache_dtype | decode @{context} tok/s, best / median of {repeats} | vs bf16 |\n|---|---|---|")
    for name in names:
        rel = (f"{best[name] / best['bfloat16']:.2f}x / {median[name] / median['bfloat16']:.2f}x"
               if "bfloat16" in speeds else "")
        print(f"| {name} | {best[name]:.2f} / {median[name]:.2f} | {rel} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--out", default="benchmarks/out")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--rows", nargs="*", help="only these rows, by name, in this order")
    parser.add_argument("--speed-only", action="store_true", help="decode speed of --rows alone, alternated")
    parser.add_argument("--repeats", type=int, default=2, help="with --speed-only: rounds over the rows")
    timing.add_arguments(parser)
    args = parser.parse_args()
    global clock
    clock = timing.clock_of(args)
    if args.speed_only:
        speed_only(args.rows or SPEED, args.context, args.repeats)
        return
    specs = {_name(*spec): spec for spec in [(d, 0, 0, 0) for d in DTYPES] + KNOBS}
    _, reference, base_ppl, _ = quality("float32", 0, 0, 0, _ids(args.tokens), None)
    rows = []
    for name in args.rows or specs:
        kv_dtype, dense, recent, sinks = specs[name]
        start = time.monotonic()
        llm, logprobs, ppl, kl = quality(kv_dtype, dense, recent, sinks, _ids(args.tokens), reference)
        stats = llm.stats()
        bf16_bytes = 2 * 30 * 3 * 64 * 2
        fits = sequences_that_fit(kv_dtype, dense, recent, sinks, args.context)
        key = passkey(llm, args.context)
        speed = (decode_speed(kv_dtype, recent, sinks, args.context) if not args.skip_speed and name in SPEED
                 else None)
        rows.append((name, stats["kv_bytes_per_token"], bf16_bytes / stats["kv_bytes_per_token"], ppl, kl, key, speed, fits))
        print(f"{name:18s} {rows[-1][1]:6d} B/token {rows[-1][2]:5.2f}x  ppl {ppl:7.3f}  KL {kl:.4f}  "
              f"passkey {key:.2f}  fits {fits:3d}  " + (f"decode {speed:.1f} tok/s" if speed else "") +
              f"  ({time.monotonic() - start:.0f} s)", flush=True)
    print_table(rows, args, base_ppl)
    plot(rows, os.path.join(args.out, "kv_quality.png"))


def _name(kv_dtype: str, dense: int, recent: int, sinks: int) -> str:
    return (kv_dtype + (f" +{dense} dense" if dense else "") + (f" recent {recent}" if recent else "")
            + (f" sinks {sinks}" if sinks else ""))


_TEXT_IDS: list[int] = []


def _ids(n: int) -> list[int]:
    if not _TEXT_IDS:
        from transformers import AutoTokenizer
        from slipstream.loader.registry import resolve_model_path
        path = resolve_model_path("smollm2-135m")
        tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        _TEXT_IDS.extend(tok(english_text()).input_ids[:n])
    return _TEXT_IDS


def print_table(rows, args, base_ppl: float) -> None:
    speeds = {r[0]: r[6] for r in rows if r[6]}
    print(f"\n| kv_cache_dtype | bytes/token | vs bf16 | perplexity ({args.tokens} tok) | vs fp32 | mean KL | "
          f"passkey @{args.context} | decode @{args.context} vs bf16 | seqs of {args.context} in {MEMORY >> 20} MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, nbytes, ratio, ppl, kl, key, speed, fits in rows:
        rel = f"{speed / speeds['bfloat16']:.2f}x" if speed and "bfloat16" in speeds else ""
        print(f"| {name} | {nbytes} | {ratio:.2f}x | {ppl:.3f} | {100 * (ppl / base_ppl - 1):+.2f}% | {kl:.4f} | "
              f"{key:.2f} | {rel} | {fits} |")


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, nbytes, _, ppl, kl, *_ in rows:
        bits = 8 * nbytes / (2 * 30 * 3 * 64)
        ax.scatter(bits, kl, color="tab:red" if "qjl" in name else "tab:blue")
        ax.annotate(name, (bits, kl), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.set(xscale="log", xlabel="stored bits per coordinate (all bytes / values)", yscale="symlog",
           ylabel="mean KL vs float32 cache (nats)", title="SmolLM2-135M: KV-cache quality vs size")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
