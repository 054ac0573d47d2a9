"""Paged attention in plain torch, for mixed batches of prefill chunks and decode tokens.

Decode tokens are handled together: their contexts are gathered through padded block
tables and masked by length. Each prefill chunk attends causally to its cached prefix and
to itself. Nothing here assumes a CPU; it is the portable path that faster kernels are
tested against, and a backend may hand it a faster kernel for the decode queries.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from slipstream.attention.metadata import AttentionMetadata, PrefillChunk
from slipstream.kvcache.cache import LayerKVCache


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                    meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                    decode_kernel=None) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hk, D] for the step's new tokens. Returns [T, Hq, D].

    `decode_kernel(q, cache, meta, scale, window)`, if given, attends the decode queries (a
    backend's kernel); where it returns None they take the torch path."""
    cache.write(k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    n = meta.num_decodes
    if n:
        fast = None if decode_kernel is None else decode_kernel(q[:n], cache, meta, scale, sliding_window)
        out[:n] = decode(q[:n], cache, meta, scale, sliding_window) if fast is None else fast
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        out[rows] = prefill(q[rows], k[rows], v[rows], cache, chunk, scale, sliding_window)
    return out


def decode(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float,
            window: int | None) -> torch.Tensor:
    keys, values = cache.gather_batch(meta.narrow_decode_tables(cache.block_size), q.dtype)  # [Hk, B, L, D]
    batch, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[0]
    # heads lead the batch dims so that every matmul operand is contiguous
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)  # [Hk, B, G, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [Hk, B, G, L]
    key = ("decode_hidden", keys.shape[2], window)
    if key not in meta.step_cache:  # once per step, not once per layer
        meta.step_cache[key] = ~decode_mask(keys.shape[2], meta.decode_context_lens, window)[None, :, None, :]
    scores.masked_fill_(meta.step_cache[key], float("-inf"))
    probs = scores.softmax(-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [Hk, B, G, D]
    return out.transpose(0, 1).reshape(batch, num_heads, head_dim)

def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
             chunk: PrefillChunk, scale: float, window: int | None) -> torch.Tensor:
    if chunk.context_len > chunk.length:
        skip = _blocks_before_window(chunk, window, cache.block_size)
        k, v = cache.gather(chunk.block_table[skip:], chunk.context_len - skip * cache.block_size, q.dtype)
    else:
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    return prefill_attention(q, k, v, chunk, scale, window)


def _blocks_before_window(chunk: PrefillChunk, window: int | None, block_size: int) -> int:
    """How many of the context's first blocks no query of the chunk sees through its sliding window. Gemma 3's
    sliding layers had attended over the whole context, all but 512 columns masked."""
    if window is None:
        return 0
    return max(0, chunk.context_len - chunk.length - window + 1) // block_size


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk, scale: float,
                      window: int | None) -> torch.Tensor:
    """Causal attention of a chunk's queries [n, Hq, D] over the end of its context k/v [Hk, L, D] (the whole
    context, or all that the sliding window reaches): the last n of the L are the chunk's own."""
    q_, k_, v_ = q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    length = k.shape[1]
    if window is None and length == chunk.length:
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
    key = ("causal blocks", window, length, q.dtype)
    if key not in chunk.memo:  # once per step, not per layer; SDPA would turn a bool mask into this each call
        visible = causal_mask(chunk.length, length, window, q.device)
        chunk.memo[key] = query_blocks(visible, q.dtype, split=window is not None)
    return blocked_attention(q_, k_, v_, chunk.memo[key], scale).squeeze(0).transpose(0, 1)


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where visible, -inf elsewhere: what SDPA makes of a bool mask at every call, made once."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, -math.inf)


# Query rows a sliding window's chunk attends at a time, each block over the columns its rows see: SDPA computes
# every masked column (Gemma 3's shapes, 1,024 rows over 512 + 1,024 columns, bf16, Zen 4: 66 -> 37 ms).
QUERY_BLOCK = 128


def query_blocks(visible: torch.Tensor, dtype: torch.dtype,
                 split: bool) -> list[tuple[slice, slice, torch.Tensor]]:
    """(rows, columns, additive mask) for `blocked_attention`: with `split`, blocks of QUERY_BLOCK rows over the
    span of columns some row of theirs sees (every row sees one at least); else all rows over all columns."""
    if not split:
        return [(slice(None), slice(None), additive_mask(visible, dtype))]
    blocks = []
    for start in range(0, visible.shape[0], QUERY_BLOCK):
        rows = slice(start, start + QUERY_BLOCK)
        seen = visible[rows].any(0).nonzero().flatten()
        columns = slice(int(seen[0]), int(seen[-1]) + 1)
        blocks.append((rows, columns, additive_mask(visible[rows, columns], dtype)))
    return blocks


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      blocks: list[tuple[slice, slice, torch.Tensor]], scale: float) -> torch.Tensor:
    """SDPA of q [1, H, n, D] over k/v [1, Hk, L, D] (grouped query heads) block by block: [1, H, n, Dv]."""
    return torch.cat([F.scaled_dot_product_attention(q[:, :, rows], k[:, :, columns], v[:, :, columns],
                                                     attn_mask=mask, scale=scale, enable_gqa=True)
                      for rows, columns, mask in blocks], 2)


def decode_mask(length: int, context_lens: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, L] bool: which of the L gathered slots each decode query (the last token) sees."""
    pos = torch.arange(length, device=context_lens.device)
    lens = context_lens.unsqueeze(1)
    visible = pos < lens
    if window is not None:
        visible &= pos >= lens - window
    return visible


def causal_mask(num_queries: int, context_len: int, window: int | None, device) -> torch.Tensor:
    """[Q, L] bool: query i sits at position context_len - num_queries + i."""
    q_pos = torch.arange(context_len - num_queries, context_len, device=device).unsqueeze(1)
    k_pos = torch.arange(context_len, device=device).unsqueeze(0)
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    return visible
