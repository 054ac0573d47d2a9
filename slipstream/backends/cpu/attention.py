"""Attention kernels of the CPU backend: queries over a bf16 cache or a run of bf16 K/V (kernels/paged_attention.c)
and decode queries and prefill chunks over TurboQuant codes (kernels/turboquant_attention.c; long
chunks: the codes expanded natively, then torch's SDPA; a step of decodes alone written and attended
in one call of kernels/decoder_layer.c).

Each query reads its own blocks up to its own length, with no gather into a padded batch.
They plug into the torch paths as their `decode_kernel` / `prefill_kernel` / `decode_step`
(attention/reference.py, attention/turboquant.py), which attend whatever a kernel declines
(returns None) and stay what the kernels are tested against. Batch-invariant backends take
`dense_attention` instead: a prefill chunk's queries go through the decode kernel too, each as
if it were the last token of its sequence, so a token's attention output is the same bits
whether it was computed in a prefill chunk of any size, after a prefix-cache hit, after
preemption, or as a decode token, where torch's SDPA blocks keys by the chunk's shape.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from slipstream.attention import reference, turboquant
from slipstream.attention.metadata import AttentionMetadata, PrefillChunk
from slipstream.backends.cpu import abi
from slipstream.kvcache.turboquant import TurboQuantizer
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache


def dense_decode(q: torch.Tensor, cache, meta: AttentionMetadata, scale: float,
                 window: int | None) -> torch.Tensor | None:
    """Attention of decode queries q [B, Hq, D] over a bf16 or float32 cache, either dtype each (a float32 model's
    decode over its own float32 cache, SmolLM2's shape at 16 x 4k tokens, one thread, AMD Zen 3: 25-31 ms a layer,
    against 130-153 for the torch gather that served it before); None where the kernel declines."""
    if q.dtype not in DENSE_DTYPES or cache.k.dtype not in DENSE_DTYPES:
        return None
    return _paged(q, cache.k, cache.v, scale, window, meta.decode_block_tables, meta.decode_context_lens)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """attention/reference.py's `paged_attention` for a bf16 cache, every query q [T, Hq, D] -> [T, Hq, D]
    in one call of the decode kernel after the step's K/V are written (the torch path where the
    shapes are beyond it)."""
    kv_heads, _, block_size, dim = cache.k.shape
    if not _paged_runs(q, kv_heads, block_size, dim, cache.k.dtype):
        return reference.paged_attention(q, k, v, cache, meta, scale, sliding_window)
    cache.write(k, v, meta.slot_mapping)
    return attend(q, cache, meta, scale, sliding_window)


def dense_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk, scale: float,
                  window: int | None) -> torch.Tensor:
    """reference.prefill_attention (a chunk's queries [n, Hq, D] over the end of their context k/v [Hk, L, D], their
    own last) in paged_attention.c: the run as blocks of one table, each row the last token of its prefix.
    TurboQuant's first chunks and its chunks that read no code (Gemma 3's sliding layers) take it where the bf16
    cache's prefill does (CpuBackend.every_query_native): 1,024 rows over 512 + 1,024 columns, Zen 4, 20 -> 12.5
    ms against SDPA's query blocks."""
    n, (kv_heads, length, dim) = q.shape[0], k.shape
    if not _paged_runs(q, kv_heads, RUN_BLOCK, dim, k.dtype):
        return reference.prefill_attention(q, k, v, chunk, scale, window)
    blocks = -(-length // RUN_BLOCK)
    k, v = (F.pad(x, (0, 0, 0, blocks * RUN_BLOCK - length)).contiguous().view(kv_heads, blocks, RUN_BLOCK, dim)
            for x in (k, v))
    tables = torch.arange(blocks).expand(n, blocks).contiguous()
    return _paged_checked(q, k, v, scale, window, tables, torch.arange(length - n + 1, length + 1))


RUN_BLOCK = 16  # dense_prefill's block size: the caches' default


def _paged_runs(q: torch.Tensor, kv_heads: int, block_size: int, dim: int, dtype: torch.dtype) -> bool:
    """Whether paged_attention.c takes q [T, Hq, D] over a cache of that shape and dtype."""
    lib = abi.kernels()
    return (lib is not None and q.dtype == torch.bfloat16 and dtype == torch.bfloat16
            and q.shape[1] // kv_heads <= lib.paged_attention_max_group and dim <= lib.paged_attention_max_head_dim
            and block_size <= lib.paged_attention_max_block)


def attend(q: torch.Tensor, cache, meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    """Each query of q [T, Hq, D] over its own context in a bf16 cache that holds the step's K/V,
    as the last token of that context: [T, Hq, D]. The caller checked the shapes."""
    return _paged_checked(q, cache.k, cache.v, scale, window, *query_tables(meta))


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


def _paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
           tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor | None:
    """Query row i of q over the first lens[i] tokens of block table row i of k/v [Hk, blocks, block_size, D], as
    the last of them."""
    q = q.contiguous()
    out = torch.empty_like(q)
    kv_heads, num_blocks, block_size, dim = k.shape
    layer = abi.PagedAttention(k.data_ptr(), v.data_ptr(), num_blocks, window or 0, block_size,
                               q.shape[1], kv_heads, dim, scale, int(q.dtype == torch.float32),
                               int(k.dtype == torch.float32))
    batch = decode_batch(q.shape[0], tables, lens)
    return out if abi.kernels().paged_decode_attention(layer, batch, q.data_ptr(), out.data_ptr()) == 0 else None


def _paged_checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
                   tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """`_paged` where the caller checked the shapes (`_paged_runs`): a decline is an error."""
    out = _paged(q, k, v, scale, window, tables, lens)
    if out is None:
        raise ValueError(f"paged attention declined {q.shape[1]} heads over {k.shape[0]}, head size {k.shape[3]}")
    return out


def decode_batch(batch: int, tables: torch.Tensor, lens: torch.Tensor) -> abi.DecodeBatch:
    """The kernels' description of `batch` decode queries over contiguous int64 block tables
    [batch, max_blocks] and context lengths [batch]; the tensors must outlive the call."""
    return abi.DecodeBatch(batch, tables.data_ptr(), lens.data_ptr(), tables.shape[1], abi.threads())


def turboquant_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                      tables: torch.Tensor, lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor | None:
    """The C kernel on the codes (and on the 16-bit window's tokens, if any), q [B, Hk, G, D] -> [B, Hk, G, D]
    float32, one query per sequence; None where it does not run."""
    return _turboquant(q, k, v, cache, None, tables, lens, scale, window)


def turboquant_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                           meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor | None:
    """A step of decode tokens alone, q [B, Hq, D] and their k/v [B, Hk, D]: written into the codes and the 16-bit
    window and attended in one call (decoder_layer.c's turboquant_decode_attention), out [B, Hq, D] in q's dtype;
    None where it does not run. One call, not the encoder's two and the kernel's, whose Python around the C
    (conversions, descriptions, checks) cost SmolLM2 ~170 us a layer on AMD EPYC Zen 3, more than the C."""
    lib = abi.kernels()
    layer = None if lib is None or not _decode_rows(q, k, v) else turboquant_decode_layer(
        cache, q.shape[1] // cache.k.shape[2], scale, window, lib)
    if layer is None:
        return None
    slots, batch = _decode_step_batch(meta)
    out = torch.empty(q.shape, dtype=q.dtype)
    status = lib.turboquant_decode_attention(layer, batch, slots.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                             q.stride(0), k.stride(0), int(q.dtype == torch.bfloat16), out.data_ptr())
    return out if status == 0 else None


def _decode_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """q, k, v as turboquant_decode_attention reads them: on the CPU in one dtype it takes, each token's heads
    contiguous (the views of a fused QKV projection's rows are), k's and v's tokens equally far apart."""
    dim = q.shape[-1]
    return (q.device.type == "cpu" and q.dtype in DENSE_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
            and all(x.stride(2) == 1 and x.stride(1) == dim for x in (q, k, v)) and k.stride(0) == v.stride(0))


def _decode_step_batch(meta: AttentionMetadata) -> tuple[torch.Tensor, abi.DecodeBatch]:
    """The step's slots and the description of its decode queries, built once for all its layers."""
    key = "native decode step"
    if key not in meta.step_cache:
        tables = meta.decode_block_tables.to(torch.int64).contiguous()
        lens = meta.decode_context_lens.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        meta.step_cache[key] = slots, decode_batch(len(lens), tables, lens), tables, lens  # what the batch points to
    slots, batch, _, _ = meta.step_cache[key]
    return slots, batch


def turboquant_decode_layer(cache: TurboQuantLayerCache, group: int, scale: float, window: int | None,
                            lib: abi.Kernels) -> abi.TurboQuantLayer | None:
    """decoder_layer.c's description of a calibrated TurboQuant layer on the CPU (its codes, window and encoders),
    or None where the kernels do not serve it; built once per build, group, scale and window and kept on the cache
    (see `_described`)."""
    if not cache.calibrated:
        return None
    return _kept(cache, ("decode layer", lib.isa, group, scale, window), _decode_layer, group, scale, window, lib)


def _decode_layer(cache: TurboQuantLayerCache, group: int, scale: float, window: int | None,
                  lib: abi.Kernels) -> abi.TurboQuantLayer | None:
    recent = cache.window
    if cache.k.device.type != "cpu" or not _reads(cache, lib):
        return None
    attention = turboquant_layer(cache, group, scale, window)
    if lib.turboquant_attention_fits(attention):
        return None
    keys, values = cache.native_encoders  # copied into the description: the C code sets each call's fields
    return abi.TurboQuantLayer(attention, abi.DenseTokens() if recent is None else window_tokens(cache), keys, values,
                               ctypes.cast(lib.turboquant_paged_attention, ctypes.c_void_p),
                               ctypes.cast(lib.turboquant_encode, ctypes.c_void_p))


def turboquant_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                       chunk: PrefillChunk, scale: float, window: int | None,
                       dense=reference.prefill_attention) -> torch.Tensor | None:
    """A prefill chunk's queries q [n, Hk, G, D] over its cached prefix and itself (causal), k/v [n, Hk, D] its
    new tokens, already written: from EXPANDED_FROM_ROWS rows one SDPA over the natively expanded codes
    (attention/turboquant.py, expanded_prefill; `dense` where no row reads a code), below that the kernel's
    tiles; None where neither runs."""
    if chunk.length >= EXPANDED_FROM_ROWS and _runs(q, cache, abi.kernels()):
        return turboquant.expanded_prefill(q, k, v, cache, chunk, scale, window, _expand, dense)
    return turboquant_prefill_tiles(q, k, v, cache, chunk, scale, window)


def turboquant_prefill_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                             chunk: PrefillChunk, scale: float, window: int | None) -> torch.Tensor | None:
    """The decode kernel's tiles of query rows for one chunk: each tile decodes every code row it reads."""
    starts = torch.tensor([0, chunk.length])
    lens = torch.tensor([chunk.context_len])
    return _turboquant(q, k, v, cache, starts, chunk.block_table[None], lens, scale, window)


def _turboquant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                starts: torch.Tensor | None, tables: torch.Tensor, lens: torch.Tensor, scale: float,
                window: int | None) -> torch.Tensor | None:
    """q [rows, Hk, G, D]: sequence b's query rows are [starts[b], starts[b + 1]) (None: row b alone)."""
    lib, recent = abi.kernels(), cache.window
    if not _runs(q, cache, lib):
        return None
    q = q.float().contiguous()
    out = torch.empty_like(q)
    tables, lens = tables.to(torch.int64).contiguous(), lens.to(torch.int64).contiguous()
    starts = None if starts is None else starts.to(torch.int64).contiguous()
    layer, dense = _described(cache, q.shape[2], scale, window)
    layer.query_start = None if starts is None else starts.data_ptr()
    if recent is not None:
        k, v = k.to(recent.k.dtype).contiguous(), v.to(recent.v.dtype).contiguous()
        dense.own_k, dense.own_v = k.data_ptr(), v.data_ptr()
    batch = decode_batch(len(lens), tables, lens)
    status = lib.turboquant_paged_attention(layer, batch, q.data_ptr(), out.data_ptr())
    return out if status == 0 else None


