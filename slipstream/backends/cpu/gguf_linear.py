"""The CPU backend's method for GGUF weights as stored: kernels/gguf_gemm.c on the file's blocks.

Every segment of a layer's blocks is multiplied in place by the native kernel (x quantized to
int8 per 32-block, integer dot products, the format's scales applied per group: see the
kernel's header), writing its columns of the output directly. Without kernels (SLIPSTREAM_NATIVE=0,
no compiler) the torch twin in layers/gguf_linear.py serves, which is also the reference the
tests hold the kernel to. This module never knows files or models.
"""
from __future__ import annotations

import torch

from slipstream.backends.cpu import abi
from slipstream.layers.gguf_linear import GGUFLinear, segments
from slipstream.layers.linear import Linear


class NativeGGUF(GGUFLinear):
    def __init__(self, lib: abi.Kernels):
        self.lib = lib

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().contiguous()
        out = xf.new_empty(xf.shape[0], layer.out_features)
        col = 0
        for rows in segments(layer):
            gguf_gemm(self.lib, xf, rows.fmt.ggml_type, rows.data, out[:, col:], layer.in_features)
            col += rows.data.shape[0]
        out = out if layer.bias is None else out.add_(layer.bias)
        return out.to(x.dtype)


def gguf_gemm(lib: abi.Kernels, x: torch.Tensor, ggml_type: int, blocks: torch.Tensor, out: torch.Tensor,
              k: int) -> None:
    """out[:, :N] = x [M, K] float32 times blocks [N, row bytes] of format `ggml_type`, transposed."""
    n = blocks.shape[0]
    status = lib.gguf_gemm(ggml_type, x.data_ptr(), blocks.data_ptr(), out.data_ptr(), x.shape[0], n, k,
                           out.stride(0), abi.threads())
    if status != 0:  # formats and shapes were checked at load; what is left is a failed allocation
        raise MemoryError(f"gguf_gemm could not allocate int8 codes for a {x.shape[0]}x{k} input")
