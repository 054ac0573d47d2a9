"""Decode attention alone: the TurboQuant kernel against the bf16 cache's paged kernel, in one run.

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head size 64; `--shapes gemma3`: Gemma 3 270M's, 4 query
heads on one KV head of 256), `--batch` sequences of `--length` tokens, one query each, as a decode step of the
engine's decode stack calls the kernels. Each dtype gets `--layers` caches of random codes, called in turn, so that
a layer's cache has left the CPU's caches when it is read again, as in a step over every layer; blocks are handed
out in order, as the engine's block manager does on a fresh cache (`--shuffled`: in a random order, as after much
freeing and reuse). With `--recent R --sinks S` (the default names' windows, e.g. tq3's 144 and 4) each TurboQuant
layer also keeps every sequence's newest R and first S tokens in 16 bits, staged as the engine stages them (one
`Staging` for all layers), and the kernel reads those there. A figure is the median over `--repeats` passes over
every layer, per layer, at `--threads` (wall clock: the kernels run on torch's OpenMP threads; `--threads 1 --clock
cpu` on a shared machine). The engine's view of the same question is kv_speed.py's "batch 16 x 4k" and "one short"
rows.

    python benchmarks/kv_kernels.py [--batch 16] [--length 4096] [--dtypes tq4 tq3 tq2.5] [--threads 2]
                                    [--recent 0 --sinks 0] [--shapes smollm2|gemma3] [--clock wall|cpu]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import timing
from slipstream.attention import turboquant
from slipstream.attention.metadata import AttentionMetadata
from slipstream.backends.cpu.attention import dense_decode, turboquant_decode
from slipstream.backends.cpu import abi
from slipstream.kvcache.cache import LayerKVCache
from slipstream.kvcache.dtype import parse_kv_cache_dtype
from slipstream.kvcache.recent_window import Staging, staging_blocks
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache

SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}  # query heads, KV heads, head size
HEADS, KV_HEADS, DIM = SHAPES["smollm2"]
BLOCK = 16
SCALE = DIM ** -0.5
clock = time.perf_counter


def block_tables(batch: int, length: int, shuffled: bool) -> tuple[torch.Tensor, int]:
    per_sequence = -(-length // BLOCK)
    blocks = batch * per_sequence
    order = torch.randperm(blocks) if shuffled else torch.arange(blocks)
    return order.view(batch, per_sequence).contiguous(), blocks


def turboquant_layer(kv_dtype: str, blocks: int, staging: Staging | None) -> TurboQuantLayerCache:
    spec = parse_kv_cache_dtype(kv_dtype, torch.float32)
    cache = TurboQuantLayerCache(blocks, BLOCK, KV_HEADS, DIM, spec.key_bits, spec.key_mode, seed=0,
                                 device=torch.device("cpu"), dense_dtype=torch.bfloat16,
                                 value_bits=spec.value_bits, staging=staging)
    cache.calibrate(torch.randn(256, HEADS, DIM), torch.randn(256, KV_HEADS, DIM), torch.randn(256, KV_HEADS, DIM))
    return cache


def fill(layers: list[TurboQuantLayerCache], tables: torch.Tensor, lens: torch.Tensor) -> None:
    """Every sequence's tokens written as the engine writes them: all but the last in one prefill step, then the
    last as a decode step (its staging placed as the steps before it left it, as the decode kernel then reads it)."""
    length = int(lens[0])
    positions = torch.arange(length)
    slots = tables[:, positions // BLOCK] * BLOCK + positions % BLOCK  # [B, L]
    steps = [(slots[:, :-1].flatten(), length - 1, 0), (slots[:, -1], 1, len(lens))]
    for step_slots, new, decodes in steps:
        ends = [length - 1 if decodes == 0 else length] * len(lens)
        meta = AttentionMetadata(step_slots, torch.arange(len(lens) + 1) * new, torch.tensor(ends), tables, decodes,
                                 [i * new for i in range(len(lens) + 1)], ends)
        for cache in layers:
            k, v = torch.randn(len(step_slots), KV_HEADS, DIM), torch.randn(len(step_slots), KV_HEADS, DIM)
            cache.write(k, v, step_slots)
            if cache.window is not None:
                turboquant.place_staging(cache.window.staging, meta)
                cache.window.write(k, v)
                cache.window.write(k, v, late=True)


def bf16_layer(blocks: int) -> LayerKVCache:
    cache = LayerKVCache(blocks, BLOCK, KV_HEADS, DIM, torch.bfloat16, torch.device("cpu"))
    cache.k.normal_()
    cache.v.normal_()
    return cache


def decode_step(tables: torch.Tensor, lens: torch.Tensor) -> AttentionMetadata:
    """The metadata of a step whose rows all decode one token (none is written: the caches are already full)."""
    batch = len(lens)
    return AttentionMetadata(torch.zeros(0, dtype=torch.int64), torch.arange(batch + 1), lens, tables, batch,
                             list(range(batch + 1)), lens.tolist())


def per_layer_ms(call, layers: list, repeats: int) -> float:
    for cache in layers:  # warm-up: builds and loads the kernels; None: a kernel declined the shapes
        assert call(cache) is not None
    samples = []
    for _ in range(repeats):
        start = clock()
        for cache in layers:
            call(cache)
        samples.append((clock() - start) / len(layers) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--dtypes", nargs="*", default=["tq4", "tq3", "tq2.5"])
    parser.add_argument("--layers", type=int, default=30, help="caches per dtype (SmolLM2 has 30 layers)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shuffled", action="store_true")
    parser.add_argument("--recent", type=int, default=0, help="newest tokens of each sequence in 16 bits")
    parser.add_argument("--sinks", type=int, default=0, help="first tokens of each sequence in 16 bits")
    parser.add_argument("--shapes", choices=list(SHAPES), default="smollm2")
    timing.add_arguments(parser)
    parser.set_defaults(threads=2)
    args = parser.parse_args()
    global clock, HEADS, KV_HEADS, DIM, SCALE
    clock = timing.clock_of(args)
    HEADS, KV_HEADS, DIM = SHAPES[args.shapes]
    SCALE = DIM ** -0.5
    if abi.kernels() is None:
        raise SystemExit("no native kernels on this machine (SLIPSTREAM_NATIVE=0, or no C compiler)")
    torch.manual_seed(0)
    tables, blocks = block_tables(args.batch, args.length, args.shuffled)
    lens = torch.full((args.batch,), args.length, dtype=torch.int64)
    q = torch.randn(args.batch, HEADS, DIM)
    q16, meta = q.bfloat16(), decode_step(tables, lens)
    base = per_layer_ms(lambda c: dense_decode(q16, c, meta, SCALE, None),
                        [bf16_layer(blocks) for _ in range(args.layers)], args.repeats)
    print(f"| kv_cache_dtype | ms a layer ({args.batch} x {args.length}) | vs bf16 cache |")
    print("|---|---|---|")
    print(f"| bfloat16 | {base:.3f} | 1.00x |")
    grouped = q.view(args.batch, KV_HEADS, HEADS // KV_HEADS, DIM)
    own = torch.randn(args.batch, KV_HEADS, DIM).bfloat16()  # the step's own K/V, read in 16 bits with a window
    for kv_dtype in args.dtypes:
        staging = None
        if args.recent or args.sinks:
            pool = staging_blocks(args.recent, args.sinks, BLOCK, args.batch)
            staging = Staging(args.recent, args.sinks, blocks, pool, BLOCK, torch.device("cpu"))
        layers = [turboquant_layer(kv_dtype, blocks, staging) for _ in range(args.layers)]
        fill(layers, tables, lens)
        ms = per_layer_ms(lambda c: turboquant_decode(grouped, own, own, c, tables, lens, SCALE, None), layers,
                          args.repeats)
        print(f"| {kv_dtype} | {ms:.3f} | {base / ms:.2f}x |")


if __name__ == "__main__":
    main()
