"""The native paged-attention and cache-write kernels, in every kernel build, against the torch
reference, on a real paged layout; and a token's attention output the same bits however its
prompt was chunked (batch invariance)."""
from __future__ import annotations

import pytest
import torch

from slipstream.attention import reference
from slipstream.attention.metadata import PrefillChunk
from slipstream.backends.cpu.attention import attend, dense_attention, dense_decode, dense_prefill
from slipstream.backends.cpu.backend import CpuBackend
from slipstream.backends.cpu.capability import CpuCapability
from slipstream.backends.cpu import abi, build
from slipstream.kvcache.cache import LayerKVCache
from tests.conftest import step_metadata


def shuffled_block_tables(lens: list[int], block_size: int, num_blocks: int) -> torch.Tensor:
    """[B, most blocks] tables (padded with 0) over blocks handed out shuffled, as after frees and reuse."""
    order = torch.randperm(num_blocks)
    tables = torch.zeros(len(lens), max(-(-n // block_size) for n in lens), dtype=torch.long)
    used = 0
    for i, n in enumerate(lens):
        count = -(-n // block_size)
        tables[i, :count] = order[used:used + count]
        used += count
    return tables


def _decode_step(lens: list[int], num_heads: int, kv_heads: int, dim: int = 64, block_size: int = 16,
                 q_dtype: torch.dtype = torch.bfloat16, cache_dtype: torch.dtype = torch.bfloat16):
    torch.manual_seed(0)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = LayerKVCache(num_blocks, block_size, kv_heads, dim, cache_dtype, torch.device("cpu"))
    cache.k.normal_()
    cache.v.normal_()
    tables = shuffled_block_tables(lens, block_size, num_blocks)
    meta = step_metadata([1] * len(lens), lens, tables, torch.zeros(0, dtype=torch.long))
    q = torch.randn(len(lens), num_heads, dim, dtype=q_dtype)
    return q, cache, meta


@pytest.mark.parametrize("num_heads,kv_heads", [(9, 3), (4, 1), (4, 4)])  # GQA (SmolLM2), MQA (Gemma 3), MHA
@pytest.mark.parametrize("window", [None, 20])
def test_kernel_equals_reference_decode(isa, num_heads, kv_heads, window):
    q, cache, meta = _decode_step([1, 17, 100, 16, 250], num_heads, kv_heads)
    ours = attend(q, cache, meta, 0.125, window)
    ref = reference.decode(q, cache, meta, 0.125, window)
    # the reference rounds scores and probabilities to bf16; the kernel keeps them in fp32 (in every
    # build: plain C that the compiler vectorizes per ISA; measured 0.0032 from fp32 in each)
    exact = reference.decode(q.float(), _float_cache(cache), meta, 0.125, window)
    assert (ours.float() - exact).abs().max() < 0.02
    assert (ours.float() - exact).abs().max() <= (ref.float() - exact).abs().max() + 0.01


@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("num_heads,kv_heads,dim", [(9, 3, 64), (4, 1, 256), (4, 2, 40)])  # the last: no vector path
@pytest.mark.parametrize("window", [None, 20])
def test_kernel_takes_float32_queries_and_caches(isa, q_dtype, cache_dtype, num_heads, kv_heads, dim, window):
    """A float32 model's decode over its own float32 cache (dtype auto) or a bf16 one: the output in the queries'
    dtype, within float32 rounding of the torch path in float32 (which reads a bf16 cache's values exactly)."""
    q, cache, meta = _decode_step([1, 17, 100, 16, 250], num_heads, kv_heads, dim, q_dtype=q_dtype,
                                  cache_dtype=cache_dtype)
    ours = dense_decode(q, cache, meta, 0.125, window)
    exact = reference.decode(q.float(), _float_cache(cache), meta, 0.125, window)
    assert ours is not None and ours.dtype == q_dtype
    assert (ours.float() - exact).abs().max() < (1e-5 if q_dtype == torch.float32 else 0.02)


def _float_cache(cache: LayerKVCache) -> LayerKVCache:
    heads, blocks, block_size, dim = cache.k.shape
    out = LayerKVCache(blocks, block_size, heads, dim, torch.float32, torch.device("cpu"))
    out.k.copy_(cache.k)
    out.v.copy_(cache.v)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_reads_only_each_sequence_blocks(isa, dtype):
    """A NaN in a block no table points to, or past a sequence's length, must not reach any output."""
    q, cache, meta = _decode_step([5, 40], 6, 2, q_dtype=dtype, cache_dtype=dtype)
    used = set(meta.decode_block_tables.flatten().tolist())
    free = next(b for b in range(cache.k.shape[1]) if b not in used)
    cache.k[:, free] = float("nan")
    last = meta.decode_block_tables[0, 0]
    cache.v[:, last, 5:] = float("nan")  # slots after the 5 tokens of sequence 0
    out = attend(q, cache, meta, 0.125, None)
    assert torch.isfinite(out).all()


def test_disabled_native_kernels_fall_back(no_native_kernels):
    _, cache, _ = _decode_step([3], 4, 1)
    assert abi.kernels() is None
    assert CpuBackend(CpuCapability.detect()).attention(cache) is reference.paged_attention


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_backend_binds_the_kernel_to_bf16_and_float32_caches(isa, deterministic):
    """Every query through the kernel where batch-invariant or where its AVX-512 build runs without AMX (it
    outruns SDPA there), else decode rows only (SDPA for prefill); a float32 cache's decode rows only."""
    backend = CpuBackend(CpuCapability.detect(), deterministic)
    assert backend.batch_invariant == (deterministic and backend.capability.gemm)  # builds without gemm.c: never
    _, cache, _ = _decode_step([3], 4, 1)
    bound = backend.attention(cache)
    cap = backend.capability
    assert backend.every_query_native == (backend.batch_invariant or cap.gemm and not cap.amx_kernels)
    if backend.every_query_native:
        assert bound is dense_attention
    else:
        assert bound.func is reference.paged_attention and bound.keywords == {"decode_kernel": dense_decode}
    bound = backend.attention(_float_cache(cache))
    assert bound.func is reference.paged_attention and bound.keywords == {"decode_kernel": dense_decode}


CHUNKINGS = [[70], [33, 37], [16, 16, 38], [5] + [1] * 65]  # the last: a 5-token chunk, then 65 decodes


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 256)])  # SmolLM2's GQA, Gemma 3's MQA
@pytest.mark.parametrize("window", [None, 20])
def test_a_tokens_attention_does_not_depend_on_how_its_prompt_was_chunked(isa, window, heads, kv_heads, dim):
    """70 tokens written and attended in chunks of any size, or one at a time as decode rows: each
    token's output the same bits every time, and within bf16's error of the torch prefill."""
    torch.manual_seed(0)
    n, block_size = 70, 16
    q, k, v = (torch.randn(n, h, dim).bfloat16() for h in (heads, kv_heads, kv_heads))
    table = torch.randperm(8)[:5]  # shuffled blocks, as after frees and reuse
    slots = table[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
    outputs = []
    for chunks in CHUNKINGS:
        cache = LayerKVCache(8, block_size, kv_heads, dim, torch.bfloat16, torch.device("cpu"))
        out, done = [], 0
        for size in chunks:
            rows = slice(done, done + size)
            meta = step_metadata([size], [done + size], [table.tolist()], slots[rows])
            out.append(dense_attention(q[rows], k[rows], v[rows], cache, meta, 0.125, window))
            done += size
        outputs.append(torch.cat(out))
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])
    cache = LayerKVCache(8, block_size, kv_heads, dim, torch.bfloat16, torch.device("cpu"))
    meta = step_metadata([n], [n], [table.tolist()], slots)
    ref = reference.paged_attention(q, k, v, cache, meta, 0.125, window)
    assert (outputs[0].float() - ref.float()).abs().max() < 0.02


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 256)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("length,n", [(75, 30), (30, 30), (64, 16)])  # a run not of whole blocks; a first chunk
def test_a_chunk_over_a_run_of_kv_equals_the_torch_prefill(isa, heads, kv_heads, dim, window, length, n):
    """dense_prefill (TurboQuant's chunks over 16-bit K/V only) as reference.prefill_attention: the last n of the
    run's tokens are the chunk's own, causal, within the window."""
    torch.manual_seed(1)
    q = torch.randn(n, heads, dim).bfloat16()
    k, v = (torch.randn(kv_heads, length, dim).bfloat16() for _ in range(2))
    chunk = PrefillChunk(0, n, length, block_table=None)
    ours = dense_prefill(q, k, v, chunk, 0.125, window)
    exact = reference.prefill_attention(q.float(), k.float(), v.float(), chunk, 0.125, window)
    assert ours.dtype == torch.bfloat16 and (ours.float() - exact).abs().max() < 0.02


@pytest.mark.parametrize("tokens", [1, 6])
def test_cache_write_kernel_stores_qkv_views_by_slot_like_torch(isa, monkeypatch, tokens):
    torch.manual_seed(0)
    qkv = torch.randn(tokens, (6 + 2 + 2) * 64).bfloat16()
    k = qkv[:, 6 * 64:8 * 64].view(tokens, 2, 64)
    v = qkv[:, 8 * 64:].view(tokens, 2, 64)
    slots = torch.randperm(5 * 16)[:tokens]
    caches = []
    for native_on in (True, False):
        monkeypatch.setattr(build, "ENABLED", native_on)
        cache = LayerKVCache(5, 16, 2, 64, torch.bfloat16, torch.device("cpu"))
        assert cache._native(k, v) and (abi.kernels() is not None) == native_on
        cache.write(k, v, slots)
        caches.append(cache)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    assert caches[0].k.flatten(1, 2)[:, slots].abs().sum() > 0
