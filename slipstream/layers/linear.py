"""Linear layers, and the linear method a backend binds to each: its weight layout and GEMM.

A model builds `Linear`s and loads their weights as checkpoints store them; the backend then
binds every layer to a `LinearMethod` (backends/*: plain torch, packed native kernels, a
quantized format), which may turn the weight into its own layout once (`create`) and does
the multiply (`apply`). Model files never know which method serves them; methods never know
which model they serve.

Under tensor parallelism (distributed/) a `ColumnParallelLinear` holds a slice of the output
features of each projection it fuses and a `RowParallelLinear` a slice of the input features,
summing the ranks' partial outputs; the backend binds their GEMMs as any other layer's, on
the local weight. With one rank both are a plain `Linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.distributed.parallel_state import all_reduce, split, tp_rank, tp_size
from slipstream.distributed.shard import Shard, set_shards


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


class ColumnParallelLinear(Linear):
    """Each rank holds `parts[i]` = (start, length) of the output features of fused projection i
    (its checkpoint tensor of `output_sizes[i]` rows); the default is an even split."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 parts: list[tuple[int, int]] | None = None):
        parts = parts or [even_part(n) for n in output_sizes]
        super().__init__(input_size, sum(n for _, n in parts), bias=bias)
        if tp_size() > 1:
            offsets = [sum(output_sizes[:i]) for i in range(len(parts))]
            shards = {i: Shard(0, (part,)) for i, part in enumerate(parts)}
            shards[None] = Shard(0, tuple((offset + start, n) for offset, (start, n) in zip(offsets, parts)))
            for param in (self.weight, self.bias):
                if param is not None:
                    set_shards(param, shards)


class RowParallelLinear(Linear):
    """Each rank holds a slice of the input features (`part` = (start, length), default an even
    split) and multiplies its slice of x; the sum over ranks (one all-reduce of [T, output_size])
    is the layer's output. Rank 0 alone adds the bias."""

    def __init__(self, input_size: int, output_size: int, bias: bool, part: tuple[int, int] | None = None):
        start, length = part or even_part(input_size)
        super().__init__(length, output_size, bias=bias)
        if tp_size() > 1:
            set_shards(self.weight, {None: Shard(1, ((start, length),))})
            if bias:
                set_shards(self.bias, {None: Shard(0, ((0, output_size),) if tp_rank() == 0 else (), output_size)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.method.apply(self, x))


def even_part(size: int) -> tuple[int, int]:
    """(start, length) of this rank's equal share of `size` features."""
    length = split(size, "a layer's features")
    return tp_rank() * length, length


def silu_and_mul(projection: Linear, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused gate/up projection of x (its output is [gate | up]): one call
    where the projection's method fuses it (512-token SmolLM2 prefill on an AMX CPU: silu and
    the product took 8-10% of it), else the projection, then torch's two ops."""
    fused = projection.method.fused_silu(projection, x)
    if fused is not None:
        return fused
    gate, up = projection(x).chunk(2, dim=-1)
    return F.silu(gate) * up
