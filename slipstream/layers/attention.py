"""Attention: one layer's attention over its paged KV cache.

It holds the layer's geometry (heads, KV heads, head size, and `key_rotation`: how fast the
keys it stores turn with position, which a TurboQuant cache's calibration needs), scale and
sliding window, and, once the cache is allocated, the layer's cache and the implementation the
backend chose for it (`bind`). `forward(q, k, v)` takes the step's rotated queries and new keys
and values; it fetches the step's metadata itself, so model code never sees batch bookkeeping.
It never knows projections, norms or how rotary embeddings are applied, nor which
implementation reads the cache.
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.attention.metadata import get_metadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, key_rotation: torch.Tensor | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # radians per position of channel pair (i, i + head_dim / 2) (rotate-half rotary); None: unrotated keys
        self.key_rotation = key_rotation
        self.kv_cache = self.impl = None

    def bind(self, cache, impl) -> None:
        """The layer's KV cache, and the attention(q, k, v, cache, metadata, scale, window) that reads it."""
        self.kv_cache, self.impl = cache, impl

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim].
        Writes k and v into the cache at the step's slots, then attends over each sequence's context."""
        return self.impl(q, k, v, self.kv_cache, get_metadata(), self.scale, self.sliding_window)
