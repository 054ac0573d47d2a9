"""Attention that reads TurboQuant codes directly, for mixed prefill/decode batches.

Queries are rotated once per step inside `TurboQuantizer.scores`; key scores come from the
codes (centroid gather in the rotated space, plus the QJL term for `-qjl` keys); values are
accumulated in the rotated space and rotated back once per query row by `weighted_sum`.
The cache is never dequantized to the original space. A prefill chunk with no cached prefix
attends to its own fresh K/V (as every engine does); every other query reads the codes.
"""
from __future__ import annotations

import torch

from slipstream.attention import reference
from slipstream.attention.metadata import AttentionMetadata, PrefillChunk
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                    meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    cache.write(k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    n = meta.num_decode_tokens
    if n:
        keys, values = cache.gather_codes(meta.decode_block_tables)  # [B, L, Hk, nbytes]
        qg = q[:n].view(n, keys.shape[2], -1, q.shape[-1])  # [B, Hk, G, D]
        visible = reference.decode_mask(keys.shape[1], meta.decode_context_lens, sliding_window)
        out[:n] = _attend(qg, keys.transpose(1, 2), values.transpose(1, 2), visible[:, None, None, :],
                          cache, scale).reshape(n, *q.shape[1:])
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        if chunk.context_len == chunk.length:
            fresh_k, fresh_v = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            out[rows] = reference.prefill_attention(q[rows], fresh_k, fresh_v, chunk, scale, sliding_window)
        else:
            out[rows] = _prefill(q[rows], cache, chunk, scale, sliding_window)
    return out


def _prefill(q: torch.Tensor, cache: TurboQuantLayerCache, chunk: PrefillChunk, scale: float,
             window: int | None) -> torch.Tensor:
    keys, values = cache.gather_codes(chunk.block_table)
    keys, values = keys[:chunk.context_len].transpose(0, 1), values[:chunk.context_len].transpose(0, 1)  # [Hk, L, nb]
    n, num_heads, dim = q.shape
    num_kv = keys.shape[0]
    qg = q.view(n, num_kv, num_heads // num_kv, dim).permute(1, 2, 0, 3).reshape(num_kv, -1, dim)  # [Hk, G*n, D]
    mask = reference.causal_mask(n, chunk.context_len, window, q.device).repeat(num_heads // num_kv, 1)
    out = _attend(qg, keys, values, mask, cache, scale)  # [Hk, G*n, D]
    return out.view(num_kv, num_heads // num_kv, n, dim).permute(2, 0, 1, 3).reshape(n, num_heads, dim).to(q.dtype)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
            cache: TurboQuantLayerCache, scale: float) -> torch.Tensor:
    scores = cache.key_quantizer.scores(q, keys) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return cache.value_quantizer.weighted_sum(probs, values)

