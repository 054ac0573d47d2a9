"""Attention that reads TurboQuant codes directly, for mixed prefill/decode batches.

Queries are scaled by the cache's fixed per-channel key scale and rotated once per step;
key scores come from the codes (centroid gather in the rotated space, plus the QJL term for
`-qjl` keys); values are accumulated in the rotated space and rotated back once per query
row. The cache is never dequantized to the original space. A backend may pass kernels for
the decode queries and for prefill chunks over a cached prefix (the CPU's read each
sequence's own blocks' packed codes, no gather or padding: backends/cpu/attention.py);
otherwise the same math runs in torch (`TurboQuantizer.scores` / `weighted_sum`), which
kernels are tested against. A prefill chunk with no cached prefix attends to its own fresh
K/V (as every engine does); every other query reads the codes, its chunk's own tokens too.

With R recent and S sink tokens (kvcache/recent_window.py), a query at position p reads every
token t <= p with t > p - R or t < S in 16 bits instead: the step's own tokens from the fresh
k/v, older ones from the cache's staging blocks where they have one (else from the codes). Each token is scored
exactly once; code and 16-bit logits share one softmax (the codes hold k - mu, so <q, mu> is
taken off the 16-bit logits). A kernel applies the same rule token by token, reading staged
tokens from the staging blocks and the query's own from the fresh k/v.
"""
from __future__ import annotations

import math

import torch

from slipstream.attention import reference
from slipstream.attention.metadata import AttentionMetadata, PrefillChunk
from slipstream.kvcache.recent_window import RecentWindow
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                    meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                    decode_kernel=None, prefill_kernel=None) -> torch.Tensor:
    """As reference.paged_attention, on the codes; `decode_kernel(q [B, Hk, G, D], k, v, cache,
    tables, lens, scale, window)` is a backend's kernel for the decode queries and
    `prefill_kernel(q [n, Hk, G, D], k, v, cache, chunk, scale, window)` for a chunk over a
    cached prefix (either returns None: declined)."""
    if not cache.calibrated:
        return _calibration_attention(q, k, v, cache, scale, sliding_window)
    cache.write(k, v, meta.slot_mapping)
    if cache.window is not None:
        _stage(cache.window, k, v, meta)
    out = torch.empty_like(q)
    n = meta.num_decodes
    if n:
        out[:n] = _decode(q[:n], k[:n], v[:n], cache, meta, scale, sliding_window, decode_kernel)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        if chunk.context_len == chunk.length:
            fresh_k, fresh_v = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            out[rows] = reference.prefill_attention(q[rows], fresh_k, fresh_v, chunk, scale, sliding_window)
        else:
            out[rows] = _prefill(q[rows], k[rows], v[rows], cache, chunk, scale, sliding_window, prefill_kernel)
    return out


def _calibration_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                           scale: float, sliding_window: int | None) -> torch.Tensor:
    """The calibration prompt (one sequence, prefill only) attends exactly to everything it has seen."""
    keys, values = cache.observe(q, k, v)
    chunk = PrefillChunk(0, len(q), keys.shape[1], block_table=None)
    return reference.prefill_attention(q, keys.to(q.dtype), values.to(q.dtype), chunk, scale, sliding_window)


