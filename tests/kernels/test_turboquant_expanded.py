"""Long prefill chunks over a TurboQuant cache as one SDPA in code space (`turboquant.expanded_prefill`), with the
native expansion of code rows (kernels/turboquant_attention.c, `turboquant_expand`) in every kernel build and with
its torch twin (`TurboQuantLayerCache.code_space`), against the torch code path (`turboquant._prefill`).

Rows are causal over the chunk's own tokens and within their sliding window; the 16-bit recent/sink window's tokens
join the softmax mapped into code space. float32 queries: the same tolerance as the tile kernel (TOL; SDPA sums in
its own blocks); bf16 queries: measured against the rounding bf16 costs the dense cache's prefill.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from slipstream.attention import reference, turboquant
from slipstream.backends.cpu.attention import EXPANDED_FROM_ROWS, _expand, turboquant_prefill
from slipstream.kvcache.dtype import TQ_BITS
from tests.kernels.test_turboquant_attention import DTYPES, TOL
from tests.kernels.test_turboquant_prefill import _chunks, _filled, staged_second_chunk

def _torch_expand(cache, chunk, length, dtype):
    return cache.code_space(chunk.block_table, length, dtype)


def _case(kv_dtype: str, num_heads: int, kv_heads: int, n: int = 70, length: int = 150):
    cache, tables = _filled(kv_dtype, [length], num_heads, kv_heads)
    chunk = _chunks([n], [length], tables)[0]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, h, 64, generator=g) for h in (num_heads, kv_heads, kv_heads))
    return cache, chunk, q, k, v


def _expanded(q, k, v, cache, chunk, window, expand=_expand):
    kv_heads = cache.k.shape[2]
    out = turboquant.expanded_prefill(q.view(len(q), kv_heads, -1, 64), k, v, cache, chunk, 0.125, window, expand)
    return out.reshape(q.shape)


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_native_expansion_equals_the_torch_code_space(isa, kv_dtype):
    cache, chunk, *_ = _case(kv_dtype, 6, 2)
    for ours, want in zip(_expand(cache, chunk, chunk.context_len, torch.float32),
                          _torch_expand(cache, chunk, chunk.context_len, torch.float32)):
        assert ours.shape == want.shape and ours.shape[:2] == (2, 150)
        torch.testing.assert_close(ours, want, rtol=1e-6, atol=0)  # QJL scales multiply in another order
    for ours, want in zip(_expand(cache, chunk, chunk.context_len, torch.bfloat16),
                          _torch_expand(cache, chunk, chunk.context_len, torch.float32)):
        torch.testing.assert_close(ours, want.to(torch.bfloat16), rtol=2 ** -8, atol=0)


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("num_heads,kv_heads", [(9, 3), (4, 1), (6, 2)])  # GQA (SmolLM2), MQA (Gemma 3), group 3
@pytest.mark.parametrize("window", [None, 20])
def test_chunk_equals_the_torch_code_path(isa, kv_dtype, num_heads, kv_heads, window):
    cache, chunk, q, k, v = _case(kv_dtype, num_heads, kv_heads)
    want = turboquant._prefill(q, k, v, cache, chunk, 0.125, window)
    assert (_expanded(q, k, v, cache, chunk, window) - want).abs().max() < TOL


def test_chunk_on_every_key_value_split(isa):
    for key_bits, value_bits in itertools.product(TQ_BITS.values(), repeat=2):
        for suffix in ("", "-qjl"):
            cache, chunk, q, k, v = _case(f"tq-k{key_bits:g}v{value_bits:g}{suffix}", 6, 2)
            want = turboquant._prefill(q, k, v, cache, chunk, 0.125, None)
            assert (_expanded(q, k, v, cache, chunk, None) - want).abs().max() < TOL, (key_bits, value_bits, suffix)


def test_chunk_reads_only_its_blocks_and_rows(isa):
    """A NaN norm in a block no table points to, or past the chunk's last token, must not reach any output."""
    cache, chunk, q, k, v = _case("tq3", 6, 2, n=20, length=40)
    free = next(b for b in range(cache.k.shape[0]) if b not in set(chunk.block_table.tolist()))
    cache.k[free] = 0xFF  # every fp16 in these rows reads as NaN
    cache.v[chunk.block_table[2], 40 - 32:] = 0xFF  # slots after the sequence's 40 tokens
    assert torch.isfinite(_expanded(q, k, v, cache, chunk, None)).all()


