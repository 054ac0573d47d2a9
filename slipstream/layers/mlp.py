"""The gated MLP, down(act(gate(x)) * up(x)), and the activations chosen by config name.

gate and up are one fused matmul (`gate_up_proj`); under tensor parallelism each rank holds
a slice of the intermediate features (gate/up by rows, down by columns: one all-reduce). Dense layers, shared experts and
Gemma's MLPs are this module; routed experts (layers/moe.py) use the same activations.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.layers.linear import ColumnParallelLinear, RowParallelLinear, silu_and_mul

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu"):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is F.silu:  # the gate/up GEMM may apply it in its epilogue
            return self.down_proj(silu_and_mul(self.gate_up_proj, x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