def _described(cache: TurboQuantLayerCache, group: int, scale: float,
               window: int | None) -> tuple[abi.TurboQuantAttention, abi.DenseTokens | None]:
    """turboquant_layer, pointing to window_tokens if the cache has a window, built once per (group, scale, window)
    and kept on the cache: what they point to is fixed from the calibration on (built per call, they cost ~15 us
    of Python a decode step's layer); each call sets its own fields."""
    return _kept(cache, (group, scale, window), _attention_description, group, scale, window)


def _attention_description(cache: TurboQuantLayerCache, group: int, scale: float,
                           window: int | None) -> tuple[abi.TurboQuantAttention, abi.DenseTokens | None]:
    layer, dense = turboquant_layer(cache, group, scale, window), None
    if cache.window is not None:
        dense = window_tokens(cache)
        layer.dense = ctypes.pointer(dense)
    return layer, dense


def _kept(cache: TurboQuantLayerCache, key: tuple, build, *args):
    """build(cache, *args), once per key, kept on the cache: the kernels' descriptions, whose targets are fixed
    from the calibration on."""
    described = cache.__dict__.setdefault("kernel_descriptions", {})
    if key not in described:
        described[key] = build(cache, *args)
    return described[key]


def turboquant_layer(cache: TurboQuantLayerCache, group: int, scale: float,
                     window: int | None) -> abi.TurboQuantAttention:
    """The kernel's description of a layer's codes, one query row per sequence, no 16-bit window; what it
    points to lives as long as the cache (its calibrated constants are cached on it)."""
    to_keys, back = cache.decode_maps
    heads, dim = cache.key_mean.shape
    keys, values = _code_rows(cache.k, cache.key_quantizer), _code_rows(cache.v, cache.value_quantizer)
    return abi.TurboQuantAttention(keys, values, to_keys.data_ptr(), back.data_ptr(), None, None, window or 0,
                                   heads, group, dim, cache.block_size, scale)


