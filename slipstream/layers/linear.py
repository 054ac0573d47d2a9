"""Linear layers that pick the faster bf16 GEMM on CPUs without AMX.

Measured on a Zen 5 core (AVX512-BF16, no AMX), torch 2.13, CPU time of one thread:
- large batches (prefill chunks, big expert groups): oneDNN's bf16 GEMM runs at 71-77
  GFLOP/s against ~125 for fp32, so batches of at least UPCAST_MIN_ROWS rows upcast to
  fp32 for the multiply (1.3-1.75x faster at 128-1024 rows, same fp32 accumulation,
  result returned in bf16);
- small batches (decode) are bound by reading the weights, where bf16's half-size weights
  win, and oneDNN reading a weight pre-packed into its blocked layout is 1.2-1.8x faster
  than `F.linear` on the plain weight at 1-16 rows. `prepack_weights` packs every
  `Linear` once after loading; the plain weight stays for the upcast path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.platform import cpu_has_amx

UPCAST_MIN_ROWS = 128


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if _bf16_without_amx(x) and x.shape[0] >= UPCAST_MIN_ROWS:
        bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), bias).to(x.dtype)
    return F.linear(x, weight, bias)


def _bf16_without_amx(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and not cpu_has_amx()


class Linear(nn.Linear):
    packed: torch.Tensor | None = None  # oneDNN's blocked copy of `weight`, set by prepack_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] < UPCAST_MIN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return linear(x, self.weight, self.bias)


def prepack_weights(model: nn.Module) -> None:
    """Give every bf16 CPU `Linear` of `model` a oneDNN-packed weight for small batches."""
    if cpu_has_amx() or not torch.backends.mkldnn.is_available():
        return
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu":
            module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
