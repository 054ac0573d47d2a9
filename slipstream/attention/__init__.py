"""Attention over the paged KV cache, and the per-step metadata it reads.

`attend` picks the implementation that can read the layer's cache: plain torch over dense
K/V (`reference`), or attention on TurboQuant codes (`turboquant`).
"""
from __future__ import annotations

import torch

from slipstream.attention import reference, turboquant
from slipstream.attention.metadata import AttentionMetadata
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, meta: AttentionMetadata, scale: float,
           sliding_window: int | None = None) -> torch.Tensor:
    impl = turboquant.paged_attention if isinstance(cache, TurboQuantLayerCache) else reference.paged_attention
    return impl(q, k, v, cache, meta, scale, sliding_window)
