"""The CUDA backend's attention implementations: a step's metadata in, the Triton kernels called.

Owns: writing the step's K/V into the cache, then one kernel call over every row of the step
(decode rows and prefill chunks together), and the choice of split-KV. Must never know models
or the scheduler; the kernels live in their own modules (paged_attention.py, ...), imported
here on first use so that importing the backend never needs triton.
"""
from __future__ import annotations

import torch

from slipstream.attention.metadata import AttentionMetadata
from slipstream.kvcache.cache import LayerKVCache


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                    meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """As attention/reference.paged_attention (the reference it is tested against), in one Triton kernel."""
    from slipstream.backends.cuda import paged_attention as kernel

    cache.write(k, v, meta.slot_mapping)
    starts = meta.query_start
    longest_query = max(b - a for a, b in zip(starts, starts[1:]))
    programs = len(meta.context_lens) * cache.k.shape[0]  # at least one query tile per row and KV head
    splits = kernel.choose_splits(programs, max(meta.context_lens))
    return kernel.paged_attention(q, cache.k, cache.v, meta.block_table, meta.seq_lens, meta.query_start_loc,
                                  scale, sliding_window, longest_query, splits)
