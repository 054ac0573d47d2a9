"""ReferenceBackend: plain torch on any device, the reference every faster path is tested against.

Attention runs attention/reference.py over dense caches and attention/turboquant.py on
TurboQuant codes, linear layers F.linear (int8 / int4 / w8a8 on PyTorch's own quantized CPU
kernels, layers/quantization.py), MoE experts one expert at a time in the model dtype; there
is no fused decode stack.
"""
from __future__ import annotations

import torch

from slipstream.attention import reference, turboquant
from slipstream.backends.base import AttentionImpl, Backend
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache
from slipstream.layers.linear import DENSE, Linear, LinearMethod
from slipstream.layers.moe import Experts, ExpertsMethod
from slipstream.layers.quantization import QUANTIZED


class ReferenceBackend(Backend):
    name = "reference"

    def linear_method(self, layer: Linear, fmt: str | None) -> LinearMethod:
        return DENSE if fmt is None else QUANTIZED[fmt]

    def attention(self, cache) -> AttentionImpl:
        return turboquant.paged_attention if isinstance(cache, TurboQuantLayerCache) else reference.paged_attention

    def experts_method(self, experts: Experts) -> ExpertsMethod:
        return Experts.method

    def describe(self) -> list[str]:
        where = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else str(self.device)
        return [f"backend {self.name}: plain torch on {where}",
                "attention: torch over dense caches, torch on TurboQuant codes; linear: F.linear"]
