"""GEMM rates per path and row count, the measurements behind backends/cpu/linear.py's GemmPolicy.

For each weight shape (SmolLM2-135M's projections and LM head, the MoE benchmark's experts)
and each row count, every path multiplies bf16 rows by the same weights: the native kernels
of kernels/gemm.c (AVX-512 loops and, where built, AMX tiles) in bf16 / int8 / int4, oneDNN's
bf16 GEMM through `F.linear` (plain and prepacked weight), PyTorch's int8 / int4 weight-only
kernels, the dequantize-to-fp32 path and the fp32 upcast. Weights are cold: each call reads
the next of enough copies to overflow the caches, as a decode step reads every layer once.
Paths alternate within each row count; a figure is the median of --repeats samples of
GFLOP/s timed by the thread's CPU time (so other processes' load does not count), one thread.

    python benchmarks/gemm.py [--shapes qkv o gate_up down head moe_gate_up moe_down] [--rows 1 8 64 512]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from slipstream.backends.cpu.capability import CpuCapability
from slipstream.backends.cpu.linear import GemmPolicy, NativeInt4, NativeInt8, native_matmul, pack_columns
from slipstream.layers.linear import Linear, LinearMethod
from slipstream.layers.quantization import QUANTIZED

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "head": (576, 49152),
          "moe_gate_up": (1024, 4096), "moe_down": (2048, 1024)}  # K x N
COLD_BYTES = 200e6
SAMPLE_SECONDS = 0.02


def bound(layers: list[Linear], method: LinearMethod) -> list[Linear]:
    """Copies of `layers` in `method`'s format."""
    copies = []
    for layer in layers:
        copy = Linear(layer.in_features, layer.out_features, bias=False).bfloat16()
        copy.weight.data.copy_(layer.weight.data)
        copy.bind(method)
        copies.append(copy)
    return copies


def paths(k: int, n: int, capability: CpuCapability) -> dict[str, tuple]:
    """name -> (function of (x, weight object), weight objects to rotate through)."""
    torch.manual_seed(0)
    layers = [Linear(k, n, bias=False).bfloat16() for _ in range(max(1, min(48, int(COLD_BYTES // (2 * k * n)))))]
    weights = [layer.weight.detach() for layer in layers]
    native = capability.gemm
    policy = GemmPolicy(capability.amx_kernels, invariant=False)
    int8 = bound(layers, NativeInt8(policy) if native else QUANTIZED["int8"])
    int4 = bound(layers, NativeInt4(policy) if native else QUANTIZED["int4"])
    dequantized = lambda x, q: F.linear(x.float(), q.method.dequantized(q, torch.float32)).bfloat16()  # noqa: E731
    few = slice(0, 4)  # the fp32 copies are large, and these paths are compute bound anyway
    table = {
        "oneDNN bf16": (F.linear, weights),
        "oneDNN packed": (lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                          [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]),
        "fp32 upcast": (lambda x, w: F.linear(x.float(), w.float()).bfloat16(), weights[few]),
        "torch int8": (lambda x, q: torch.ops.aten._weight_int8pack_mm(x, q.qweight, q.scale), int8),
        "int8 dequant fp32": (dequantized, int8[few]),
        "torch int4": (lambda x, q: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q.qweight, 32, q.scales_and_zeros),
                       int4),
        "int4 dequant fp32": (dequantized, int4[few]),
        "w8a8 _int_mm": (lambda x, q: q(x), bound(layers, QUANTIZED["w8a8"])),
    }
    if native:
        for kernel in ["avx512"] + (["amx"] if capability.amx_kernels else []):
            table[f"native bf16 {kernel}"] = (lambda x, p, c=kernel: native_matmul(x, p, kernel=c),
                                              [pack_columns(w) for w in weights])
            table[f"native int8 {kernel}"] = (lambda x, q, c=kernel: q.method.native_mm(q, x, c), int8)
            table[f"native int4 {kernel}"] = (lambda x, q, c=kernel: q.method.native_mm(q, x, c), int4)
    return table


def sample(fn, weights: list, x: torch.Tensor, flops: float, state: list[int]) -> float:
    """GFLOP/s of one sample: calls on the next weights until SAMPLE_SECONDS of CPU time."""
    calls, start = 0, time.thread_time()
    while calls < 3 or time.thread_time() - start < SAMPLE_SECONDS:
        fn(x, weights[state[0] % len(weights)])
        state[0] += 1
        calls += 1
    return flops * calls / (time.thread_time() - start) / 1e9


def measure(name: str, rows: list[int], repeats: int, capability: CpuCapability) -> None:
    k, n = SHAPES[name]
    table = paths(k, n, capability)
    print(f"\n{name}: K={k} N={n}, GFLOP/s (median of {repeats})")
    print(f"{'path':20s}" + "".join(f"{r:>8d}" for r in rows))
    results = {path: [] for path in table}
    for r in rows:
        x = torch.randn(r, k).bfloat16()
        samples = {path: [] for path in table}
        states = {path: [0] for path in table}
        for path, (fn, weights) in table.items():
            fn(x, weights[0])  # warm-up: allocations, oneDNN's kernel generation
        for _ in range(repeats):
            for path, (fn, weights) in table.items():
                samples[path].append(sample(fn, weights, x, 2 * r * k * n, states[path]))
        for path in table:
            results[path].append(statistics.median(samples[path]))
    for path, figures in results.items():
        print(f"{path:20s}" + "".join(f"{f:8.1f}" for f in figures), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", nargs="*", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    capability = CpuCapability.detect()
    print(f"1 thread, thread CPU time; AMX kernels {'built' if capability.amx_kernels else 'not available'}")
    for name in args.shapes:
        rows = [r for r in args.rows if name != "head" or r <= 64]  # the LM head sees decode rows only
        measure(name, rows, args.repeats, capability)


if __name__ == "__main__":
    main()
