"""RMSNorm, normalised in float32 like the reference implementations.

Where the learned scale is applied is part of each family's numerics, and the reference
tests hold each one to it:
- llama (default): the normalised rows are cast to x's dtype, then scaled by `weight`;
- `cast_last` (Gemma 4): scaled by `weight` in float32, cast last;
- `unit_offset` (Gemma 3, cast last too): scaled by (1 + weight) in float32;
- `rms_norm`: no learned scale (Gemma 4's values and router input), cast last.

bf16 rows on the CPU go through the native kernel (kernels/norm.c), in every form with a learned
scale: one call where torch runs five to ten ops on a single decode row; it rounds as the torch
path does (the sum of squares may add in another order).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.backends.cpu import abi


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, cast_last: bool = False, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.cast_last = cast_last or unit_offset
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = abi.kernels() if _native(x, self.weight) else None
        if lib is not None:  # copying a strided x (q/k heads) costs less than torch's ops on it
            return self._kernel(lib, x.contiguous())
        if self.cast_last:
            scale = self.weight.float() + 1.0 if self.unit_offset else self.weight.float()
            return (_normalized(x, self.eps) * scale).to(x.dtype)
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)  # one fused kernel, not five ops
        return self.weight * normed.to(x.dtype)

    def _kernel(self, lib: abi.Kernels, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        args = (x.data_ptr(), self.weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], self.eps)
        if self.cast_last:
            lib.rms_norm_cast_last_bf16(*args, float(self.unit_offset), abi.threads())
        else:
            lib.rms_norm_bf16(*args, abi.threads())
        return out


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a learned scale, computed in float32, returned in x's dtype."""
    return _normalized(x, eps).to(x.dtype)


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _native(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.is_grad_enabled())
