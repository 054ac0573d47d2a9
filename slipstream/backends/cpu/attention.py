"""Attention kernels of the CPU backend: every query over a bf16 cache (kernels/paged_attention.c),
decode queries over TurboQuant codes (kernels/turboquant_attention.c).

Each query reads its own blocks up to its own length, with no gather into a padded batch.
On a bf16 cache a prefill chunk's queries go through the same kernel as decode queries, each
as if it were the last token of its sequence: a token's attention output is then the same
bits whether it was computed in a prefill chunk of any size, after a prefix-cache hit, after
preemption, or as a decode token (batch invariance), where torch's SDPA blocks keys by the
chunk's shape. The torch paths (attention/reference.py, attention/turboquant.py) serve what a
kernel declines and stay what the kernels are tested against; the TurboQuant kernel plugs
into its torch path as the `decode_kernel`.
"""
from __future__ import annotations

import ctypes

import torch

from slipstream.attention import reference
from slipstream.attention.metadata import AttentionMetadata
from slipstream.backends.cpu import abi
from slipstream.kvcache.turboquant import TurboQuantizer
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """attention/reference.py's `paged_attention` for a bf16 cache: the step's K/V written, then
    every query q [T, Hq, D] -> [T, Hq, D] in one call of the kernel (the torch path where the
    shapes are beyond it)."""
    lib = abi.kernels()
    kv_heads, _, block_size, dim = cache.k.shape
    if (lib is None or q.dtype != torch.bfloat16 or cache.k.dtype != torch.bfloat16
            or q.shape[1] // kv_heads > lib.paged_attention_max_group or dim > lib.paged_attention_max_head_dim
            or block_size > lib.paged_attention_max_block):
        return reference.paged_attention(q, k, v, cache, meta, scale, sliding_window)
    cache.write(k, v, meta.slot_mapping)
    return attend(q, cache, meta, scale, sliding_window)


def attend(q: torch.Tensor, cache, meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    """Each query of q [T, Hq, D] over its own context in a bf16 cache that holds the step's K/V,
    as the last token of that context: [T, Hq, D]. The caller checked the shapes."""
    q = q.contiguous()
    out = torch.empty_like(q)
    kv_heads, num_blocks, block_size, dim = cache.k.shape
    layer = abi.PagedAttention(cache.k.data_ptr(), cache.v.data_ptr(), num_blocks, window or 0, block_size,
                               q.shape[1], kv_heads, dim, scale)
    tables, lens = query_tables(meta)
    if abi.kernels().paged_decode_attention(layer, decode_batch(q.shape[0], tables, lens), q.data_ptr(),
                                            out.data_ptr()):
        raise ValueError(f"paged attention declined {q.shape[1]} heads over {kv_heads}, head size {dim}")
    return out


def query_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token's block table [T, W] and context length [T] (its position + 1), once per step."""
    key = "per-query tables"
    if key not in meta.step_cache:
        starts = meta.query_start
        query_lens = torch.tensor([b - a for a, b in zip(starts, starts[1:])])
        first = torch.tensor(meta.context_lens) - query_lens  # tokens before each row's first query
        offsets = torch.arange(starts[-1]) - torch.tensor(starts[:-1]).repeat_interleave(query_lens)
        lens = first.repeat_interleave(query_lens) + offsets + 1
        tables = meta.block_table.repeat_interleave(query_lens.to(meta.block_table.device), dim=0)
        meta.step_cache[key] = (tables.contiguous(), lens.to(torch.int64).contiguous())
    return meta.step_cache[key]


def decode_batch(batch: int, tables: torch.Tensor, lens: torch.Tensor) -> abi.DecodeBatch:
    """The kernels' description of `batch` decode queries over contiguous int64 block tables
    [batch, max_blocks] and context lengths [batch]; the tensors must outlive the call."""
    return abi.DecodeBatch(batch, tables.data_ptr(), lens.data_ptr(), tables.shape[1], abi.threads())


def turboquant_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                   tables: torch.Tensor, lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor | None:
    """The C kernel on the codes (and on the 16-bit window's tokens, if any), q [B, Hk, G, D] -> [B, Hk, G, D]
    float32; None where it does not run."""
    lib = abi.kernels()
    recent = cache.window
    if (q.device.type != "cpu" or not (_has_slack(cache.k, lib) and _has_slack(cache.v, lib))
            or (recent is not None and recent.k.dtype not in _DENSE_DTYPES)):
        return None
    to_keys, back = cache.decode_maps
    batch, heads, group, dim = q.shape
    q = q.float().contiguous()
    out = torch.empty_like(q)
    tables, lens = tables.to(torch.int64).contiguous(), lens.to(torch.int64).contiguous()
    keys, values = _code_rows(cache.k, cache.key_quantizer), _code_rows(cache.v, cache.value_quantizer)
    layer = abi.TurboQuantAttention(keys, values, to_keys.data_ptr(), back.data_ptr(), None, window or 0, heads, group,
                                    dim, cache.block_size, scale)
    if recent is not None:
        k, v = k.to(recent.k.dtype).contiguous(), v.to(recent.v.dtype).contiguous()
        key_mean = cache.key_mean.contiguous()
        layer.dense = ctypes.pointer(abi.DenseTokens(
            recent.staging_of.data_ptr(), recent.k.data_ptr(), recent.v.data_ptr(), k.data_ptr(), v.data_ptr(),
            key_mean.data_ptr(), recent.tokens, recent.sinks, int(recent.k.dtype == torch.bfloat16)))
    status = lib.turboquant_decode_attention(layer, decode_batch(batch, tables, lens), q.data_ptr(), out.data_ptr())
    return out if status == 0 else None


def _code_rows(rows: torch.Tensor, quantizer: TurboQuantizer) -> abi.CodeRows:
    pieces, values = quantizer.row_layout  # cached on the quantizer: alive as long as the cache
    return abi.CodeRows(rows.data_ptr(), pieces.data_ptr(), values.data_ptr(), len(pieces), quantizer.nbytes,
                        quantizer.code_width)


_DENSE_DTYPES = (torch.bfloat16, torch.float32)  # the 16-bit window's dtypes the kernel reads


def _has_slack(rows: torch.Tensor, lib: abi.Kernels) -> bool:
    """The kernel's wide loads may run past the last row (turboquant_cache.row_slack)."""
    return rows.untyped_storage().nbytes() - rows.storage_offset() - rows.numel() >= lib.turboquant_row_slack


