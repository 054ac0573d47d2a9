"""Decode attention alone: the TurboQuant kernel against the bf16 cache's paged kernel, in one run.

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head size 64), `--batch` sequences of `--length`
tokens, one query each, as a decode step of the engine's decode stack calls the kernels. Each dtype gets `--layers`
caches of random codes, called in turn, so that a layer's cache has left the CPU's caches when it is read again, as
in a step over every layer; blocks are handed out in order, as the engine's block manager does on a fresh cache
(`--shuffled`: in a random order, as after much freeing and reuse). A figure is the median over `--repeats` passes
over every layer, per layer, at `--threads` (wall clock: the kernels run on torch's OpenMP threads). The engine's
view of the same question is kv_speed.py's "batch 16 x 4k" row.

    python benchmarks/kv_kernels.py [--batch 16] [--length 4096] [--dtypes tq4 tq3 tq2.5] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from slipstream.attention.metadata import AttentionMetadata
from slipstream.backends.cpu.attention import dense_decode, turboquant_decode
from slipstream.backends.cpu import abi
from slipstream.kvcache.cache import LayerKVCache
from slipstream.kvcache.dtype import parse_kv_cache_dtype
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
SCALE = DIM ** -0.5


def block_tables(batch: int, length: int, shuffled: bool) -> tuple[torch.Tensor, int]:
    per_sequence = -(-length // BLOCK)
    blocks = batch * per_sequence
    order = torch.randperm(blocks) if shuffled else torch.arange(blocks)
    return order.view(batch, per_sequence).contiguous(), blocks


def turboquant_layer(kv_dtype: str, blocks: int) -> TurboQuantLayerCache:
    spec = parse_kv_cache_dtype(kv_dtype, torch.float32)
    cache = TurboQuantLayerCache(blocks, BLOCK, KV_HEADS, DIM, spec.key_bits, spec.key_mode, seed=0,
                                 device=torch.device("cpu"), value_bits=spec.value_bits)
    cache.calibrate(torch.randn(256, HEADS, DIM), torch.randn(256, KV_HEADS, DIM), torch.randn(256, KV_HEADS, DIM))
    slots = torch.arange(blocks * BLOCK)
    cache.write(torch.randn(len(slots), KV_HEADS, DIM), torch.randn(len(slots), KV_HEADS, DIM), slots)
    return cache


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
        start = time.perf_counter()
        for cache in layers:
            call(cache)
        samples.append((time.perf_counter() - start) / len(layers) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--dtypes", nargs="*", default=["tq4", "tq3", "tq2.5"])
    parser.add_argument("--layers", type=int, default=30, help="caches per dtype (SmolLM2 has 30 layers)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shuffled", action="store_true")
    args = parser.parse_args()
    if abi.kernels() is None:
        raise SystemExit("no native kernels on this machine (SLIPSTREAM_NATIVE=0, or no C compiler)")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
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
    for kv_dtype in args.dtypes:
        layers = [turboquant_layer(kv_dtype, blocks) for _ in range(args.layers)]
        ms = per_layer_ms(lambda c: turboquant_decode(grouped, None, None, c, tables, lens, SCALE, None), layers,
                          args.repeats)
        print(f"| {kv_dtype} | {ms:.3f} | {base / ms:.2f}x |")


if __name__ == "__main__":
    main()
