"""The native TurboQuant kernel (kernels/turboquant_attention.c) with several query rows per sequence, in every
kernel build, against the torch code path (`turboquant._prefill`): its tiles, which serve chunks shorter than
EXPANDED_FROM_ROWS and verification (longer chunks: tests/kernels/test_turboquant_expanded.py).

Rows are causal within their chunk over the chunk's own tokens (written to the cache before
attention), each within its own sliding window; ragged chunks in one call, shuffled block tables,
query tiles split inside a chunk, and the 16-bit recent/sink window's edges. Tolerance as for
decode (tests/kernels/test_turboquant_attention.py). Not against dequantize-then-attend as well:
at these sizes the torch code path itself is up to 1e-5 from it (9.8e-6 measured, tq3-qjl).
"""
from __future__ import annotations

import itertools

import pytest
import torch

from slipstream.attention import reference, turboquant
from slipstream.attention.metadata import PrefillChunk
from slipstream.backends.cpu.attention import (_turboquant, dense_prefill, turboquant_decode, turboquant_decode_step,
                                               turboquant_prefill, turboquant_prefill_tiles)
from slipstream.backends.cpu.backend import CpuBackend
from slipstream.backends.cpu.capability import CpuCapability
from slipstream.kvcache.dtype import TQ_BITS
from tests.conftest import step_metadata
from tests.kernels.test_paged_attention import shuffled_block_tables
from tests.kernels.test_turboquant_attention import DTYPES, TOL, _cache


def _filled(kv_dtype: str, lens: list[int], num_heads: int, kv_heads: int, block_size: int = 16, dim: int = 64):
    """A cache whose every slot holds codes, over shuffled blocks; tables padded with 0."""
    torch.manual_seed(0)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = _cache(kv_dtype, kv_heads, num_heads, num_blocks, block_size, dim=dim)
    every_slot = torch.arange(num_blocks * block_size)
    cache.write(torch.randn(len(every_slot), kv_heads, dim) * 3 + 1, torch.randn(len(every_slot), kv_heads, dim),
                every_slot)
    return cache, shuffled_block_tables(lens, block_size, num_blocks)


