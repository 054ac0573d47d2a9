"""Attention kernels of the CPU backend: decode queries over a bf16 cache (kernels/paged_attention.c)
and decode queries and prefill chunks over TurboQuant codes (kernels/turboquant_attention.c).

Each sequence reads its own blocks up to its own length, with no gather into a padded batch.
They plug into the torch paths as their `decode_kernel` / `prefill_kernel`
(attention/reference.py, attention/turboquant.py), which attend whatever a kernel declines
(returns None) and stay what the kernels are tested against.
"""
from __future__ import annotations

import ctypes

import torch

from slipstream.attention.metadata import AttentionMetadata, PrefillChunk
from slipstream.backends.cpu import abi
from slipstream.kvcache.turboquant import TurboQuantizer
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache


def dense_decode(q: torch.Tensor, cache, meta: AttentionMetadata, scale: float,
                 window: int | None) -> torch.Tensor | None:
    """Attention of decode queries q [B, Hq, D] over a bf16 cache; None where the kernel declines."""
    if q.dtype != torch.bfloat16 or cache.k.dtype != torch.bfloat16:
        return None
    q = q.contiguous()
    out = torch.empty_like(q)
    kv_heads, num_blocks, block_size, dim = cache.k.shape
    layer = abi.PagedAttention(cache.k.data_ptr(), cache.v.data_ptr(), num_blocks, window or 0, block_size,
                               q.shape[1], kv_heads, dim, scale)
    batch = decode_batch(q.shape[0], meta.decode_block_tables, meta.decode_context_lens)
    return out if abi.kernels().paged_decode_attention(layer, batch, q.data_ptr(), out.data_ptr()) == 0 else None


def decode_batch(batch: int, tables: torch.Tensor, lens: torch.Tensor) -> abi.DecodeBatch:
    """The kernels' description of `batch` decode queries over contiguous int64 block tables
    [batch, max_blocks] and context lengths [batch]; the tensors must outlive the call."""
    return abi.DecodeBatch(batch, tables.data_ptr(), lens.data_ptr(), tables.shape[1], abi.threads())


def turboquant_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                      tables: torch.Tensor, lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor | None:
    """The C kernel on the codes (and on the 16-bit window's tokens, if any), q [B, Hk, G, D] -> [B, Hk, G, D]
    float32, one query per sequence; None where it does not run."""
    return _turboquant(q, k, v, cache, None, tables, lens, scale, window)


def turboquant_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                       chunk: PrefillChunk, scale: float, window: int | None) -> torch.Tensor | None:
    """The same kernel for a prefill chunk's queries q [n, Hk, G, D] over its cached prefix and itself (causal),
    k/v [n, Hk, D] its new tokens, already written; None where it does not run."""
    starts = torch.tensor([0, chunk.length])
    lens = torch.tensor([chunk.context_len])
    return _turboquant(q, k, v, cache, starts, chunk.block_table[None], lens, scale, window)


def _turboquant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                starts: torch.Tensor | None, tables: torch.Tensor, lens: torch.Tensor, scale: float,
                window: int | None) -> torch.Tensor | None:
    """q [rows, Hk, G, D]: sequence b's query rows are [starts[b], starts[b + 1]) (None: row b alone)."""
    lib = abi.kernels()
    recent = cache.window
    if (q.device.type != "cpu" or not (_has_slack(cache.k, lib) and _has_slack(cache.v, lib))
            or (recent is not None and recent.k.dtype not in _DENSE_DTYPES)):
        return None
    to_keys, back = cache.decode_maps
    heads, group, dim = q.shape[1:]
    q = q.float().contiguous()
    out = torch.empty_like(q)
    tables, lens = tables.to(torch.int64).contiguous(), lens.to(torch.int64).contiguous()
    keys, values = _code_rows(cache.k, cache.key_quantizer), _code_rows(cache.v, cache.value_quantizer)
    starts = None if starts is None else starts.to(torch.int64).contiguous()
    layer = abi.TurboQuantAttention(keys, values, to_keys.data_ptr(), back.data_ptr(), None,
                                    None if starts is None else starts.data_ptr(), window or 0, heads, group, dim,
                                    cache.block_size, scale)
    if recent is not None:
        k, v = k.to(recent.k.dtype).contiguous(), v.to(recent.v.dtype).contiguous()
        key_mean = cache.key_mean.contiguous()
        layer.dense = ctypes.pointer(abi.DenseTokens(
            recent.staging_of.data_ptr(), recent.k.data_ptr(), recent.v.data_ptr(), k.data_ptr(), v.data_ptr(),
            key_mean.data_ptr(), recent.tokens, recent.sinks, int(recent.k.dtype == torch.bfloat16)))
    batch = decode_batch(len(lens), tables, lens)
    status = lib.turboquant_paged_attention(layer, batch, q.data_ptr(), out.data_ptr())
    return out if status == 0 else None


def _code_rows(rows: torch.Tensor, quantizer: TurboQuantizer) -> abi.CodeRows:
    pieces, values = quantizer.row_layout  # cached on the quantizer: alive as long as the cache
    return abi.CodeRows(rows.data_ptr(), pieces.data_ptr(), values.data_ptr(), len(pieces), quantizer.nbytes,
                        quantizer.code_width)


_DENSE_DTYPES = (torch.bfloat16, torch.float32)  # the 16-bit window's dtypes the kernel reads


def _has_slack(rows: torch.Tensor, lib: abi.Kernels) -> bool:
    """The kernel's wide loads may run past the last row (turboquant_cache.row_slack)."""
    return rows.untyped_storage().nbytes() - rows.storage_offset() - rows.numel() >= lib.turboquant_row_slack


