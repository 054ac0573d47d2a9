"""Backend: what serves each layer on this machine, bound once after the model is loaded.

A backend binds an implementation to every layer that has a choice: each `Linear` gets a
linear method (its weight layout and GEMM, for the layer's quantization), each `Attention`
an attention implementation for its cache's dtype, each `Experts` block an expert method;
the model runner asks it for a fused decode stack. Model files never name a backend, and a
backend never knows a model family beyond what its fused decode stack describes.

`describe()` says what was chosen and why (CPU flags, kernels built or not); the engine logs
it at start-up and `slipstream info` prints it.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from slipstream.layers.linear import Linear
from slipstream.layers.moe import Experts

LinearMethod = Callable[[torch.Tensor], torch.Tensor]
# attention(q, k, v, cache, metadata, scale, sliding_window) -> out
AttentionImpl = Callable[..., torch.Tensor]


class Backend:
    name = "backend"

    def __init__(self, device: torch.device):
        self.device = device

    # --- what a backend provides ---------------------------------------------------------
    def linear_method(self, layer: Linear, quantization: str | None) -> LinearMethod:
        raise NotImplementedError

    def attention(self, cache) -> AttentionImpl:
        raise NotImplementedError

    def experts_method(self, experts: Experts):
        raise NotImplementedError

    def decode_stack(self, model: nn.Module):
        """A callable (positions, x) -> bool running all of `model`'s decoder layers in one go
        for the steps it serves (True), or None where the backend has none."""
        return None

    def describe(self) -> list[str]:
        """Lines saying which implementation serves what, and why."""
        return [self.name]

    # --- binding ---------------------------------------------------------------------------
    def prepare(self, model: nn.Module, quantization: str | None) -> None:
        """Give every Linear and Experts block of a loaded model (on its device) its method."""
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                module.method = self.linear_method(module, quantization_of(name, module, quantization))
            elif isinstance(module, Experts):
                module.method = self.experts_method(module)

    def bind_attention(self, layers: list[nn.Module], caches: list) -> None:
        for attn, cache in zip(layers, caches, strict=True):
            attn.bind(cache, self.attention(cache))


INT4_GROUP_SIZE = 32  # int4 groups along K: the layout of GGUF's Q4_1


def quantization_of(name: str, layer: Linear, quantization: str | None) -> str | None:
    """A layer's format under the model's `quantization`: with int4 the LM head is int8, as
    llama.cpp's 4-bit recipes keep the output matrix at 6-8 bits (on SmolLM2 a 4-bit head alone
    cost ~5% perplexity), and a layer whose inputs do not split into int4 groups stays dense."""
    if quantization != "int4":
        return quantization
    if name == "lm_head":
        return "int8"
    return quantization if layer.in_features % INT4_GROUP_SIZE == 0 else None
