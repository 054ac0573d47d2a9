"""Linear layers, and the linear method a backend binds to each: its weight layout and GEMM.

A model builds `Linear`s and loads their weights as checkpoints store them; the backend then
binds every layer to a `LinearMethod` (backends/*: plain torch, packed native kernels, a
quantized format), which may turn the weight into its own layout once (`create`) and does
the multiply (`apply`). Model files never know which method serves them; methods never know
which model they serve.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod:
    """F.linear on the weight as loaded: the method every Linear has until a backend binds one."""

    name = "dense"

    def create(self, layer: Linear) -> None:
        """Turn `layer`'s loaded weight into this method's layout (buffers on the layer)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def fused_silu(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a fused [gate; up] layer in one call, where this method's GEMM
        can apply it in its epilogue for these rows; else None."""
        return None


DENSE = LinearMethod()


class Linear(nn.Linear):
    method: LinearMethod = DENSE
    quantized = True  # whether a model's quantization applies to this layer

    def bind(self, method: LinearMethod) -> None:
        method.create(self)
        self.method = method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


def silu_and_mul(projection: Linear, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused gate/up projection of x (its output is [gate | up]): one call
    where the projection's method fuses it (512-token SmolLM2 prefill on an AMX CPU: silu and
    the product took 8-10% of it), else the projection, then torch's two ops."""
    fused = projection.method.fused_silu(projection, x)
    if fused is not None:
        return fused
    gate, up = projection(x).chunk(2, dim=-1)
    return F.silu(gate) * up
