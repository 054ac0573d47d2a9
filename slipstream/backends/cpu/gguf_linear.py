"""The CPU backend's methods for GGUF weights as stored: every format repacked for gemm.c's kernels
where the model runs in bf16, kernels/gguf_gemm.c on the file's blocks otherwise.

Each format becomes gemm.c's int4 weights (`NativeBlocks`: Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)
or its int8 quads (`NativeQ8`: Q8_0), with the file's own scales: the same values and (k-quants
aside, whose 6-bit scales take a byte each: +2.8% for Q4_K) the same bytes per weight, moved once
at load into the kernels' layout (16 columns side by side, so that one vector op applies a group's
scale to 16 columns; the layouts are in gguf_repack.py, whose `file_blocks` moves them back). The
int4 kernels take the low four bits as nibbles, Q5's and Q6_K's higher bits from planes of one
dword per group and column, and each format's scales (float16 d and m; k-quants' d and dmin per
256 with a 6-bit scale and minimum per group; Q6_K's int8 scale per 16): AVX-512 loops, AMX tiles
or bf16 dot products for prefill, the fused decode stack, wherever the GemmPolicy gives int4 one. One
core of the AMX machine, one row: SmolLM2's gate_up (Q4_1) 31 us against gguf_gemm.c's 117; Gemma
3's (Q5_0) 80 against 272. Q8_0 takes int8's loops, or its bf16 dot products, wherever the policy gives
int8 those (SmolLM2's LM head: 0.73 vs 1.55 ms per decode step on the loops, 2 threads). A projection
fused from two formats (`Segmented`) runs each part on its own method; a tied embedding reads its rows
through `Repacked.rows`.

For float32 activations and layers whose rows do not tile by 16 (`NativeGGUF`), below
DEQUANTIZE_MIN_ROWS rows (decode, small batches) every segment of a layer's blocks is
multiplied in place by the native GEMM (codes widened to float32 in registers, the format's
scales per group: see the kernel's header), writing its columns of the output directly. From
there on (prefill) the GEMM is compute bound and the dense GEMMs win, so the kernel dequantizes
tiles of DEQUANTIZE_TILE weights to float32 and oneDNN multiplies them in the activations' dtype
(bf16 on AMX tiles here): only a tile is ever widened, never the layer. Without kernels
(SLIPSTREAM_NATIVE=0, no compiler) the torch twin in layers/gguf_linear.py serves, which is also
the reference the tests hold the kernels to. This module never knows files or models.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.backends.cpu import abi
from slipstream.backends.cpu.gguf_repack import REPACKED, dequantized, repack, selected
from slipstream.backends.cpu.linear import GemmPolicy, NativeCodes, NativeNibbles, dense_linear, native_matmul
from slipstream.layers.gguf_linear import BlockRows, GGUFLinear, segments, split_segments
from slipstream.layers.linear import Linear, LinearMethod

# One core of the development machine (AMX), CPU time, native GEMM vs dequantizing + bf16 F.linear
# at 16 / 64 / 256 rows: SmolLM2's gate_up (Q4_1, 3072 x 576) 1.54 vs 2.05, 5.9 vs 2.7, 28 vs 4.0 ms;
# Gemma 3's gate_up (Q5_0, 4096 x 640) 3.0 vs 3.3, 11 vs 3.5, 44 vs 6.1 ms: the crossover is near 24 rows
DEQUANTIZE_MIN_ROWS = 32
DEQUANTIZE_TILE = 1 << 21  # weights per dequantized tile: 8 MB of float32


class NativeGGUF(GGUFLinear):
    def __init__(self, lib: abi.Kernels):
        self.lib = lib

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        xf = x.contiguous() if x.shape[0] >= DEQUANTIZE_MIN_ROWS else x.float().contiguous()
        out = torch.empty(x.shape[0], layer.out_features, dtype=xf.dtype)
        col = 0
        for rows in segments(layer):
            n = rows.data.shape[0]
            if x.shape[0] >= DEQUANTIZE_MIN_ROWS:
                self._dense(rows, xf, out[:, col:col + n], layer.in_features)
            else:
                gguf_gemm(self.lib, xf, rows.fmt.ggml_type, rows.data, out[:, col:], layer.in_features)
            col += n
        out = out if layer.bias is None else out.add_(layer.bias)
        return out.to(x.dtype)

    def _dense(self, rows: BlockRows, x: torch.Tensor, out: torch.Tensor, k: int) -> None:
        step = max(1, DEQUANTIZE_TILE // k)
        for start in range(0, rows.data.shape[0], step):
            tile = dequantize(self.lib, rows.fmt.ggml_type, rows.data[start:start + step], k)
            out[:, start:start + tile.shape[0]] = F.linear(x, tile.to(x.dtype))


def gguf_gemm(lib: abi.Kernels, x: torch.Tensor, ggml_type: int, blocks: torch.Tensor, out: torch.Tensor,
              k: int) -> None:
    """out[:, :N] = x [M, K] float32 times blocks [N, row bytes] of format `ggml_type`, transposed."""
    n = blocks.shape[0]
    status = lib.gguf_gemm(ggml_type, x.data_ptr(), blocks.data_ptr(), out.data_ptr(), x.shape[0], n, k,
                           out.stride(0), abi.threads())
    if status != 0:  # formats and shapes were checked at load; what is left is a failed allocation
        raise MemoryError(f"gguf_gemm could not allocate block sums for a {x.shape[0]}x{k} input")


def dequantize(lib: abi.Kernels, ggml_type: int, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """blocks [N, row bytes] of format `ggml_type` -> float32 [N, K]."""
    out = torch.empty(blocks.shape[0], k)
    if lib.gguf_dequantize(ggml_type, blocks.data_ptr(), out.data_ptr(), blocks.shape[0], k, abi.threads()) != 0:
        raise ValueError(f"ggml type {ggml_type} with K={k} has no native dequantization")  # checked at load
    return out


class Segmented(LinearMethod):
    """A projection fused from parts the file stores in different formats (Gemma 3's q/k in Q5_0, v in
    Q8_0): each segment a Linear of its own (`layer.parts`) bound to the backend's method for its format,
    their outputs side by side."""

    name = "gguf"

    def __init__(self, method_for: Callable[[Linear], LinearMethod]):
        self.method_for = method_for

    def create(self, layer: Linear) -> None:
        layer.parts = nn.ModuleList(split_segments(layer))
        for i, part in enumerate(layer.parts):
            part.bind(self.method_for(part))
            delattr(layer, f"blocks{i}")

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([part(x) for part in layer.parts], dim=-1)
        return out if layer.bias is None else out + layer.bias

    def weight_struct(self, layer: Linear, lib: abi.Kernels) -> abi.Weight | None:
        """The decode stack's segments, where every part has a packed weight (kept alive on the layer)."""
        parts = [p.method.weight_struct(p, lib) if hasattr(p.method, "weight_struct") else None for p in layer.parts]
        if None in parts:
            return None
        array = layer.__dict__["parts_struct"] = (abi.Weight * len(parts))(*parts)
        return abi.Weight(kind=lib.weight_kind_segments, parts=len(parts), weight=ctypes.addressof(array),
                          n=layer.out_features)


