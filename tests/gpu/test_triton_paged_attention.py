"""The Triton paged-attention kernel against the torch reference (attention/reference.py) in float32,
over ragged mixed steps, shuffled block tables, GQA/MQA, sliding-window edges, head sizes and dtypes."""
from __future__ import annotations

import pytest
import torch

from slipstream.attention import reference
from slipstream.backends.cuda.attention import dense_attention
from slipstream.kvcache.cache import LayerKVCache
from tests.gpu.steps import DEVICE, kernels, random_step

# decode rows over short and block-crossing contexts, then a chunk over a cached prefix, a fresh
# prompt and a short chunk whose prefix ends mid-block
MIXED = [(1, 37), (1, 5), (1, 16), (7, 40), (5, 5), (3, 19)]
# float32 matches to rounding; 16-bit and fp8 inputs carry probabilities rounded to 16 bits into
# the P @ V product (as FlashAttention does), about 2**-8 relative
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def attend(rows, num_heads, kv_heads, dim, cache_dtype, q_dtype, window, block_size=16, seed=0):
    """(the kernel's output, the reference's) for one random step."""
    kernels("paged_attention")
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for _, c in rows) + 3
    meta = random_step(rows, block_size, num_blocks, seed)
    cache = LayerKVCache(num_blocks, block_size, kv_heads, dim, cache_dtype, DEVICE)
    for t in (cache.k, cache.v):  # the cached prefixes, and garbage in every slot no row may read
        t.copy_(torch.randn(t.shape, generator=g).to(cache_dtype))
    tokens = sum(n for n, _ in rows)
    q = torch.randn(tokens, num_heads, dim, generator=g).to(DEVICE, q_dtype)
    # new K/V as the cache stores them, so that the reference's fresh prompts read what the kernel reads
    k, v = (torch.randn(tokens, kv_heads, dim, generator=g).to(DEVICE, cache_dtype).to(q_dtype) for _ in "kv")
    out = dense_attention(q, k, v, cache, meta, dim ** -0.5, window)
    exact = LayerKVCache(num_blocks, block_size, kv_heads, dim, torch.float32, DEVICE)
    exact.k.copy_(cache.k.float())
    exact.v.copy_(cache.v.float())
    expected = reference.paged_attention(q.float(), k.float(), v.float(), exact, meta, dim ** -0.5, window)
    return out, expected


def check(out, expected, q_dtype):
    assert out.dtype == q_dtype
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[q_dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_step_each_dtype(dtype):
    check(*attend(MIXED, 4, 2, 64, dtype, dtype, None), dtype)


def test_fp8_cache():
    check(*attend(MIXED, 4, 2, 64, torch.float8_e4m3fn, torch.bfloat16, None), torch.bfloat16)


@pytest.mark.parametrize("num_heads,kv_heads", [(4, 4), (9, 3), (8, 1)], ids=["mha", "gqa-3", "mqa-8"])
def test_head_groups(num_heads, kv_heads):
    check(*attend(MIXED, num_heads, kv_heads, 64, torch.float32, torch.float32, None), torch.float32)


@pytest.mark.parametrize("window", [1, 8, 16, 17, 64], ids=lambda w: f"window{w}")
def test_sliding_window_edges(window):
    """1: a query sees itself only; 16/17: the window ends on / just past a block edge; 64: longer than any context."""
    check(*attend(MIXED, 4, 1, 64, torch.float32, torch.float32, window), torch.float32)


@pytest.mark.parametrize("dim", [128, 256, 80])
def test_head_sizes(dim):
    check(*attend([(1, 21), (4, 20)], 2, 1, dim, torch.bfloat16, torch.bfloat16, None), torch.bfloat16)


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_block_sizes(block_size):
    check(*attend(MIXED, 4, 2, 64, torch.float32, torch.float32, 7, block_size=block_size), torch.float32)


def test_decode_only_and_prefill_only_steps():
    check(*attend([(1, 3)] * 5, 4, 2, 64, torch.float32, torch.float32, None), torch.float32)
    check(*attend([(9, 9), (3, 30)], 4, 2, 64, torch.float32, torch.float32, None), torch.float32)


@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("window", [None, 20])
def test_split_kv_matches_one_split(splits, window):
    """Split-KV over a long-ish context (splits with no key at all included) equals the single pass."""
    kernel = kernels("paged_attention")
    rows = [(1, 100), (1, 3), (6, 70)]
    meta = random_step(rows, 16, 20)
    g = torch.Generator().manual_seed(1)
    cache = LayerKVCache(20, 16, 2, 64, torch.float32, DEVICE)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    q = torch.randn(8, 4, 64, generator=g).to(DEVICE)
    args = (q, cache.k, cache.v, meta.block_table, meta.seq_lens, meta.query_start_loc, 0.125, window, 6)
    torch.testing.assert_close(kernel.paged_attention(*args, num_splits=splits),
                               kernel.paged_attention(*args, num_splits=1), atol=1e-5, rtol=0)


def test_choose_splits():
    kernel = kernels("paged_attention")
    assert kernel.choose_splits(8, 1000) == 1  # short contexts never split
    assert kernel.choose_splits(4096, 32768) == 1  # enough programs already
    assert kernel.choose_splits(8, 32768) == kernel.MAX_SPLITS
    splits = kernel.choose_splits(24, 4096)
    assert splits == 4 and splits & (splits - 1) == 0


def test_bad_inputs_name_the_value():
    kernel = kernels("paged_attention")
    cache = torch.zeros(2, 4, 16, 64)
    meta = random_step([(1, 5)], 16, 4)
    args = (cache, cache, meta.block_table, meta.seq_lens, meta.query_start_loc, 0.125)
    with pytest.raises(ValueError, match="query dtype torch.int32"):
        kernel.paged_attention(torch.zeros(1, 4, 64, dtype=torch.int32), *args, None, 1)
    with pytest.raises(ValueError, match="does not fit a cache"):
        kernel.paged_attention(torch.zeros(1, 3, 64), *args, None, 1)
    with pytest.raises(ValueError, match="sliding window 0"):
        kernel.paged_attention(torch.zeros(1, 4, 64), *args, 0, 1)
    with pytest.raises(ValueError, match="num_splits=3"):
        kernel.paged_attention(torch.zeros(1, 4, 64), *args, None, 1, num_splits=3)
