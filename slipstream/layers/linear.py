"""Linear layers that pick the faster GEMM for bf16 on CPUs without AMX.

On a Zen 5 core (AVX512-BF16, no AMX) torch 2.13's oneDNN bf16 GEMM measured 71-77
GFLOP/s against ~130 for fp32, while small batches (decode) are bound by reading the
weights, where bf16's half-size weights win. So batches of at least UPCAST_MIN_ROWS rows
(prefill chunks, big expert groups) upcast to fp32 for the multiply: 1.3-1.75x faster at
128-1024 rows, same fp32 accumulation as the bf16 kernel, result returned in bf16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.platform import cpu_has_amx

UPCAST_MIN_ROWS = 128


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[0] >= UPCAST_MIN_ROWS and not cpu_has_amx():
        bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), bias).to(x.dtype)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