def _chunks(query_lens: list[int], lens: list[int], tables: torch.Tensor) -> list[PrefillChunk]:
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    return [PrefillChunk(s, n, c, tables[i, :-(-c // 16)]) for i, (s, n, c) in enumerate(zip(starts, query_lens, lens))]


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("num_heads,kv_heads", [(9, 3), (4, 1), (6, 2)])  # GQA (SmolLM2), MQA (Gemma 3), group 3
@pytest.mark.parametrize("window", [None, 20])
def test_chunk_equals_the_torch_code_path(isa, kv_dtype, num_heads, kv_heads, window):
    lens = [150]
    cache, tables = _filled(kv_dtype, lens, num_heads, kv_heads)
    chunk = _chunks([37], lens, tables)[0]  # 37 rows: several tiles, the last one partly padding
    q, k, v = torch.randn(37, num_heads, 64), torch.randn(37, kv_heads, 64), torch.randn(37, kv_heads, 64)
    ours = turboquant._prefill(q, k, v, cache, chunk, 0.125, window, turboquant_prefill_tiles)
    assert (ours - turboquant._prefill(q, k, v, cache, chunk, 0.125, window)).abs().max() < TOL


def test_chunk_on_every_key_value_split(isa):
    for key_bits, value_bits in itertools.product(TQ_BITS.values(), repeat=2):
        for suffix in ("", "-qjl"):
            kv_dtype = f"tq-k{key_bits:g}v{value_bits:g}{suffix}"
            cache, tables = _filled(kv_dtype, [90], 6, 2)
            chunk = _chunks([37], [90], tables)[0]
            q, k, v = torch.randn(37, 6, 64), torch.randn(37, 2, 64), torch.randn(37, 2, 64)
            ours = turboquant._prefill(q, k, v, cache, chunk, 0.125, None, turboquant_prefill_tiles)
            diff = (ours - turboquant._prefill(q, k, v, cache, chunk, 0.125, None)).abs().max()
            assert diff < TOL, (kv_dtype, diff)


@pytest.mark.parametrize("kv_dtype", ["tq3", "tq2.5", "tq4-qjl"])
@pytest.mark.parametrize("dim,block_size", [(128, 16), (256, 8), (64, 4)])  # Gemma 3's head_dim 256; small blocks
def test_chunk_with_larger_heads_and_other_blocks(isa, kv_dtype, dim, block_size):
    """Float32 sums over more channels: at head_dim 256 the torch code path and dequantize-then-attend are
    themselves up to 2.3e-5 apart (measured), so the bound grows with the head size."""
    lens = [70]
    cache, tables = _filled(kv_dtype, lens, 4, 1, block_size, dim)
    chunk = PrefillChunk(0, 21, 70, tables[0])
    q, k, v = torch.randn(21, 4, dim), torch.randn(21, 1, dim), torch.randn(21, 1, dim)
    for window in (None, 9):
        ours = turboquant._prefill(q, k, v, cache, chunk, 0.125, window, turboquant_prefill_tiles)
        assert (ours - turboquant._prefill(q, k, v, cache, chunk, 0.125, window)).abs().max() < TOL * dim / 64


@pytest.mark.parametrize("num_heads,kv_heads", [(9, 3), (16, 2)])  # group 3; group 8 (generic, two rows a tile)
def test_ragged_rows_of_several_sequences_in_one_call(isa, num_heads, kv_heads):
    """Query rows [1, 5, 40, 13] over contexts [9, 100, 40, 250]: a decode row, short and long chunks, one without
    a prefix, each sequence's rows against its own blocks."""
    query_lens, lens = [1, 5, 40, 13], [9, 100, 40, 250]
    cache, tables = _filled("tq3", lens, num_heads, kv_heads)
    q = torch.randn(sum(query_lens), num_heads, 64)
    starts = torch.tensor([0, 1, 6, 46, 59])
    for window in (None, 30):
        ours = _turboquant(q.view(len(q), kv_heads, -1, 64), None, None, cache, starts, tables,
                           torch.tensor(lens), 0.125, window).reshape(q.shape)
        for chunk in _chunks(query_lens, lens, tables):
            rows = slice(chunk.start, chunk.start + chunk.length)
            want = turboquant._prefill(q[rows], None, None, cache, chunk, 0.125, window)
            assert (ours[rows] - want).abs().max() < TOL


def test_chunk_reads_only_its_blocks_and_rows(isa):
    """A NaN norm in a block no table points to, or past the chunk's last token, must not reach any output."""
    cache, tables = _filled("tq3", [40], 6, 2)
    free = next(b for b in range(cache.k.shape[0]) if b not in set(tables.flatten().tolist()))
    cache.k[free] = 0xFF  # every fp16 in these rows reads as NaN
    cache.v[tables[0, 1], 40 - 16:] = 0xFF  # slots after the sequence's 40 tokens
    out = turboquant_prefill_tiles(torch.randn(12, 2, 3, 64), None, None, cache,
                                   PrefillChunk(0, 12, 40, tables[0]), 0.125, None)
    assert torch.isfinite(out).all()


def staged_second_chunk(recent: int, sinks: int, dense_dtype: torch.dtype, n: int):
    """A prefill in two chunks through the engine's staging rules (29 tokens, then n): q, k, v of the second chunk,
    the cache (tq3, blocks of 4, 6 heads over 2) and the chunk, whose window has staged prefix blocks."""
    g = torch.Generator().manual_seed(2)
    block_size, kv_heads, num_heads, prefix = 4, 2, 6, 29
    cache = _cache("tq3", kv_heads, num_heads, 32, block_size, recent, sinks, dense_dtype)
    table = torch.randperm(32)[:-(-(prefix + n) // block_size)]
    slot = lambda pos: table[pos // block_size] * block_size + pos % block_size
    randn = lambda *shape: torch.randn(*shape, generator=g)
    meta = step_metadata([prefix], [prefix], table[None], slot(torch.arange(prefix)))
    turboquant.paged_attention(randn(prefix, num_heads, 64), randn(prefix, kv_heads, 64) * 3 + 1,
                               randn(prefix, kv_heads, 64), cache, meta, 0.125)
    meta = step_metadata([n], [prefix + n], table[None], slot(torch.arange(prefix, prefix + n)))
    q, k, v = randn(n, num_heads, 64), randn(n, kv_heads, 64) * 3 + 1, randn(n, kv_heads, 64)
    turboquant.place_staging(cache.window.staging, meta)
    cache.write(k, v, meta.slot_mapping)  # and the window's tokens that are mirrored before attention
    cache.window.write(k, v, late=True)
    assert cache.window.exists(table).any()
    return q, k, v, cache, meta.prefills[0]


# sliding window 12: at recent 20 the tiles read no code (and rotate nothing), at 11 each row its oldest from codes
@pytest.mark.parametrize("recent,sinks", [(20, 4), (0, 4), (20, 0), (6, 5), (11, 0)])
@pytest.mark.parametrize("dense_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 12])
def test_chunk_with_recent_and_sink_tokens_equals_the_torch_path(isa, recent, sinks, dense_dtype, window):
    """The second chunk reads staged prefix tokens and its own near ones in 16 bits, the rest from codes, each row
    by its own position."""
    q, k, v, cache, chunk = staged_second_chunk(recent, sinks, dense_dtype, 19)
    ours = turboquant._prefill(q, k, v, cache, chunk, 0.125, window, turboquant_prefill_tiles)
    assert (ours - turboquant._prefill(q, k, v, cache, chunk, 0.125, window)).abs().max() < TOL


def test_the_backend_routes_prefill_chunks_over_codes_to_the_kernel(isa):
    """Chunks over codes to the kernels; attention over 16-bit K/V alone where the bf16 cache's prefill goes."""
    cache, _ = _filled("tq3", [3], 4, 1)
    backend = CpuBackend(CpuCapability.detect())
    dense = dense_prefill if backend.every_query_native else reference.prefill_attention
    bound = backend.attention(cache)
    assert bound.keywords.keys() == {"decode_kernel", "prefill_kernel", "dense_prefill", "decode_step"}
    assert bound.keywords["decode_kernel"] is turboquant_decode and bound.keywords["dense_prefill"] is dense
    assert bound.keywords["decode_step"] is turboquant_decode_step
    assert bound.keywords["prefill_kernel"].func is turboquant_prefill
    assert bound.keywords["prefill_kernel"].keywords == {"dense": dense}
