"""The CUDA backend's attention implementations: a step's metadata in, the Triton kernels called.

Owns: over dense caches, writing the step's K/V, then one kernel call over every row of the
step (decode rows and prefill chunks together) and the choice of split-KV; over TurboQuant
codes, the encoder that writes them and the decode and prefill-over-a-cached-prefix kernels that attention/turboquant.py calls
(it keeps calibration, staging of the 16-bit window and fresh prompts), with the queries'
rotation into code space before and the values' rotation back after. Must never know models
or the scheduler; the kernels live in their own modules (paged_attention.py,
turboquant_attention.py), imported here on first use so that importing the backend never
needs triton.
"""
from __future__ import annotations

import itertools

import torch

from slipstream.attention.metadata import AttentionMetadata, PrefillChunk
from slipstream.kvcache.cache import LayerKVCache
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                    meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """As attention/reference.paged_attention (the reference it is tested against), in one Triton kernel."""
    from slipstream.backends.cuda import paged_attention as kernel

    cache.write(k, v, meta.slot_mapping)
    starts = meta.query_start
    longest_query = max(b - a for a, b in itertools.pairwise(starts))
    programs = len(meta.context_lens) * cache.k.shape[0]  # at least one query tile per row and KV head
    splits = kernel.choose_splits(programs, max(meta.context_lens))
    return kernel.paged_attention(q, cache.k, cache.v, meta.block_table, meta.seq_lens, meta.query_start_loc,
                                  scale, sliding_window, longest_query, splits)


def turboquant_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                      tables: torch.Tensor, lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """attention/turboquant.py's decode_kernel: q [B, Hk, G, D], one query per row -> [B, Hk, G, D] float32."""
    starts = torch.arange(len(lens) + 1, device=q.device)
    longest = tables.shape[1] * cache.block_size  # a bound on every context, known without a host sync
    return _turboquant(q, k, v, cache, tables, lens, starts, scale, window, 1, longest)


def turboquant_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                       chunk: PrefillChunk, scale: float, window: int | None) -> torch.Tensor:
    """attention/turboquant.py's prefill_kernel: a chunk's queries q [n, Hk, G, D] over its cached prefix
    and itself (causal) -> [n, Hk, G, D] float32."""
    starts, lens = _chunk_rows(chunk, q.device)
    return _turboquant(q, k, v, cache, chunk.block_table[None], lens, starts, scale, window, chunk.length,
                       chunk.context_len)


def _chunk_rows(chunk: PrefillChunk, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """query_start_loc [0, n] and seq_lens [context] of a chunk on the device, made once per step for
    every layer (the chunk lives as long as the step's metadata): no host copy per layer."""
    if not hasattr(chunk, "device_rows"):
        rows = torch.tensor([0, chunk.length, chunk.context_len]).to(device, non_blocking=True)
        chunk.device_rows = (rows[:2], rows[2:])
    return chunk.device_rows


def _turboquant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                tables: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor, scale: float, window: int | None,
                longest_query: int, longest_context: int) -> torch.Tensor:
    """Queries mapped into key code space here, the kernel, then value code space back to channels."""
    from slipstream.backends.cuda import paged_attention
    from slipstream.backends.cuda import turboquant_attention as kernel

    to_keys, back = cache.decode_maps  # [Hk, D, Wk], [Hk, D, D]
    rows, heads, group, dim = q.shape
    q = q.float()
    q_rot = torch.einsum("nhgd,hdw->nhgw", q, to_keys)
    splits = paged_attention.choose_splits(len(lens) * heads, longest_context)
    code, dense = kernel.turboquant_attention(q.reshape(rows, heads * group, dim), q_rot.reshape(rows, heads * group, -1),
                                              k, v, cache, tables, lens, starts, scale, window, longest_query, splits)
    out = torch.einsum("nhgw,hwd->nhgd", code.view(rows, heads, group, -1)[..., :back.shape[1]], back)
    return (out if dense is None else out + dense.view(rows, heads, group, dim)).contiguous()


def turboquant_encode(rows: torch.Tensor, quantizer, x: torch.Tensor, slots: torch.Tensor,
                      mean: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> None:
    """TurboQuantLayerCache's encoder: the Triton kernel (turboquant_encode.py)."""
    from slipstream.backends.cuda import turboquant_encode as kernel

    kernel.encode(rows, quantizer, x, slots, mean, scale)