def _stage(window: RecentWindow, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Mirror new tokens whose block stays in its sequence's window; keep every window's blocks."""
    active, in_window = [], []
    for row, end in enumerate(meta.context_lens):
        length, table = meta.query_start[row + 1] - meta.query_start[row], meta.block_table[row]
        first, sinks = window.first_block(end), window.sink_blocks
        active += table[:min(sinks, first)].tolist() + table[first:math.ceil(end / window.block_size)].tolist()
        in_window += [not sinks <= p // window.block_size < first for p in range(end - length, end)]
    window.write(k, v, meta.slot_mapping, torch.tensor(in_window, device=k.device), active)


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
            meta: AttentionMetadata, scale: float, window: int | None, decode_kernel=None) -> torch.Tensor:
    n, tables, lens = q.shape[0], meta.decode_block_tables, meta.decode_context_lens
    qg = q.view(n, cache.k.shape[2], -1, q.shape[-1])  # [B, Hk, G, D]
    out = None if decode_kernel is None else decode_kernel(qg, k, v, cache, tables, lens, scale, window)
    if out is None:
        tables = meta.narrow_decode_tables(cache.block_size)
        keys, values = cache.codes_by_head(tables)  # [B, Hk, L, nbytes]
        visible = reference.decode_mask(keys.shape[2], lens, window)  # [B, L]
        dense = None
        if cache.window is not None:
            visible = visible & ~_read_dense(cache.window, tables, lens)
            dense = _decode_dense(cache.window, k, v, tables, lens, window)
        out = _attend(qg, keys, values, visible[:, None, None, :], cache, scale, dense)
    return out.reshape(n, *q.shape[1:])


def _decode_dense(recent: RecentWindow, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
                  lens: torch.Tensor, window: int | None):
    """The 16-bit K/V [B, Hk, Ls+1, D] of each query's window (staged, then its own token) and their mask."""
    qpos = (lens - 1)[:, None]  # [B, 1]
    staged_k, staged_v, staged_pos, exists = _staged_decode_window(recent, tables, lens)  # [B, Ls, ...]
    staged_mask = exists & (staged_pos < qpos) & _near(staged_pos, qpos, recent, window)
    dense_k = torch.cat([staged_k, k[:, None].to(staged_k.dtype)], 1).transpose(1, 2)
    dense_v = torch.cat([staged_v, v[:, None].to(staged_v.dtype)], 1).transpose(1, 2)
    dense_mask = torch.cat([staged_mask, _near(qpos, qpos, recent, window)], 1)
    return dense_k, dense_v, dense_mask[:, None, None, :]


def _read_dense(recent: RecentWindow, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: code slots that each decode query reads in 16 bits instead (staged or its own, and near)."""
    qpos = (lens - 1)[:, None]
    pos = torch.arange(tables.shape[1] * recent.block_size, device=lens.device)
    return (recent.exists(tables) | (pos == qpos)) & _near(pos, qpos, recent, None)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
             chunk: PrefillChunk, scale: float, window: int | None, kernel=None) -> torch.Tensor:
    n, num_heads, dim = q.shape
    num_kv = cache.k.shape[2]
    group = num_heads // num_kv
    out = None if kernel is None else kernel(q.view(n, num_kv, group, dim), k, v, cache, chunk, scale, window)
    if out is not None:
        return out.view(n, num_heads, dim).to(q.dtype)
    length = chunk.context_len
    keys, values = cache.codes_by_head(chunk.block_table)
    keys, values = keys[:, :length], values[:, :length]  # [Hk, L, nb]
    qg = q.view(n, num_kv, group, dim).permute(1, 2, 0, 3).reshape(num_kv, -1, dim)  # [Hk, G*n, D]
    mask = reference.causal_mask(n, length, window, q.device)  # [n, L]
    dense = None
    if cache.window is not None:
        recent, start = cache.window, length - n
        pos = torch.arange(length, device=q.device)
        qpos = pos[start:, None]  # [n, 1]
        readable = recent.exists(chunk.block_table)[:length] | (pos >= start)
        mask = mask & ~(readable & _near(pos, qpos, recent, None))
        staged_k, staged_v, staged_pos, exists = _staged_prefill_window(recent, chunk)  # [Ls, ...]
        staged_mask = exists & _near(staged_pos, qpos, recent, window)
        dense_k = torch.cat([staged_k, k.to(staged_k.dtype)]).transpose(0, 1)  # [Hk, Ls+n, D]
        dense_v = torch.cat([staged_v, v.to(staged_v.dtype)]).transpose(0, 1)
        dense_mask = torch.cat([staged_mask, _near(pos[start:], qpos, recent, window)], 1)
        dense = (dense_k, dense_v, dense_mask.repeat(group, 1))
    out = _attend(qg, keys, values, mask.repeat(group, 1), cache, scale, dense)  # [Hk, G*n, D]
    return out.view(num_kv, group, n, dim).permute(2, 0, 1, 3).reshape(n, num_heads, dim).to(q.dtype)


def _staged_decode_window(window: RecentWindow, tables: torch.Tensor, lens: torch.Tensor):
    """Staged K/V [B, W*bs, Hk, D], positions and existence [B, W*bs] of the blocks each window reaches."""
    width = math.ceil(window.tokens / window.block_size) + 1 if window.tokens else 0
    first = ((lens - window.tokens).clamp_min(0) // window.block_size)[:, None]
    sinks = torch.arange(window.sink_blocks, device=lens.device)
    sinks = torch.where(sinks < first, sinks, tables.shape[1])  # already in the recent part: moved past the table
    index = torch.cat([sinks, first + torch.arange(width, device=lens.device)], 1)  # past the table: masked by position
    blocks = tables.gather(1, index.clamp_max(tables.shape[1] - 1))
    return (*window.gather(blocks), _positions(index, window.block_size), window.exists(blocks))


def _staged_prefill_window(window: RecentWindow, chunk: PrefillChunk):
    """Staged K/V [Ls, Hk, D], positions and existence [Ls] of the cached-prefix blocks the chunk reaches."""
    prefix = chunk.context_len - chunk.length
    first = max(0, prefix + 1 - window.tokens) // window.block_size
    device = chunk.block_table.device
    index = torch.cat([torch.arange(min(window.sink_blocks, first), device=device),
                       torch.arange(first, math.ceil(prefix / window.block_size), device=device)])
    blocks = chunk.block_table[index]
    positions = _positions(index, window.block_size)
    return (*window.gather(blocks), positions, window.exists(blocks) & (positions < prefix))


def _positions(block_index: torch.Tensor, block_size: int) -> torch.Tensor:
    offsets = torch.arange(block_size, device=block_index.device)
    return (block_index[..., None] * block_size + offsets).flatten(-2)


def _near(tpos: torch.Tensor, qpos: torch.Tensor, window: RecentWindow, sliding: int | None) -> torch.Tensor:
    """t in (p - R, p] or one of the first sink tokens (t <= p), and inside the sliding window if any."""
    near = ((tpos > qpos - window.tokens) | (tpos < window.sinks)) & (tpos <= qpos)
    return near & (tpos > qpos - sliding) if sliding is not None else near


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
            cache: TurboQuantLayerCache, scale: float, dense=None) -> torch.Tensor:
    """q [..., Hk, M, D]; codes [..., Hk, L, nbytes]; dense (k, v [..., Hk, Ld, D], mask) or None."""
    q = q.float()
    scores = cache.key_quantizer.scores(q * cache.key_scale[:, None, :], keys) * scale  # <q*sigma, (k-mu)/sigma>
    scores = scores.masked_fill(~visible, float("-inf"))
    if dense is None:
        return cache.value_quantizer.weighted_sum(scores.softmax(-1), values)
    dense_k, dense_v, dense_mask = dense
    dense_scores = (q @ (dense_k.float() - cache.key_mean[:, None, :]).transpose(-1, -2)) * scale
    probs = torch.cat([scores, dense_scores.masked_fill(~dense_mask, float("-inf"))], -1).softmax(-1)
    length = scores.shape[-1]
    return (cache.value_quantizer.weighted_sum(probs[..., :length], values)
            + probs[..., length:] @ dense_v.float())
