"""Linear layers and which GEMM serves how many rows, per weight format and CPU.

Without AMX, measured on one core of the development machine (AVX512-BF16, no AMX), torch
2.13, CPU time of one thread:
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

With AMX, the tile kernels of kernels/gemm.c read the same packed weights from AMX_MIN_ROWS
rows on, at every larger size (`native_kernel` is the whole policy; the measurements are at
AMX_MIN_ROWS). Large bf16 batches of shapes they cannot tile go to oneDNN, which uses AMX
itself, so nothing upcasts to fp32 there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.backends.cpu import abi
from slipstream.platform import cpu_has_amx

UPCAST_MIN_ROWS = 128
NATIVE_MAX_ROWS = 256
# From how many rows the AMX tile kernels beat the AVX-512 loops, per weight format, and the
# multiple of K they tile. benchmarks/gemm.py on the AMX machine (1 thread, cold weights,
# GFLOP/s AVX-512 / AMX) for SmolLM2's qkv, o, gate_up, down: bf16 at 4 rows 40/52, 37/32,
# 40/49, 34/31 and at 8 rows 54/67, 53/62, 56/62, 48/63; int8 at 4 rows 53/75, 42/39, 59/73,
# 47/39 and at 8 rows 81/135, 67/78, 79/78, 69/76; int4 at 8 rows 83/68, 61/60, 78/69, 63/56
# and at 16 rows 91/147, 80/105, 97/122, 78/120. One row streams weights equally fast either way.
AMX_MIN_ROWS = {"bf16": 8, "int8": 8, "int4": 16}
AMX_K_MULTIPLE = {"bf16": 32, "int8": 64, "int4": 32}


def native_kernel(fmt: str, rows: int, k: int) -> str | None:
    """Which kernel of kernels/gemm.c multiplies `rows` rows by a packed `fmt` weight ("bf16",
    "int8", "int4") of K input features: "amx", "avx512", or None when a torch path is faster."""
    if amx_serves(fmt, rows) and k % AMX_K_MULTIPLE[fmt] == 0:
        return "amx"
    return "avx512" if rows < (NATIVE_MAX_ROWS if fmt == "bf16" else UPCAST_MIN_ROWS) else None


def amx_serves(fmt: str, rows: int) -> bool:
    """Whether the AMX kernels take `rows` rows of `fmt` weights whose K they can tile."""
    return rows >= AMX_MIN_ROWS[fmt] and amx_gemm_available()


def amx_gemm_available() -> bool:
    """Whether kernels/gemm.c was built with its AMX kernels and Linux lets this process use the tiles."""
    lib = abi.kernels()
    return lib is not None and lib.gemm_amx_available() == 1


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
        if self.packed is None:
            return linear(x, self.weight, self.bias)
        if not self.native:
            if x.shape[0] >= UPCAST_MIN_ROWS:
                return linear(x, self.weight, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        kernel = native_kernel("bf16", x.shape[0], self.in_features)
        if kernel is None:
            return linear(x, self.weight, self.bias)
        out = native_matmul(x, self.packed, kernel=kernel)
        return out if self.bias is None else out.add_(self.bias)

    def fused_silu(self, x: torch.Tensor) -> torch.Tensor | None:
        """`silu_and_mul` in one AMX call when this layer's policy for x is AMX, else None."""
        if (self.native and self.bias is None and self.out_features % 32 == 0
                and native_kernel("bf16", x.shape[0], self.in_features) == "amx"):
            return native_matmul(x, self.packed, kernel="amx", silu=True)
        return None


def silu_and_mul(projection: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused gate/up projection of x (its output is [gate | up]). Where the
    projection's GEMM is an AMX kernel, one call whose epilogue applies the activation (from
    float32 sums, rounded once); else the projection, then torch's two ops. 512-token SmolLM2
    prefill on the AMX machine (1 thread): silu and the product took 8-10% of it."""
    fused = projection.fused_silu(x) if hasattr(projection, "fused_silu") else None
    if fused is not None:
        return fused
    gate, up = projection(x).chunk(2, dim=-1)
    return F.silu(gate) * up


def prepack_weights(model: nn.Module) -> None:
    """Give every bf16 CPU `Linear` of `model` a packed weight for small batches."""
    if not torch.backends.mkldnn.is_available():
        return
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu":
            weight = module.weight.detach()
            module.native = native_gemm_fits(weight)
            module.packed = pack_columns(weight) if module.native else torch.ops.mkldnn._reorder_linear_weight(weight, None)


def pack_columns(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/2, 16, 2]: each pair of K steps of 16 output columns contiguous (gemm.c)."""
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()


def native_gemm_fits(weight: torch.Tensor) -> bool:
    """Whether kernels/gemm.c is built with a path for this ISA (AVX-512) and can tile `weight`'s columns."""
    lib = abi.kernels()
    fits = weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0 and weight.device.type == "cpu"
    return fits and lib is not None and lib.gemm_bf16_available() == 1


def native_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor | None = None,
                  low: torch.Tensor | None = None, kernel: str = "avx512", silu: bool = False) -> torch.Tensor:
    """x [M, K] bf16 times a packed weight, transposed: [M, N] bf16, on `kernel` ("avx512" or
    "amx", see `native_kernel`). The weight is bf16 (`pack_columns`), int8 codes with a
    float32 `scale` per output column (`Int8Linear`), or 4-bit codes with `scale` and `low`
    per group and column (`Int4Linear._pack_native`). With `silu` (AMX only) the weight is a
    fused [gate; up] projection and the result silu(gate) * up, [M, N/2]."""
    x = x.contiguous()
    blocks, k = packed.shape[0], x.shape[1]
    out = x.new_empty(x.shape[0], blocks * (8 if silu else 16))
    lib = abi.kernels()
    args = (out.data_ptr(), x.shape[0], blocks * 16, k, abi.threads())
    suffix = ("_amx" if kernel == "amx" else "") + ("_silu" if silu else "")
    if packed.dtype == torch.bfloat16:
        status = getattr(lib, "gemm_bf16" + suffix)(x.data_ptr(), packed.data_ptr(), *args)
    elif low is None:
        status = getattr(lib, "gemm_int8" + suffix)(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), *args)
    else:
        status = getattr(lib, "gemm_int4" + suffix)(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), low.data_ptr(),
                                                    *args)
    if status != 0:  # shapes were checked when packing; what is left is a failed allocation
        raise MemoryError(f"native GEMM could not allocate its copy of the {x.shape[0]}x{k} input")
    return out
