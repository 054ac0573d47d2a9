"""Quantized weight formats and their plain-torch linear methods: weight-only int8 / int4, and
int8 weights with int8 activations.

Single-stream decode reads every weight once per token, so its speed is bytes of weights
over memory bandwidth: int8 halves the bytes of bf16, int4 quarters them. For those two
methods the multiply runs here in PyTorch's own CPU kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`); the CPU backend's methods (backends/cpu/linear.py) extend
these with the native GEMMs on packed copies of the same codes (integer dot products
against 16-bit fixed-point activations, an error far below bf16's rounding of those
activations). Either way the weights' quantization is the only one that counts. `w8a8` also quantizes activations to int8 (per token, at run time) so that batches
run on the int8 GEMM, which is the fastest arithmetic this CPU has; it costs more quality.

- int8: symmetric, one scale per output channel, w = q * s with q in [-127, 127].
- int4: asymmetric groups of INT4_GROUP_SIZE input channels (the layout of GGUF's Q4_1),
  w = q * s + m with q in [0, 15]; the kernel takes (s, m + 8s) per group.

Large batches (prefill chunks) are compute bound rather than bandwidth bound, and PyTorch's
packed kernels are slower than a plain GEMM there, so from DEQUANTIZE_MIN_ROWS rows on the
weight is dequantized to fp32 for that call. A method replaces the layer's loaded weight by
its codes (`create`). Embedding tables stay in the model dtype (a lookup reads one row per
token); a tied LM head gets its own quantized copy. MoE experts (stacked weight tensors) are
not quantized.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.config import QUANTIZATION_METHODS
from slipstream.layers.gguf_linear import GGUFLinear, has_blocks
from slipstream.layers.linear import Linear, LinearMethod

INT4_GROUP_SIZE = 32  # int4 groups along K: the layout of GGUF's Q4_1
DEQUANTIZE_MIN_ROWS = 128


def quantization_of(name: str, layer: Linear, quantization: str | None) -> str | None:
    """A layer's format under the model's `quantization`.

    With int4 the LM head is int8, as llama.cpp's 4-bit recipes keep the output matrix at
    6-8 bits: on SmolLM2 a 4-bit head alone cost ~5% perplexity. With w8a8 it keeps int8
    weights but 16-bit activations (weight-only int8): int8 activations on the head alone cost
    2.1 points of perplexity (512 tokens: +5.5% -> +3.4% over fp32), and the rest moved by a
    point with any last-bit change upstream (a norm's rounding, the bf16 attention kernel),
    which put the test's 5% bound within the noise of the arithmetic. A layer whose inputs do
    not split into int4 groups stays dense. With gguf a layer runs its file's blocks (every
    layer that has them: the loader attaches blocks only when loading as stored); a matrix the
    file keeps in float stays dense.
    """
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={quantization!r} is not supported; allowed: {', '.join(QUANTIZATION_METHODS)}")
    if has_blocks(layer):
        return "gguf"
    if quantization == "gguf" or not layer.quantized:
        return None
    if quantization in ("int4", "w8a8") and name == "lm_head":
        return "int8"
    if quantization == "int4" and layer.in_features % INT4_GROUP_SIZE:
        return None
    return quantization


def replace_weight(layer: Linear, **buffers: torch.Tensor) -> None:
    """The layer's loaded weight gives way to a format's tensors (a tied head's embedding keeps its own)."""
    layer.weight = None
    for name, value in buffers.items():
        layer.register_buffer(name, value)


def _plus_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias


class WeightOnly(LinearMethod):
    """Codes in memory, 16-bit activations: subclasses provide `dequantized` and `packed_mm`."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= DEQUANTIZE_MIN_ROWS:  # compute bound: dequantize, multiply in fp32
            bias = None if layer.bias is None else layer.bias.float()
            return F.linear(x.float(), self.dequantized(layer, torch.float32), bias).to(x.dtype)
        return _plus_bias(self.packed_mm(layer, x), layer.bias)

    def dequantized(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def packed_mm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8(WeightOnly):
    name = "int8"

    def create(self, layer: Linear) -> None:
        qweight, scale = int8_per_channel(layer.weight)
        replace_weight(layer, qweight=qweight, scale=scale.to(layer.weight.dtype))

    def dequantized(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        return layer.qweight.to(dtype) * layer.scale.to(dtype)[:, None]

    def packed_mm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.scale.to(x.dtype))


class Int4(WeightOnly):
    name = "int4"

    def create(self, layer: Linear) -> None:
        n, k = layer.weight.shape
        w = layer.weight.detach().float().reshape(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
        replace_weight(
            layer, qweight=torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1),
            # the kernel's tiled layout is private, so large batches dequantize from plain nibbles
            nibbles=q[:, 0::2] | (q[:, 1::2] << 4),
            # [groups, out_features, (scale, zero)] as the kernel wants; its zero point sits at q = 8
            scales_and_zeros=torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()
            .to(layer.weight.dtype))

    @staticmethod
    def codes(layer: Linear) -> torch.Tensor:
        """The layer's 4-bit codes, one uint8 per weight [N, K]."""
        return torch.stack([layer.nibbles & 15, layer.nibbles >> 4], dim=-1).flatten(1)

    def dequantized(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        """(q - 8) * scale + zero, with the kernel's own (rounded) scales and zeros."""
        scale, zero = layer.scales_and_zeros.to(dtype).transpose(0, 1).unbind(-1)
        q = self.codes(layer).to(dtype).reshape(*scale.shape, INT4_GROUP_SIZE)
        return ((q - 8) * scale[..., None] + zero[..., None]).flatten(1)

    def packed_mm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.qweight, INT4_GROUP_SIZE,
                                                          layer.scales_and_zeros.to(x.dtype))


class W8A8(Int8):
    """int8 weights (per channel, float32 scales) times int8 activations (per token, scaled at run time).

    The int8 x int8 -> int32 GEMM (`torch._int_mm`, AVX512-VNNI) measured ~450 GOP/s per
    core of the development machine against ~125 GFLOP/s for fp32 and ~72 for bf16, so compute-bound batches
    (prefill, batched decode) run several times faster than any float path here.
    """

    name = "w8a8"

    def create(self, layer: Linear) -> None:
        qweight, scale = int8_per_channel(layer.weight)
        replace_weight(layer, qweight=qweight, scale=scale)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x_scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
        xq = torch.round(xf / x_scale).to(torch.int8)
        out = torch._int_mm(xq, layer.qweight.t()).float().mul_(x_scale).mul_(layer.scale)
        return _plus_bias(out, layer.bias).to(x.dtype)


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes [N, K] and float32 scales [N], one per output channel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


QUANTIZED = {"int8": Int8(), "int4": Int4(), "w8a8": W8A8(), "gguf": GGUFLinear()}  # the plain-torch method of each format
