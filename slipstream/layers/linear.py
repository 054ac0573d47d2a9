"""Linear layers that pick the faster bf16 GEMM on CPUs without AMX.

Measured on one core of the development machine (AVX512-BF16, no AMX), torch 2.13, CPU time of one thread:
- large batches (prefill chunks, big expert groups): oneDNN's bf16 GEMM runs at 71-77
  GFLOP/s against ~125 for fp32, so batches of at least UPCAST_MIN_ROWS rows upcast to
  fp32 for the multiply (1.3-1.75x faster at 128-1024 rows, same fp32 accumulation,
  result returned in bf16);
- small batches (decode) are bound by reading the weights, where bf16's half-size weights
  win. `prepack_weights` packs every `Linear` once after loading for the native GEMM
  (kernels/gemm.c: bf16 weights widened in registers, float32 FMAs), which beats
  oneDNN's packed bf16 kernel 1.5-2x at 1 row (it streams weights faster), 1.4-1.6x at
  8-64 rows, and the fp32 upcast below NATIVE_MAX_ROWS rows (measured crossover 256).
  Without it (no AVX-512, no compiler) oneDNN's own packed layout serves batches below
  UPCAST_MIN_ROWS, 1.2-1.8x faster than `F.linear` on the plain weight at 1-16 rows. The
  plain weight stays for the upcast path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.backends.cpu import abi
from slipstream.platform import cpu_has_amx

UPCAST_MIN_ROWS = 128
NATIVE_MAX_ROWS = 256


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if _bf16_without_amx(x) and x.shape[0] >= UPCAST_MIN_ROWS:
        bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), bias).to(x.dtype)
    return F.linear(x, weight, bias)


def _bf16_without_amx(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and not cpu_has_amx()


class Linear(nn.Linear):
    packed: torch.Tensor | None = None  # `weight` in a small-batch GEMM's layout, set by prepack_weights
    native: bool = False  # packed for kernels/gemm.c, else for oneDNN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.shape[0] >= (NATIVE_MAX_ROWS if self.native else UPCAST_MIN_ROWS):
            return linear(x, self.weight, self.bias)
        if not self.native:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        out = native_matmul(x, self.packed)
        return out if self.bias is None else out.add_(self.bias)


def prepack_weights(model: nn.Module) -> None:
    """Give every bf16 CPU `Linear` of `model` a packed weight for small batches."""
    if cpu_has_amx() or not torch.backends.mkldnn.is_available():
        return
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu":
            weight = module.weight.detach()
            module.native = native_gemm_fits(weight)
            module.packed = pack_columns(weight) if module.native else torch.ops.mkldnn._reorder_linear_weight(weight, None)


def pack_columns(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K, 16]: each K step of 16 output columns contiguous (gemm.c)."""
    n, k = weight.shape
    return weight.view(n // 16, 16, k).transpose(1, 2).contiguous()


def native_gemm_fits(weight: torch.Tensor) -> bool:
    """Whether kernels/gemm.c is built with a path for this ISA (AVX-512) and can tile `weight`'s columns."""
    lib = abi.kernels()
    fits = weight.shape[0] % 16 == 0 and weight.device.type == "cpu"
    return fits and lib is not None and lib.gemm_bf16_available() == 1


def native_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor | None = None,
                  low: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 times a packed weight, transposed: [M, N] bf16. The weight is bf16
    (`pack_columns`), int8 codes with a float32 `scale` per output column (`Int8Linear`),
    or 4-bit codes with `scale` and `low` per group and column (`Int4Linear._pack_native`)."""
    x = x.contiguous()
    blocks, k = packed.shape[0], x.shape[1]
    out = x.new_empty(x.shape[0], blocks * 16)
    lib = abi.kernels()
    args = (out.data_ptr(), x.shape[0], out.shape[1], k, abi.threads())
    if packed.dtype == torch.bfloat16:
        status = lib.gemm_bf16(x.data_ptr(), packed.data_ptr(), *args)
    elif low is None:
        status = lib.gemm_int8(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), *args)
    else:
        status = lib.gemm_int4(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), low.data_ptr(), *args)
    if status != 0:  # shapes were checked when packing; what is left is a failed allocation
        raise MemoryError(f"native GEMM could not allocate its copy of the {x.shape[0]}x{k} input")
    return out
