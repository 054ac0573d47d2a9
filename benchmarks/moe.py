"""MoE throughput: slipstream vs transformers vs a naive per-token loop, on a synthetic Mixtral.

Model: random weights in Mixtral's shape, scaled down to run on a laptop CPU: hidden 1024,
4 layers, 16 query / 8 KV heads, 8 experts (--experts) of width 2048, top-2, vocab 32000 (about 280M
parameters, 200M of them in experts), bfloat16 for every engine, the same torch threads.

- prefill: B prompts of L random tokens, one forward pass (transformers: one [B, L] batch,
  logits of the last position only; slipstream: one step, `max_tokens=1`, no prefix cache);
- decode: B sequences generating N tokens after a short prompt; decode time = time to
  generate N + 1 tokens - time to generate 1 (transformers: `generate`; slipstream: `LLM.generate`);
- transformers runs twice: with its default experts implementation (`grouped_mm`: pairs
  sorted by expert, one grouped GEMM) and with `eager` (a Python loop over the experts hit,
  one-hot masks; transformers 4's algorithm). Both already group tokens by expert;
- naive: slipstream with the expert execution replaced by a loop over tokens, each token
  running its k experts on itself alone — the same math without grouping by expert.

Runs are interleaved across engines and repeated; the table gives each engine's median
(docs/benchmarks.md), and a last line the ratios of the fastest runs. On a shared
machine, `--clock cpu` (with --threads 1) times by process CPU time instead of wall time, so
that other processes' load does not count. A heat map of tokens per expert and layer goes to
--heatmap. `--deterministic` adds slipstream with batch invariance set the other way from the
backend's default; that needs a router gemm.c tiles (a multiple of 16 experts: `--experts 16`).

    python benchmarks/moe.py [--threads 2] [--repeats 3] [--clock wall|cpu] [--heatmap PATH]
                             [--experts N] [--deterministic]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from slipstream import LLM, SamplingParams
from slipstream.layers.moe import Experts, load_balance_summary

clock = time.perf_counter
SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096)


def build_checkpoint(path: str, experts: int) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(**dict(SHAPE, num_local_experts=experts), bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)


def prompts_for(batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, SHAPE["vocab_size"], (batch, length), generator=g).tolist()


def naive_experts_forward(self: Experts, x, weights, ids, counts):
    """Token by token, each of its k experts on that token alone."""
    out = torch.zeros_like(x)
    for t, (token_ids, token_weights) in enumerate(zip(ids.tolist(), weights.to(x.dtype))):
        for e, w in zip(token_ids, token_weights):
            out[t] += w * self.expert(e, x[t:t + 1])[0]
    return out


# --- slipstream -------------------------------------------------------------------------
def slipstream_prefill(llm: LLM, batch: int, length: int, seed: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = prompts_for(batch, length, seed)
    start = clock()
    llm.generate(prompts, params, use_tqdm=False)
    return clock() - start


def slipstream_decode(llm: LLM, batch: int, prompt_len: int, new_tokens: int, seed: int) -> float:
    prompts = prompts_for(batch, prompt_len, seed + 100)

    def generate(n: int) -> float:
        start = clock()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return clock() - start

    return generate(new_tokens + 1) - generate(1)


# --- transformers -----------------------------------------------------------------------
@torch.inference_mode()
def hf_prefill(model, batch: int, length: int, seed: int) -> float:
    ids = torch.tensor(prompts_for(batch, length, seed))
    start = clock()
    model(ids, logits_to_keep=1)
    return clock() - start


@torch.inference_mode()
def hf_decode(model, batch: int, prompt_len: int, new_tokens: int, seed: int) -> float:
    ids = torch.tensor(prompts_for(batch, prompt_len, seed + 100))

    def generate(n: int) -> float:
        start = clock()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        return clock() - start

    return generate(new_tokens + 1) - generate(1)


def save_heatmap(expert_load: dict[int, list[int]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(expert_load)
    counts = [expert_load[i] for i in layers]
    fig, ax = plt.subplots(figsize=(1 + 0.8 * len(counts[0]), 1 + 0.6 * len(layers)))
    image = ax.imshow(counts, cmap="viridis", aspect="auto")
    for row, values in enumerate(counts):
        for col, value in enumerate(values):
            bright = value > (min(map(min, counts)) + max(map(max, counts))) / 2
            ax.text(col, row, str(value), ha="center", va="center", color="black" if bright else "white", fontsize=8)
    ax.set_xticks(range(len(counts[0])))
    ax.set_yticks(range(len(layers)), labels=[str(i) for i in layers])
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title("tokens routed to each expert")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--decode-prompt-len", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--naive-prefill-len", type=int, default=64, help="the naive loop is slow: shorter prompts")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: process CPU time (only meaningful with --threads 1)")
    parser.add_argument("--heatmap", default="benchmarks/out/moe_expert_load.png")
    parser.add_argument("--experts", type=int, default=SHAPE["num_local_experts"])
    parser.add_argument("--deterministic", action="store_true",
                        help="also slipstream with batch invariance the other way (needs --experts 16, 32, ...)")
    args = parser.parse_args()
    SHAPE["num_local_experts"] = args.experts
    torch.set_num_threads(args.threads)
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    import transformers

    B, L = args.prefill_batch, args.prefill_len
    DB, DP, DN = args.decode_batch, args.decode_prompt_len, args.decode_tokens
    with tempfile.TemporaryDirectory() as path:
        build_checkpoint(path, args.experts)
        engine_args = dict(dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=B * L,
                           max_num_seqs=max(B, DB))
        llm = LLM(path, **engine_args)
        other = None
        if args.deterministic:
            other = LLM(path, deterministic=not llm.engine.backend.batch_invariant, **engine_args)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    default_experts = hf.config._experts_implementation
    print(f"synthetic Mixtral: {sum(p.numel() for p in hf.parameters()) / 1e6:.0f}M parameters, "
          f"{SHAPE['num_local_experts']} experts top-{SHAPE['num_experts_per_tok']}, hidden {SHAPE['hidden_size']}, "
          f"expert width {SHAPE['intermediate_size']}, {SHAPE['num_hidden_layers']} layers; bfloat16, "
          f"{torch.get_num_threads()} threads, {args.clock} clock; transformers {transformers.__version__} "
          f"(experts_implementation={default_experts} by default)")
    print(f"prefill: {B} x {L} tokens; decode: {DB} sequences x {DN} tokens after {DP}-token prompts; "
          f"median of {args.repeats} interleaved runs")

    slipstream_prefill(llm, 1, 16, seed=99)  # warm-up
    hf_prefill(hf, 1, 16, seed=99)
    hf_runs = (lambda s: hf_prefill(hf, B, L, s), lambda s: hf_decode(hf, DB, DP, DN, s))
    engines = {  # name -> (prefill seconds, decode seconds) for a seed; "eager" switches transformers' experts
        "transformers": hf_runs,
        "transformers (eager)": hf_runs,
        "slipstream": (lambda s: slipstream_prefill(llm, B, L, s), lambda s: slipstream_decode(llm, DB, DP, DN, s)),
    }
    if other is not None:
        engines["slipstream " + ("det" if other.engine.backend.batch_invariant else "nondet")] = (
            lambda s: slipstream_prefill(other, B, L, s), lambda s: slipstream_decode(other, DB, DP, DN, s))
    times = {name: ([], []) for name in engines}
    llm.engine.runner.model.reset_routing_stats()
    for seed in range(args.repeats):  # interleaved, so that load from other processes hits every engine alike
        for name, runs in engines.items():
            hf.set_experts_implementation("eager" if "eager" in name else default_experts)
            for run, measured in zip(runs, times[name]):
                measured.append(run(seed))
    hf.set_experts_implementation(default_experts)
    results = {name: (B * L / statistics.median(prefill), DB * DN / statistics.median(decode))
               for name, (prefill, decode) in times.items()}
    fastest = [min(hf_times) / min(ours) for hf_times, ours in zip(times["transformers"], times["slipstream"])]
    expert_load = llm.stats()["expert_load"]
    grouped_forward, Experts.forward = Experts.forward, naive_experts_forward
    try:
        naive_len = args.naive_prefill_len
        results["naive per-token loop"] = (B * naive_len / slipstream_prefill(llm, B, naive_len, 0),
                                           DB * DN / slipstream_decode(llm, DB, DP, DN, 0))
    finally:
        Experts.forward = grouped_forward

    hf_prefill_tps, hf_decode_tps = results["transformers"]
    print(f"\n{'':24s}{'prefill tok/s':>14s}{'decode tok/s':>14s}")
    for name, (prefill, decode) in results.items():
        print(f"{name:24s}{prefill:14.1f}{decode:14.1f}   (x{prefill / hf_prefill_tps:.2f} / x{decode / hf_decode_tps:.2f}"
              f" vs transformers)")
    print(f"(naive loop: one run; its prefill on {B} x {args.naive_prefill_len} tokens)")
    print(f"fastest runs: slipstream x{fastest[0]:.2f} / x{fastest[1]:.2f} vs transformers")
    print("\nexpert load over the slipstream runs (token-expert pairs):")
    print(load_balance_summary(expert_load))
    save_heatmap(expert_load, args.heatmap)
    print(f"heat map: {args.heatmap}")


if __name__ == "__main__":
    main()
