"""The CPU backend's method for GGUF weights as stored: kernels/gguf_gemm.c on the file's blocks.

Below DEQUANTIZE_MIN_ROWS rows (decode, small batches) every segment of a layer's blocks is
multiplied in place by the native GEMM (codes widened to float32 in registers, the format's
scales per group: see the kernel's header), writing its columns of the output directly. From
there on (prefill) the GEMM is compute bound and the dense GEMMs win, so the kernel dequantizes
tiles of DEQUANTIZE_TILE weights to float32 and oneDNN multiplies them in the activations' dtype
(bf16 on AMX tiles here): only a tile is ever widened, never the layer. Without kernels
(SLIPSTREAM_NATIVE=0, no compiler) the torch twin in layers/gguf_linear.py serves, which is also
the reference the tests hold the kernels to. This module never knows files or models.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.backends.cpu import abi
from slipstream.layers.gguf_linear import BlockRows, GGUFLinear, segments
from slipstream.layers.linear import Linear

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
