"""Dense paged attention with decode queries through the native C kernel (kernels/paged_attention.c).

Each decode query reads its own blocks up to its own length, with no gather into a padded
batch; prefill chunks go through `reference`. Used for bf16 caches on the CPU when the
kernel is built; `reference` stays the path it is tested against.
"""
from __future__ import annotations

import ctypes

import torch

from slipstream.backends.cpu import build as kernels
from slipstream.attention import reference
from slipstream.attention.metadata import AttentionMetadata
from slipstream.kvcache.cache import LayerKVCache


def supports(q: torch.Tensor, cache) -> bool:
    return (isinstance(cache, LayerKVCache) and cache.k.dtype == torch.bfloat16 and q.dtype == torch.bfloat16
            and q.device.type == "cpu" and _kernel() is not None)


def _kernel():
    P, I32, I64 = kernels.PTR, kernels.I32, kernels.I64
    return kernels.function("paged_attention", "paged_decode_attention_bf16", P, P, P, P, P, P, I32, I32, I32, I32,
                            I64, I32, I32, kernels.F32, I64, I32, restype=ctypes.c_int)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                    meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    n = meta.num_decode_tokens
    if not n:
        return reference.paged_attention(q, k, v, cache, meta, scale, sliding_window)
    cache.write(k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    if not decode(q[:n], cache, meta, scale, sliding_window, out[:n]):
        out[:n] = reference.decode(q[:n], cache, meta, scale, sliding_window)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        out[rows] = reference.prefill(q[rows], k[rows], v[rows], cache, chunk, scale, sliding_window)
    return out


def decode(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float, window: int | None,
           out: torch.Tensor) -> bool:
    """Attention of decode queries q [B, Hq, D] into `out` (contiguous); False if the kernel declined."""
    q = q.contiguous()
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    kv_heads, num_blocks, block_size, dim = cache.k.shape
    status = _kernel()(q.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(), tables.data_ptr(),
                       lens.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1], kv_heads, dim, num_blocks,
                       block_size, tables.shape[1], scale, window or 0, kernels.threads())
    return status == 0
