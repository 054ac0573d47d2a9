"""The gated MLP, down(act(gate(x)) * up(x)), and the activations chosen by config name.

gate and up are one fused matmul (`gate_up_proj`); under tensor parallelism each rank holds
a slice of the intermediate features (gate/up by rows, down by columns: one all-reduce). Dense layers, shared experts and
Gemma's MLPs are this module; routed experts (layers/moe.py) use the same activations. GELU's product on
bf16 CPU rows is the native kernel's (gemm.c's gelu_tanh_and_mul_bf16), which the fused decode stack calls
too, so that a token's activation is the same bits on either path (batch invariance).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.backends.cpu import abi
from slipstream.layers.linear import ColumnParallelLinear, RowParallelLinear, silu_and_mul


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


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
        gate_up = self.gate_up_proj(x)
        lib = abi.kernels() if self.act is gelu_tanh and _native(gate_up) else None
        if lib is not None and lib.gemm_bf16_available():
            act = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
            lib.gelu_tanh_and_mul_bf16(gate_up.data_ptr(), act.data_ptr(), *act.shape, abi.threads())
            return self.down_proj(act)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def _native(gate_up: torch.Tensor) -> bool:
    return (gate_up.dtype == torch.bfloat16 and gate_up.device.type == "cpu" and gate_up.dim() == 2
            and gate_up.is_contiguous() and not torch.is_grad_enabled())
