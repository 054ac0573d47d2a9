"""Attention over the paged KV cache, and the per-step metadata it reads.

`attend` picks the implementation that can read the layer's cache: plain torch over dense
K/V (`reference`), the native C decode kernel for bf16 caches on the CPU (`native`), or
attention on TurboQuant codes (`turboquant`).
"""
from __future__ import annotations

import torch

from slipstream.attention import native, reference, turboquant
from slipstream.attention.metadata import AttentionMetadata
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, meta: AttentionMetadata, scale: float,
           sliding_window: int | None = None) -> torch.Tensor:
    if isinstance(cache, TurboQuantLayerCache):
        impl = turboquant.paged_attention
    else:
        impl = native.paged_attention if native.supports(q, cache) else reference.paged_attention
    return impl(q, k, v, cache, meta, scale, sliding_window)