def repackable(layer: Linear) -> bool:
    """One segment of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K whose columns tile by 16, activations
    in bf16 (the kernels')."""
    formats = layer.block_formats
    return (len(formats) == 1 and formats[0].name in REPACKED and layer.out_features % 16 == 0
            and getattr(layer, "dtype", None) == torch.bfloat16)


class Repacked(LinearMethod):
    """Blocks repacked for gemm.c's kernels (gguf_repack.py), multiplied in plain torch: tiles of rows
    dequantized to float32 as the torch twin computes them. The fallback of the native methods below,
    for rows their policy gives no kernel; a tied embedding's rows."""

    name = "gguf"

    def __init__(self, upcast: bool):
        self.upcast = upcast  # float32 GEMMs for large bf16 batches (CPUs without AMX)

    def create(self, layer: Linear) -> None:
        (rows,) = segments(layer)
        for name, tensor in repack(rows, in_place=True).items():  # the layer's blocks go with this method
            layer.register_buffer(name, tensor)
        del layer.blocks0

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], layer.out_features)
        step = max(16, DEQUANTIZE_TILE // layer.in_features // 16 * 16)
        for start in range(0, layer.out_features, step):
            tile = self.rows(layer, torch.arange(start, min(start + step, layer.out_features)))
            out[:, start:start + tile.shape[0]] = dense_linear(x, tile.to(x.dtype), None, self.upcast)
        return out if layer.bias is None else out.add_(layer.bias)

    def rows(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        return dequantized(selected(layer, ids))


class NativeBlocks(NativeNibbles, Repacked):
    """GGUF's formats repacked on nibbles (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) on gemm.c's int4
    kernels (`gemm_blocks*`) wherever the GemmPolicy gives int4 one, in the decode stack too."""

    def __init__(self, policy: GemmPolicy, upcast: bool):
        super().__init__(upcast)
        self.policy = policy


class NativeQ8(NativeCodes, Repacked):
    """Repacked Q8_0 on gemm.c's int8 loops with a float16 scale per group (`gemm_q8`): for the rows
    the policy gives int8 its loops, or at every row count where batch invariance asks it (it has no
    AMX form), and on its bf16 dot products (each code times its scale, rounded to bf16) where the
    policy gives int8 those; in the decode stack at every row count it serves."""

    def __init__(self, policy: GemmPolicy, upcast: bool):
        super().__init__(upcast)
        self.policy = policy

    def _kernel(self, layer: Linear, x: torch.Tensor) -> str | None:
        if x.dtype != torch.bfloat16:
            return None
        if self.policy.dots_serve("int8", x.shape[0]):
            return "dots"
        loops = self.policy.invariant or x.shape[0] < self.policy.native_max_rows("int8")
        return "avx512" if loops else None

    def native_mm(self, layer: Linear, x: torch.Tensor, kernel: str, silu: bool = False) -> torch.Tensor:
        return native_matmul(x, layer.packed, layer.packed_scale, kernel=kernel)

    def rows(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        lib = abi.kernels()
        if lib is None or ids.dtype != torch.int64:
            return super().rows(layer, ids)
        ids, out = ids.contiguous(), torch.empty(ids.numel(), layer.in_features)
        if lib.q8_rows(layer.packed.data_ptr(), layer.packed_scale.data_ptr(), ids.data_ptr(), ids.numel(),
                       layer.out_features, layer.in_features, out.data_ptr()):
            raise IndexError(f"token ids {ids.tolist()}: the table has rows [0, {layer.out_features})")
        return out

    def weight_struct(self, layer: Linear, lib: abi.Kernels) -> abi.Weight:
        return abi.Weight(kind=lib.weight_kind_q8, weight=layer.packed.data_ptr(),
                          scale=layer.packed_scale.data_ptr(), n=layer.out_features)