def window_tokens(cache: TurboQuantLayerCache) -> abi.DenseTokens:
    """The kernel's description of a layer's 16-bit window (its staged blocks; the step's own tokens unset)."""
    recent = cache.window
    return abi.DenseTokens(recent.staging_of.data_ptr(), recent.k.data_ptr(), recent.v.data_ptr(), None, None,
                           cache.key_mean.data_ptr(), recent.tokens, recent.sinks,
                           int(recent.k.dtype == torch.bfloat16))


def _expand(cache: TurboQuantLayerCache, chunk: PrefillChunk, length: int,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """TurboQuantLayerCache.code_space of the chunk's first `length` tokens in kernels/turboquant_attention.c,
    straight to `dtype`."""
    table = chunk.block_table.to(torch.int64).contiguous()
    return tuple(_expand_rows(rows, quantizer, table, length, dtype)
                 for rows, quantizer in ((cache.k, cache.key_quantizer), (cache.v, cache.value_quantizer)))


def _expand_rows(rows: torch.Tensor, quantizer: TurboQuantizer, table: torch.Tensor, length: int,
                 dtype: torch.dtype) -> torch.Tensor:
    heads = rows.shape[2]
    out = torch.empty(heads, length, quantizer.code_width, dtype=dtype)
    status = abi.kernels().turboquant_expand(_code_rows(rows, quantizer), table.data_ptr(), length, heads,
                                             rows.shape[1], int(dtype == torch.bfloat16), out.data_ptr(),
                                             abi.threads())
    if status:
        raise ValueError(f"no native expansion of {quantizer.bits}-bit {quantizer.mode} rows")
    return out


def _code_rows(rows: torch.Tensor, quantizer: TurboQuantizer) -> abi.CodeRows:
    pieces, values = quantizer.row_layout  # cached on the quantizer: alive as long as the cache
    return abi.CodeRows(rows.data_ptr(), pieces.data_ptr(), values.data_ptr(), len(pieces), quantizer.nbytes,
                        quantizer.code_width)


# a chunk's rows from which expanding its context's codes once and attending through SDPA beats the tiles, which
# decode every code row once per 32 query vectors (SmolLM2's 9 heads over 3, bf16, AMX CPU, 4k context: equal at 16
# rows, the expansion 1.6x / 2.2x faster at 32 / 64 rows; the tiles 1.25x faster at 8)
EXPANDED_FROM_ROWS = 16
DENSE_DTYPES = (torch.bfloat16, torch.float32)  # the dtypes the kernels read: dense caches, TurboQuant's window


def _runs(q: torch.Tensor, cache: TurboQuantLayerCache, lib: abi.Kernels) -> bool:
    return q.device.type == "cpu" and _reads(cache, lib)


def _reads(cache: TurboQuantLayerCache, lib: abi.Kernels) -> bool:
    """Whether the kernels read this cache: its rows' slack, its window's dtype."""
    recent = cache.window
    return has_slack(cache, lib) and (recent is None or recent.k.dtype in DENSE_DTYPES)


def has_slack(cache: TurboQuantLayerCache, lib: abi.Kernels) -> bool:
    """The kernel's wide loads may run past the last row (turboquant_cache.row_slack)."""
    return all(rows.untyped_storage().nbytes() - rows.storage_offset() - rows.numel() >= lib.turboquant_row_slack
               for rows in (cache.k, cache.v))
