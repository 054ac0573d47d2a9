"""Dense paged attention with decode queries through the native C kernel (kernels/paged_attention.c).

Each decode query reads its own blocks up to its own length, with no gather into a padded
batch; prefill chunks go through `reference`. Used for bf16 caches on the CPU when the
kernel is built; `reference` stays the path it is tested against.
"""
from __future__ import annotations

import torch

from slipstream.attention import reference
from slipstream.attention.metadata import AttentionMetadata
from slipstream.backends.cpu import abi
from slipstream.kvcache.cache import LayerKVCache


def supports(q: torch.Tensor, cache) -> bool:
    return (isinstance(cache, LayerKVCache) and cache.k.dtype == torch.bfloat16 and q.dtype == torch.bfloat16
            and q.device.type == "cpu" and abi.kernels() is not None)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                    meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    n = meta.num_decodes
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
    kv_heads, num_blocks, block_size, dim = cache.k.shape
    layer = abi.PagedAttention(cache.k.data_ptr(), cache.v.data_ptr(), num_blocks, window or 0, block_size,
                               q.shape[1], kv_heads, dim, scale)
    batch = decode_batch(q.shape[0], meta.decode_block_tables, meta.decode_context_lens)
    return abi.kernels().paged_decode_attention(layer, batch, q.data_ptr(), out.data_ptr()) == 0


def decode_batch(batch: int, tables: torch.Tensor, lens: torch.Tensor) -> abi.DecodeBatch:
    """The kernels' description of `batch` decode queries over contiguous int64 block tables
    [batch, max_blocks] and context lengths [batch]; the tensors must outlive the call."""
    return abi.DecodeBatch(batch, tables.data_ptr(), lens.data_ptr(), tables.shape[1], abi.threads())