def test_torch_expansion_gives_the_same_attention():
    """The torch twin serves where no kernels are built (SLIPSTREAM_NATIVE=0 runs this too)."""
    cache, chunk, q, k, v = _case("tq3", 9, 3)
    want = turboquant._prefill(q, k, v, cache, chunk, 0.125, None)
    assert (_expanded(q, k, v, cache, chunk, None, _torch_expand) - want).abs().max() < TOL


def test_bf16_queries_within_twice_the_bf16_cache_rounding(isa):
    """bf16 queries make SDPA read bf16 operands, and the output is rounded before and after its rotation back:
    within 2.5x (measured 1.8x) of what bf16 costs the dense cache's prefill on the same dequantized K/V."""
    cache, chunk, *qkv = _case("tq4", 9, 3)
    q, k, v = (x.bfloat16() for x in qkv)
    want = turboquant._prefill(q.float(), k.float(), v.float(), cache, chunk, 0.125, None)
    keys, values = cache.gather(chunk.block_table, chunk.context_len, torch.float32)
    dense = reference.prefill_attention(q.float(), keys, values, chunk, 0.125, None)
    dense_bf16 = reference.prefill_attention(q, keys.bfloat16(), values.bfloat16(), chunk, 0.125, None)
    ours = _expanded(q, k, v, cache, chunk, None)
    assert ours.dtype == torch.bfloat16
    assert (ours.float() - want).abs().max() < 2.5 * (dense_bf16.float() - dense).abs().max()


@pytest.mark.parametrize("recent,sinks", [(20, 4), (0, 4), (20, 0), (6, 5)])
@pytest.mark.parametrize("dense_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("query_block", [reference.QUERY_BLOCK, 16])  # 16: a sliding layer's rows in 5 blocks
def test_chunk_with_recent_and_sink_tokens_equals_the_torch_path(isa, recent, sinks, dense_dtype, window,
                                                                 query_block, monkeypatch):
    """The second chunk of a prefill reads its own tokens and the staged prefix tokens near each row in 16 bits
    (mapped into code space), the rest from codes, each row by its own position."""
    monkeypatch.setattr(reference, "QUERY_BLOCK", query_block)
    q, k, v, cache, chunk = staged_second_chunk(recent, sinks, dense_dtype, 70)
    want = turboquant._prefill(q, k, v, cache, chunk, 0.125, window)
    assert (_expanded(q, k, v, cache, chunk, window) - want).abs().max() < TOL


@pytest.mark.parametrize("dense_dtype", [torch.float32, torch.bfloat16])
def test_a_sliding_window_inside_the_staged_one_reads_no_codes(isa, dense_dtype):
    """Where every token a row sees is in 16 bits (Gemma 3's sliding layers stage their whole window), the chunk
    attends over those tokens in channels: nothing is expanded, and the torch path's answer comes out."""
    q, k, v, cache, chunk = staged_second_chunk(20, 4, dense_dtype, 70)

    def no_codes(*args):
        raise AssertionError("expanded codes that no row reads")

    want = turboquant._prefill(q, k, v, cache, chunk, 0.125, 12)
    assert (_expanded(q, k, v, cache, chunk, 12, expand=no_codes) - want).abs().max() < TOL


def test_the_backend_sends_long_chunks_to_the_expanded_path(isa):
    """At EXPANDED_FROM_ROWS rows the prefill kernel answers with the expanded path's bits; below, with the tiles'."""
    for n in (EXPANDED_FROM_ROWS, EXPANDED_FROM_ROWS - 1):
        cache, chunk, q, k, v = _case("tq3", 9, 3, n=n, length=n + 40)
        ours = turboquant._prefill(q, k, v, cache, chunk, 0.125, None, turboquant_prefill)
        assert torch.equal(ours, _expanded(q, k, v, cache, chunk, None)) == (n == EXPANDED_FROM_ROWS)
