"""CpuBackend: the native C kernels where they are built and win, plain torch elsewhere.

Which paths run follows from the CpuCapability alone (flags, kernels built and for which
ISA), so the choice is made once and can be tested for any CPU: attention on bf16 caches and
on TurboQuant codes through the decode kernels (backends/cpu/attention.py); otherwise the
reference's torch paths.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from slipstream.attention import reference, turboquant
from slipstream.backends.base import AttentionImpl
from slipstream.backends.cpu.attention import dense_decode, turboquant_decode
from slipstream.backends.cpu.capability import CpuCapability
from slipstream.backends.reference import ReferenceBackend
from slipstream.kvcache.cache import LayerKVCache
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache
from slipstream.layers.linear import prepack_weights


class CpuBackend(ReferenceBackend):
    def __init__(self, capability: CpuCapability):
        super().__init__(torch.device("cpu"))
        self.capability = capability

    @property
    def name(self) -> str:
        return f"cpu-{self.capability.level}"

    def attention(self, cache) -> AttentionImpl:
        if self.capability.kernels is not None:
            if isinstance(cache, TurboQuantLayerCache):
                return functools.partial(turboquant.paged_attention, decode_kernel=turboquant_decode)
            if isinstance(cache, LayerKVCache) and cache.k.dtype == torch.bfloat16:
                return functools.partial(reference.paged_attention, decode_kernel=dense_decode)
        return super().attention(cache)

    def prepare(self, model: nn.Module, quantization: str | None) -> None:
        super().prepare(model, quantization)
        prepack_weights(model)

    def describe(self) -> list[str]:
        native = self.capability.kernels is not None
        return [f"backend {self.name}: {self.capability.summary()}",
                "attention: " + ("native decode kernels on bf16 caches and TurboQuant codes, torch for prefill"
                                 if native else "torch")]
