"""The Triton TurboQuant attention kernel against the torch code path (attention/turboquant.py) on a
whole step: decode rows and prefill chunks over a cached prefix (plus a fresh prompt, which both
attend in torch), over shuffled blocks, every bit width and key mode, with and without the
16-bit recent/sink window and a sliding window.

Both sides run in float32 on the same codes; the kernel sums in another order (tiles, online
softmax), so they agree to 2e-5 (the CPU kernel's bound is 1e-5 at head size 64; the Triton
tiles add one rescaling per tile).
"""
from __future__ import annotations

import pytest
import torch

from slipstream.attention import turboquant
from slipstream.backends.cuda.attention import turboquant_decode, turboquant_prefill
from slipstream.kvcache.dtype import parse_kv_cache_dtype
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache
from tests.gpu.steps import DEVICE, kernels, shuffled_tables, step_over

TOL = 2e-5
DTYPES = ["tq4", "tq3.5", "tq3", "tq2.5", "tq2", "tq3-qjl", "tq2.5-qjl", "tq-k3v3", "tq-k3.5v3.5", "tq-k3v2.5-qjl"]
HISTORY = [(36, 36), (8, 8), (20, 20)]  # prompts that fill the cache (and the staging) first
STEP = [(1, 37), (1, 9), (6, 26), (5, 5)]  # decodes, a chunk over its cached prefix, a fresh prompt


def build_cache(kv_dtype, num_heads, kv_heads, dim, block_size, num_blocks, recent=0, sinks=0,
                num_staging=None, window_dtype=torch.bfloat16) -> TurboQuantLayerCache:
    spec = parse_kv_cache_dtype(kv_dtype, torch.float32)
    cache = TurboQuantLayerCache(num_blocks, block_size, kv_heads, dim, spec.key_bits, spec.key_mode, seed=3,
                                 device=DEVICE, recent_tokens=recent, sink_tokens=sinks,
                                 num_staging=(num_blocks if num_staging is None else num_staging) if recent or sinks else 0,
                                 dense_dtype=window_dtype, value_bits=spec.value_bits)
    g = torch.Generator().manual_seed(1)
    channels = torch.linspace(0.2, 5.0, dim)  # uneven channel RMS: the key scale and outlier channels matter
    cache.calibrate(*(x.to(DEVICE) for x in (torch.randn(256, num_heads, dim, generator=g),
                                             torch.randn(256, kv_heads, dim, generator=g) * channels + 1,
                                             torch.randn(256, kv_heads, dim, generator=g))))
    return cache


def run(cache, rows, tables, num_heads, window, seed, **kernels_):
    """One step through attention/turboquant.py; row i continues the sequence with blocks tables[i]."""
    kv_heads, dim = cache.k.shape[2], cache.key_mean.shape[1]
    meta = step_over(rows, tables, cache.block_size)
    g = torch.Generator().manual_seed(seed)
    tokens = sum(n for n, _ in rows)
    q, k, v = (torch.randn(tokens, h, dim, generator=g).to(DEVICE) for h in (num_heads, kv_heads, kv_heads))
    return turboquant.paged_attention(q, k * 3 + 1, v, cache, meta, dim ** -0.5, window, **kernels_)


def compare(kv_dtype="tq3", num_heads=4, kv_heads=2, dim=64, block_size=4, recent=0, sinks=0, window=None,
            step=STEP, history=HISTORY, num_staging=None):
    kernels("turboquant_attention")
    outs, staged = [], 0
    for hooks in ({}, {"decode_kernel": turboquant_decode, "prefill_kernel": turboquant_prefill}):
        cache = build_cache(kv_dtype, num_heads, kv_heads, dim, block_size, 40, recent, sinks, num_staging)
        tables = shuffled_tables([c for _, c in step], block_size, 40)
        run(cache, history, tables, num_heads, window, seed=1)
        outs.append(run(cache, step, tables, num_heads, window, seed=2, **hooks))
        staged = 0 if cache.window is None else int((cache.window.staging_of >= 0).sum())
    assert staged or not (recent or sinks), "the scenario staged no block: the 16-bit path went untested"
    return outs


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_each_bit_width_and_key_mode(kv_dtype):
    ours, expected = compare(kv_dtype)
    torch.testing.assert_close(ours, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("num_heads,kv_heads", [(9, 3), (4, 1)], ids=["gqa-3", "mqa-4"])
@pytest.mark.parametrize("window", [None, 6])
def test_head_groups_and_sliding_window(num_heads, kv_heads, window):
    ours, expected = compare("tq3.5", num_heads, kv_heads, window=window)
    torch.testing.assert_close(ours, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("recent,sinks", [(6, 3), (0, 4), (9, 0)])
@pytest.mark.parametrize("window", [None, 7])
def test_recent_and_sink_tokens_in_the_same_softmax(recent, sinks, window):
    """Staged tokens (from staging blocks) and the step's own (from the fresh K/V) in 16 bits, the rest as codes."""
    ours, expected = compare("tq2.5", 4, 2, recent=recent, sinks=sinks, window=window)
    torch.testing.assert_close(ours, expected, atol=TOL, rtol=0)


def test_fresh_tokens_without_staging():
    """Three staging blocks for four sequences: some windows stay codes-only, and the step's own tokens
    must still come from the fresh K/V (the reference's rule), not from codes or a stale staging block."""
    ours, expected = compare("tq3", 4, 2, recent=6, sinks=2, num_staging=3)
    torch.testing.assert_close(ours, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("dim", [128, 256])
def test_larger_heads(dim):
    """Gemma 3's head size 256, one KV head; float32 sums over more channels, so the bound grows with it."""
    ours, expected = compare("tq3", 2, 1, dim=dim, block_size=16, recent=5, sinks=2, window=9,
                             step=[(1, 21), (4, 20)], history=[(20, 20), (16, 16)])
    torch.testing.assert_close(ours, expected, atol=TOL * dim / 64, rtol=0)


@pytest.mark.parametrize("splits", [2, 4])
def test_split_kv(splits, monkeypatch):
    """The KV range split over programs (what long contexts get), splits with no visible key included,
    with the 16-bit window and a sliding window: both accumulators merged, as without splits."""
    paged = kernels("paged_attention")
    monkeypatch.setattr(paged, "choose_splits", lambda programs, longest: splits)
    ours, expected = compare("tq3-qjl", 4, 2, recent=6, sinks=2, window=7)
    torch.testing.assert_close(ours, expected, atol=TOL, rtol=0)
