"""The GPU benchmarks that benchmarks/gpu.sh runs, one subcommand per figure, each appending its lines
to --results (one Markdown file for the whole run).

    checkpoint    a random-weight checkpoint of a real config (Llama-3.1-8B, Qwen3-30B-A3B), built on the GPU
    throughput    offline throughput, slipstream or transformers generate, same prompts, same GPU
    latency       single-stream decode (CUDA graphs, then eager; transformers too), and the HBM roofline's share
    tq-attention  decode attention at 8k / 32k contexts, batch 1 / 64: TurboQuant tq3 codes vs the bf16 cache

Random weights give the shapes, bytes and FLOPs of the real model (throughput, memory and
roofline figures), not its outputs (Llama 3.1's rope scaling is left out: it changes no
cost). Every prompt is random token ids of one length, so that transformers' batches need no
padding.
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # vendor peaks, SXM parts
CONFIGS = {
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                          tie_word_embeddings=False),
}


def record(path: str, line: str) -> None:
    print(line, flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")


def checkpoint(args) -> None:
    import transformers

    spec = dict(CONFIGS[args.config])
    if args.layers:
        spec["num_hidden_layers"] = args.layers
    config = transformers.AutoConfig.for_model(**spec)
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    record(args.results, f"- checkpoint {args.config} ({spec['num_hidden_layers']} layers): {params / 1e9:.2f} B "
                         f"parameters, built on the GPU and saved in {time.perf_counter() - start:.0f} s")


def vocab_size(model: str) -> int:
    with open(f"{model}/config.json") as f:
        return json.load(f)["vocab_size"]


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (n, length), generator=g).tolist()


def engine(args, **overrides):
    from slipstream import LLM

    kwargs = dict(model=args.model, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.85,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192, max_model_len=args.input_len
                  + args.output_len + 16, enable_prefix_caching=False) | overrides
    return LLM(**kwargs)


def throughput(args) -> None:
    vocab = vocab_size(args.model)
    batch = prompts(args.num_prompts, args.input_len, vocab)
    if args.engine == "slipstream":
        from slipstream import SamplingParams

        llm = engine(args)
        stats = llm.stats()
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(batch[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        memory = (f"; KV cache {stats['num_blocks']} blocks x 16 tokens, {stats['kv_bytes_per_token']} bytes/token, "
                  f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB peak allocated")
    else:
        elapsed, tokens = transformers_generate(args, batch)
        memory = f"; batches of {args.hf_batch_size}, {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB peak allocated"
    record(args.results, f"- throughput {args.label} {args.engine}: {tokens / elapsed:.0f} output tok/s "
                         f"({args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, "
                         f"{elapsed:.1f} s{memory})")


def transformers_generate(args, batch: list[list[int]]) -> tuple[float, int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map="cuda")
    model.eval()

    def run(ids: torch.Tensor, n: int) -> torch.Tensor:
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)

    with torch.no_grad():
        run(torch.tensor(batch[:2], device="cuda"), 4)  # warm-up
        torch.cuda.synchronize()
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(batch), args.hf_batch_size):
            ids = torch.tensor(batch[i:i + args.hf_batch_size], device="cuda")
            tokens += (run(ids, args.output_len).shape[1] - ids.shape[1]) * len(ids)
        torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def latency(args) -> None:
    """One engine with CUDA graphs captured (eager alone if capture fails), measured with them, then without."""
    from slipstream import SamplingParams

    vocab = vocab_size(args.model)
    prompt = prompts(1, args.input_len, vocab)
    try:
        llm, modes = engine(args, enforce_eager=False, max_num_seqs=8, gpu_memory_utilization=0.5), ["graphs", "eager"]
    except Exception as error:  # noqa: BLE001 - a capture failure of any kind is a figure too
        record(args.results, f"- latency {args.label}: CUDA graphs failed to capture: {error!r}")
        llm, modes = engine(args, max_num_seqs=8, gpu_memory_utilization=0.5), ["eager"]
    roofline = next((v for k, v in HBM_BYTES_PER_S.items() if k in torch.cuda.get_device_name()), None)
    weights = sum(p.numel() * p.element_size() for n, p in llm.engine.runner.model.named_parameters()
                  if "embed" not in n)  # what one decode step reads: every weight but the embedding table
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for mode in modes:
        if mode == "eager":
            llm.engine.runner.graphs = None
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        tpot = out.metrics.tpot
        share = (f", {weights / tpot / roofline:.0%} of the HBM roofline ({weights / 2**30:.1f} GiB read per step)"
                 if roofline else "")
        record(args.results, f"- latency {args.label} slipstream {mode}: {1 / tpot:.1f} tok/s, TPOT {tpot * 1e3:.2f} ms, "
                             f"TTFT {out.metrics.ttft * 1e3:.0f} ms{share}; tokens {out.outputs[0].token_ids[:8]}...")
    if args.with_transformers:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        tpot = transformers_tpot(args, prompt)
        share = f", {weights / tpot / roofline:.0%} of the HBM roofline" if roofline else ""
        record(args.results, f"- latency {args.label} transformers generate: {1 / tpot:.1f} tok/s, "
                             f"TPOT {tpot * 1e3:.2f} ms{share}")


def transformers_tpot(args, prompt: list[list[int]]) -> float:
    """Seconds per token after the first: (generate n tokens - generate 1) / (n - 1)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map="cuda")
    ids = torch.tensor(prompt, device="cuda")

    def run(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(4)  # warm-up
    return (run(args.output_len) - run(1)) / (args.output_len - 1)


def tq_attention(args) -> None:
    """One layer of Llama-3.1-8B's attention (32 query / 8 KV heads, head size 128), decode only."""
    for context in (8192, 32768):
        for batch in (1, 64):
            bf16, splits = time_dense_decode(batch, context)
            tq3 = time_turboquant_decode(batch, context)
            torch.cuda.empty_cache()
            record(args.results, f"- decode attention, context {context}, batch {batch}: bf16 cache {bf16 * 1e3:.3f} ms "
                                 f"(split-KV {splits}), tq3 codes {tq3 * 1e3:.3f} ms: tq3 {bf16 / tq3:.2f}x the bf16 cache")


HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def decode_batch(batch: int, context: int):
    """Block tables (each sequence its own consecutive blocks), lengths, query starts and bf16 queries."""
    device = torch.device("cuda")
    tables = torch.arange(batch * context // BLOCK, device=device).view(batch, -1)
    lens = torch.full((batch,), context, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    return tables, lens, torch.arange(batch + 1, device=device), q


def time_dense_decode(batch: int, context: int) -> tuple[float, int]:
    from slipstream.backends.cuda import paged_attention
    from slipstream.kvcache.cache import LayerKVCache

    tables, lens, starts, q = decode_batch(batch, context)
    cache = LayerKVCache(tables.numel(), BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16, q.device)
    cache.k.normal_()
    cache.v.normal_()
    splits = paged_attention.choose_splits(batch * KV_HEADS, context)
    seconds = timed(lambda: paged_attention.paged_attention(q, cache.k, cache.v, tables, lens, starts,
                                                            HEAD_DIM ** -0.5, None, 1, splits))
    return seconds, splits


def time_turboquant_decode(batch: int, context: int) -> float:
    from slipstream.backends.cuda.attention import turboquant_decode
    from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache

    tables, lens, _, q = decode_batch(batch, context)
    cache = TurboQuantLayerCache(tables.numel(), BLOCK, KV_HEADS, HEAD_DIM, 3, "mse", seed=0, device=q.device)
    sample = torch.randn(4096, KV_HEADS, HEAD_DIM, device=q.device)
    cache.calibrate(torch.randn(4096, HEADS, HEAD_DIM, device=q.device), sample, sample)
    fill_codes(cache, sample)
    qg = q.view(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    return timed(lambda: turboquant_decode(qg, None, None, cache, tables, lens, HEAD_DIM ** -0.5, None))


def fill_codes(cache, sample: torch.Tensor) -> None:
    """Every slot holds the codes of one of 4096 encoded vectors (the Triton encoder), tiled."""
    from slipstream.backends.cuda.attention import turboquant_encode

    slots = torch.arange(len(sample), device=sample.device)
    turboquant_encode(cache.k, cache.key_quantizer, sample, slots, cache.key_mean, cache.key_scale)
    turboquant_encode(cache.v, cache.value_quantizer, sample, slots)
    for rows in (cache.k, cache.v):
        flat = rows.view(-1, *rows.shape[2:])
        tile = flat[:len(sample)].clone()
        for start in range(len(sample), len(flat), len(sample)):
            flat[start:start + len(sample)] = tile[:len(flat) - start]


def timed(fn, repeats: int = 20) -> float:
    """Mean seconds per call on the GPU, after one warm-up call (Triton compiles there)."""
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1e3 / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["checkpoint", "throughput", "latency", "tq-attention"])
    parser.add_argument("--results", required=True)
    parser.add_argument("--config", choices=sorted(CONFIGS))
    parser.add_argument("--layers", type=int, default=0, help="checkpoint: keep the first N layers (0: all)")
    parser.add_argument("--out", help="checkpoint: directory to write")
    parser.add_argument("--model", help="checkpoint directory")
    parser.add_argument("--label", default="")
    parser.add_argument("--engine", choices=["slipstream", "transformers"], default="slipstream")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--with-transformers", action="store_true", help="latency: transformers generate too")
    args = parser.parse_args()
    {"checkpoint": checkpoint, "throughput": throughput, "latency": latency, "tq-attention": tq_attention}[
        args.command.replace("_", "-")](args)


if __name__ == "__main__":
    main()
