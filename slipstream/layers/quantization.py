"""Quantized linear layers: weight-only int8 / int4, and int8 weights with int8 activations.

Single-stream decode reads every weight once per token, so its speed is bytes of weights
over memory bandwidth: int8 halves the bytes of bf16, int4 quarters them. For those two
methods the multiply runs in the native GEMM (kernels/gemm.c: integer dot products against
16-bit fixed-point activations, an error far below bf16's rounding of those activations)
where it is built, else in PyTorch's own CPU kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`); either way the weights' quantization is the only one that
counts. `w8a8` also quantizes activations to int8 (per token, at run time) so that batches
run on the int8 GEMM, which is the fastest arithmetic this CPU has; it costs more quality.

- int8: symmetric, one scale per output channel, w = q * s with q in [-127, 127].
- int4: asymmetric groups of INT4_GROUP_SIZE input channels (the layout of GGUF's Q4_1),
  w = q * s + m with q in [0, 15]; the kernel takes (s, m + 8s) per group.

Large batches (prefill chunks) are compute bound rather than bandwidth bound. With AMX the
packed codes go through the tile kernels at every size (int8 in integer tiles, int4 widened
to bf16 a panel at a time inside the kernel, layers/linear.py's `native_kernel`). Without
AMX the packed kernels are slower than a plain GEMM there, so from UPCAST_MIN_ROWS rows on
the weight is dequantized to fp32 for that call (layers/linear.py says why fp32).
Embedding tables stay in the model dtype (a lookup reads one row per token); a tied LM
head gets its own quantized copy. MoE experts (stacked weight tensors) are not quantized.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.config import QUANTIZATION_METHODS
from slipstream.layers.linear import UPCAST_MIN_ROWS, Linear, native_gemm_fits, native_kernel, native_matmul

INT4_GROUP_SIZE = 32


class _WeightOnlyLinear(nn.Module):
    """Subclasses hold the packed weight and provide `packed_mm(x, kernel, silu)` and `dequantized(dtype)`."""

    bias: torch.Tensor | None
    format: str  # the weight format's name in layers/linear.py's policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.native_kernel(x)
        if kernel is None and x.shape[0] >= UPCAST_MIN_ROWS:  # compute bound: dequantize, multiply in fp32
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.dequantized(torch.float32), bias).to(x.dtype)
        out = self.packed_mm(x, kernel)
        return out if self.bias is None else out + self.bias

    def fused_silu(self, x: torch.Tensor) -> torch.Tensor | None:
        """layers/linear.py's `silu_and_mul` in one AMX call when the policy for x is AMX, else None."""
        if self.native_kernel(x) != "amx" or self.bias is not None or self.packed.shape[0] % 2:
            return None
        return self.packed_mm(x, "amx", silu=True)

    def native_kernel(self, x: torch.Tensor) -> str | None:
        """The kernel of kernels/gemm.c for x (layers/linear.py's policy), None without a native packing."""
        if self.packed is None or x.dtype != torch.bfloat16:
            return None
        return native_kernel(self.format, x.shape[0], x.shape[1])


class Int8Linear(_WeightOnlyLinear):
    """With the native GEMM (kernels/gemm.c) bf16 batches multiply the codes in integer
    arithmetic, against 16-bit fixed-point activations; its codes are a second, packed copy."""

    format = "int8"

    def __init__(self, layer: nn.Linear):
        super().__init__()
        qweight, scale = _int8_per_channel(layer.weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(layer.weight.dtype))
        native = layer.weight.dtype == torch.bfloat16 and native_gemm_fits(qweight) and qweight.shape[1] % 4 == 0
        self.register_buffer("packed", _pack_quads(qweight) if native else None)
        self.register_buffer("scale_f32", scale.to(self.scale.dtype).float() if native else None)
        self.bias = layer.bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.qweight.to(dtype) * self.scale.to(dtype)[:, None]

    def packed_mm(self, x: torch.Tensor, kernel: str | None, silu: bool = False) -> torch.Tensor:
        if kernel is not None:
            return native_matmul(x, self.packed, self.scale_f32, kernel=kernel, silu=silu)
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scale.to(x.dtype))


class W8A8Linear(nn.Module):
    """int8 weights (per channel) times int8 activations (per token, scaled at run time).

    The int8 x int8 -> int32 GEMM (`torch._int_mm`, AVX512-VNNI) measured ~450 GOP/s per
    core of the development machine against ~125 GFLOP/s for fp32 and ~72 for bf16, so compute-bound batches
    (prefill, batched decode) run several times faster than any float path here.
    """

    def __init__(self, layer: nn.Linear):
        super().__init__()
        qweight, scale = _int8_per_channel(layer.weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = layer.bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.qweight.to(dtype) * self.scale.to(dtype)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x_scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
        xq = torch.round(xf / x_scale).to(torch.int8)
        out = torch._int_mm(xq, self.qweight.t()).float().mul_(x_scale).mul_(self.scale)
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype)


def _pack_quads(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 -> [N/16, K/4, 16, 4]: quads of K steps of 16 output columns, each in the order
    k0 k2 k1 k3 (kernels/gemm.c)."""
    n, k = codes.shape
    return codes.view(n // 16, 16, k // 4, 4)[..., [0, 2, 1, 3]].transpose(1, 2).contiguous()


def _int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes [N, K] and float32 scales [N], one per output channel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


class Int4Linear(_WeightOnlyLinear):
    format = "int4"

    def __init__(self, layer: nn.Linear):
        super().__init__()
        n, k = layer.weight.shape
        w = layer.weight.detach().float().reshape(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1))
        # the kernel's tiled layout is private, so large batches dequantize from plain nibbles
        self.register_buffer("nibbles", q[:, 0::2] | (q[:, 1::2] << 4))
        # [groups, out_features, (scale, zero)] as the kernel wants; its zero point sits at q = 8
        self.register_buffer("scales_and_zeros", torch.stack([scale, low + 8 * scale], -1).transpose(0, 1)
                             .contiguous().to(layer.weight.dtype))
        native = layer.weight.dtype == torch.bfloat16 and native_gemm_fits(q)
        for name, value in zip(("packed", "packed_scale", "packed_low"), self._pack_native(q) if native else [None] * 3):
            self.register_buffer(name, value)
        self.bias = layer.bias

    def _pack_native(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For kernels/gemm.c: codes as [N/16, K/8, 16, 4] bytes, eight K steps per column's
        dword with nibbles in the order 0 2 4 6 1 3 5 7; scale and low (the group's minimum)
        [N/16, groups, 16] float32 from the kernel's own rounded values."""
        n, k = q.shape
        steps = q.view(n // 16, 16, k // 8, 8)[..., [0, 2, 4, 6, 1, 3, 5, 7]]
        packed = (steps[..., 0::2] | (steps[..., 1::2] << 4)).transpose(1, 2).contiguous()
        scale, zero = self.scales_and_zeros.float().unbind(-1)  # [groups, N]
        by_block = lambda t: t.view(t.shape[0], n // 16, 16).transpose(0, 1).contiguous()
        return packed, by_block(scale), by_block(zero - 8 * scale)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """(q - 8) * scale + zero, with the kernel's own (rounded) scales and zeros."""
        q = torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1).to(dtype)
        scale, zero = self.scales_and_zeros.to(dtype).transpose(0, 1).unbind(-1)
        q = q.reshape(*scale.shape, INT4_GROUP_SIZE)
        return ((q - 8) * scale[..., None] + zero[..., None]).flatten(1)

    def packed_mm(self, x: torch.Tensor, kernel: str | None, silu: bool = False) -> torch.Tensor:
        if kernel is not None:
            return native_matmul(x, self.packed, self.packed_scale, self.packed_low, kernel=kernel, silu=silu)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, INT4_GROUP_SIZE,
                                                          self.scales_and_zeros.to(x.dtype))


_QUANTIZED = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": W8A8Linear}


def quantize_linear_layers(model: nn.Module, method: str) -> int:
    """Replace every `Linear` of `model` with its quantized form; returns how many.

    With int4 the LM head is quantized to int8, as llama.cpp's 4-bit recipes keep the
    output matrix at 6-8 bits: on SmolLM2 a 4-bit head alone cost ~5% perplexity. With w8a8
    it keeps int8 weights but 16-bit activations (weight-only int8): int8 activations on the
    head alone cost 2.1 points of perplexity (512 tokens: +5.5% -> +3.4% over fp32), and the
    rest moved by a point with any last-bit change upstream (a norm's rounding, the bf16
    attention kernel), which put the test's 5% bound within the noise of the arithmetic.
    """
    if method not in _QUANTIZED:
        raise ValueError(f"quantization={method!r} is not supported; allowed: {', '.join(QUANTIZATION_METHODS)}")
    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear) and _fits(method, child):
                head = method in ("int4", "w8a8") and not parent_name and name == "lm_head"
                setattr(parent, name, (Int8Linear if head else _QUANTIZED[method])(child))
                replaced += 1
    return replaced


def _fits(method: str, layer: nn.Linear) -> bool:
    return method != "int4" or layer.in_features % INT4_GROUP_SIZE == 0
