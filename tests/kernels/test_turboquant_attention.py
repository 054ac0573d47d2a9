"""The native TurboQuant kernels, in every kernel build, against their torch twins, on a real paged layout.

Decode attention (kernels/turboquant_attention.c) must equal the torch code path (`_attend`
on codes) and dequantize-then-attend to 1e-5 (both run in float32; the kernel sums in another
order), and the encoder (kernels/turboquant_encode.c) must write the bytes `quantize` returns,
up to one fp16 ulp in a stored norm.
"""
from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from slipstream.attention import reference, turboquant
from slipstream.backends.cpu.attention import turboquant_decode, turboquant_decode_step
from slipstream.backends.cpu.backend import CpuBackend
from slipstream.backends.cpu.capability import CpuCapability
from slipstream.kvcache.dtype import TQ_BITS, parse_kv_cache_dtype
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache, _native_write, native_encoder
from tests.conftest import step_metadata
from tests.kernels.test_paged_attention import shuffled_block_tables

DTYPES = ["tq4", "tq3.5", "tq3", "tq2.5", "tq2", "tq3-qjl", "tq4-qjl"]
# every build: the AVX-512, AVX2 and plain-C decoders each sum in their own order
# (measured max |diff| 4.7e-6 native with AVX-512, 4.6e-6 x86-64-v3, 4.2e-6 x86-64)
TOL = 1e-5


def _cache(kv_dtype: str, kv_heads: int, num_heads: int, num_blocks: int, block_size: int = 16,
           recent: int = 0, sinks: int = 0, dense_dtype: torch.dtype = torch.float32, dim: int = 64) -> TurboQuantLayerCache:
    spec = parse_kv_cache_dtype(kv_dtype, torch.float32)
    cache = TurboQuantLayerCache(num_blocks, block_size, kv_heads, dim, spec.key_bits, spec.key_mode, seed=3,
                                 device=torch.device("cpu"), recent_tokens=recent,
                                 num_staging=num_blocks if recent or sinks else 0, dense_dtype=dense_dtype,
                                 sink_tokens=sinks, value_bits=spec.value_bits)
    g = torch.Generator().manual_seed(1)
    channels = torch.linspace(0.2, 5.0, dim)  # uneven channel RMS: a key scale and outlier channels that matter
    cache.calibrate(torch.randn(256, num_heads, dim, generator=g), torch.randn(256, kv_heads, dim, generator=g) * channels + 1,
                    torch.randn(256, kv_heads, dim, generator=g))
    return cache


def _decode_step(kv_dtype: str, lens: list[int], num_heads: int, kv_heads: int, block_size: int = 16, dim: int = 64):
    """A decode step over a filled cache whose blocks were handed out shuffled; tables padded with 0."""
    torch.manual_seed(0)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = _cache(kv_dtype, kv_heads, num_heads, num_blocks, block_size, dim=dim)
    every_slot = torch.arange(num_blocks * block_size)
    cache.write(torch.randn(len(every_slot), kv_heads, dim) * 3 + 1, torch.randn(len(every_slot), kv_heads, dim), every_slot)
    tables = shuffled_block_tables(lens, block_size, num_blocks)
    meta = step_metadata([1] * len(lens), lens, tables, torch.zeros(0, dtype=torch.long))
    return torch.randn(len(lens), num_heads, dim), cache, meta


@contextlib.contextmanager
def _kernel_threads(count: int):
    """The kernel's threads (torch's): a decode task takes every KV head of its sequence unless the longest
    sequence is more than a thread's share of the step, so 1 thread runs a task per sequence in these tests and
    4 one per KV head; with fewer tasks than 4 threads, long sequences are split into parts (part_limit in
    kernels/turboquant_attention.c: [1, 17, 100, 16, 250] at 4 threads splits the 100 and 250)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(before)


@pytest.fixture(params=[1, 4])
def threads(request):
    with _kernel_threads(request.param) as count:
        yield count


def _kernel_decode(q, cache, meta, window):
    out = turboquant_decode(q.view(*q.shape[:1], cache.k.shape[2], -1, q.shape[-1]), None, None, cache,
                                    meta.decode_block_tables, meta.decode_context_lens, 0.125, window)
    assert out is not None
    return out.reshape(q.shape)


def _torch_decode(q, cache, meta, window):
    """The torch code path: scores and weighted sums on codes gathered through padded tables."""
    keys, values = cache.codes_by_head(meta.decode_block_tables)
    visible = reference.decode_mask(keys.shape[2], meta.decode_context_lens, window)
    out = turboquant._attend(q.view(len(q), keys.shape[1], -1, q.shape[-1]), keys, values, visible[:, None, None, :], cache, 0.125)
    return out.reshape(q.shape)


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("num_heads,kv_heads", [(9, 3), (4, 1), (6, 2)])  # GQA (SmolLM2), MQA (Gemma 3), group 3
@pytest.mark.parametrize("window", [None, 20])
def test_kernel_equals_torch_code_path_and_dequantize_then_attend(isa, threads, kv_dtype, num_heads, kv_heads, window):
    q, cache, meta = _decode_step(kv_dtype, [1, 17, 100, 16, 250], num_heads, kv_heads)
    ours = _kernel_decode(q, cache, meta, window)
    assert (ours - _torch_decode(q, cache, meta, window)).abs().max() < TOL
    assert (ours - reference.decode(q, cache, meta, 0.125, window)).abs().max() < TOL


def test_a_task_per_sequence_or_per_kv_head_gives_the_same_bits(isa):
    q, cache, meta = _decode_step("tq3", [1, 17, 100, 16, 250, 30], 9, 3)  # 18 tasks at 4 threads: none split
    outputs = []
    for count in (1, 4):  # a task per sequence, a task per KV head
        with _kernel_threads(count):
            outputs.append(_kernel_decode(q, cache, meta, None))
    assert torch.equal(*outputs)


@pytest.mark.parametrize("num_heads,kv_heads", [(9, 3), (4, 1)])
@pytest.mark.parametrize("window", [None, 200])
def test_one_sequence_split_over_two_threads_equals_the_torch_path(isa, num_heads, kv_heads, window):
    """One sequence's tasks (one per KV head) leave a thread idle: its tokens are split into parts whose sums
    merge (at 2 threads, each KV head's 300 tokens, or the window's 200, in 2 parts cut at a block edge)."""
    q, cache, meta = _decode_step("tq3", [300], num_heads, kv_heads)
    with _kernel_threads(2):
        assert (_kernel_decode(q, cache, meta, window) - _torch_decode(q, cache, meta, window)).abs().max() < TOL


def test_kernel_on_every_key_value_split(isa):
    """Keys and values at their own widths (tq-k{K}v{V}, QJL keys too): the kernel reads each side's row
    layout, so every split offered must agree with the torch code path."""
    for key_bits, value_bits in itertools.product(TQ_BITS.values(), repeat=2):
        for suffix in ("", "-qjl"):
            kv_dtype = f"tq-k{key_bits:g}v{value_bits:g}{suffix}"
            q, cache, meta = _decode_step(kv_dtype, [1, 40, 77], 6, 2)
            diff = (_kernel_decode(q, cache, meta, None) - _torch_decode(q, cache, meta, None)).abs().max()
            assert diff < TOL, (kv_dtype, diff)


@pytest.mark.parametrize("kv_dtype", ["tq3", "tq2.5", "tq4-qjl"])
@pytest.mark.parametrize("dim", [128, 256])  # Gemma 3: head_dim 256, one KV head, sliding-window layers
def test_kernel_with_larger_heads(isa, kv_dtype, dim):
    q, cache, meta = _decode_step(kv_dtype, [40, 77], 4, 1, dim=dim)
    # a score sums `dim` float32 products, in an order the torch path's BLAS picks per CPU: on an AMD EPYC (Zen 4)
    # up to 1.5e-5 at 256, 3.4e-6 at 128 (outputs up to 4.3)
    tol = TOL * dim / 64
    for window in (None, 20):
        assert (_kernel_decode(q, cache, meta, window) - _torch_decode(q, cache, meta, window)).abs().max() < tol


@pytest.mark.parametrize("group", [5, 8])  # the generic, not specialised, group sizes
@pytest.mark.parametrize("block_size", [8, 16])  # 16: AVX-512 scores a block's rows at once
def test_kernel_with_other_group_sizes(isa, group, block_size):
    q, cache, meta = _decode_step("tq3", [33, 70], group * 2, 2, block_size=block_size)
    assert (_kernel_decode(q, cache, meta, None) - _torch_decode(q, cache, meta, None)).abs().max() < TOL


def test_kernel_reads_only_each_sequence_blocks(isa):
    """A NaN norm in a block no table points to, or past a sequence's length, must not reach any output
    (a whole block's key rows are scored at once on AVX-512: those past the length must be dropped)."""
    q, cache, meta = _decode_step("tq3", [5, 40], 6, 2)
    used = set(meta.decode_block_tables.flatten().tolist())
    free = next(b for b in range(cache.k.shape[0]) if b not in used)
    cache.k[free] = 0xFF  # every fp16 in these rows reads as NaN
    cache.k[meta.decode_block_tables[0, 0], 5:] = 0xFF  # slots after the 5 tokens of sequence 0
    cache.v[meta.decode_block_tables[0, 0], 5:] = 0xFF
    assert torch.isfinite(_kernel_decode(q, cache, meta, None)).all()


@pytest.mark.parametrize("recent,sinks", [(20, 4), (0, 4), (20, 0)])
@pytest.mark.parametrize("dense_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 12])
# 16 x 90: whole blocks between the windows; 16 x 24: the sinks and the recent window meet inside block 0
@pytest.mark.parametrize("block_size,lens", [(4, [37, 9]), (16, [90, 9]), (16, [24, 9])])
def test_kernel_with_recent_and_sink_tokens_equals_the_torch_path(isa, threads, recent, sinks, dense_dtype, window,
                                                                  block_size, lens):
    """With 16-bit windows the kernel reads staged tokens (and the query's own) in 16 bits, the rest from codes."""
    q, k, v, cache, meta = _windowed_step(recent, sinks, dense_dtype, block_size, lens, 6, 2)
    assert cache.window.exists(meta.decode_block_tables[0]).any()
    ours = turboquant._decode(q, k, v, cache, meta, 0.125, window, turboquant_decode)
    assert (ours - turboquant._decode(q, k, v, cache, meta, 0.125, window)).abs().max() < TOL


@pytest.mark.parametrize("recent,length", [(64, 60), (20, 60)])
def test_a_split_sequence_that_reads_no_code_or_some_equals_the_torch_path(isa, recent, length):
    """One MQA sequence at 2 threads is split into parts (part_limit). Every token in the window (a Gemma 3 sliding
    layer's case) reads no code, so no query is rotated into code space nor sums out of it; with a 20-token window
    the first part reads codes and the last does not, and the merged sums are rotated back."""
    q, k, v, cache, meta = _windowed_step(recent, 4, torch.bfloat16, 4, [length], 4, 1)
    with _kernel_threads(2):
        ours = turboquant._decode(q, k, v, cache, meta, 0.125, None, turboquant_decode)
    assert (ours - turboquant._decode(q, k, v, cache, meta, 0.125, None)).abs().max() < TOL


def _windowed_step(recent: int, sinks: int, dense_dtype: torch.dtype, block_size: int, lens: list[int],
                   num_heads: int, kv_heads: int):
    """(q, k, v, cache, meta) of a decode step after a prefill of all but each sequence's last token, so that the
    16-bit window's staging follows the engine's rules."""
    q, k, v, cache, meta = _decode_after_prefill(recent, sinks, dense_dtype, block_size, lens, num_heads, kv_heads)
    turboquant.place_staging(cache.window.staging, meta)
    cache.write(k, v, meta.slot_mapping)  # and the window's tokens
    return q, k, v, cache, meta


def _decode_after_prefill(recent: int, sinks: int, dense_dtype: torch.dtype, block_size: int, lens: list[int],
                          num_heads: int, kv_heads: int, dtype: torch.dtype = torch.float32):
    """`_windowed_step`'s step before anything of it is written: q, k, v in `dtype` as views of one fused QKV
    projection's rows, as the models hand them over."""
    g = torch.Generator().manual_seed(2)
    cache = _cache("tq3", kv_heads, num_heads, 32, block_size, recent, sinks, dense_dtype)
    counts = [-(-n // block_size) for n in lens]
    tables = torch.tensor([list(range(sum(counts[:s]), sum(counts[:s + 1]))) + [0] * (max(counts) - counts[s])
                           for s in range(len(lens))])
    for seq, n in enumerate(lens):
        table = tables[seq, :counts[seq]]
        slots = table[torch.arange(n - 1) // block_size] * block_size + torch.arange(n - 1) % block_size
        meta = step_metadata([n - 1], [n - 1], table[None], slots)
        turboquant.paged_attention(torch.randn(n - 1, num_heads, 64, generator=g),
                                   torch.randn(n - 1, kv_heads, 64, generator=g) * 3 + 1,
                                   torch.randn(n - 1, kv_heads, 64, generator=g), cache, meta, 0.125)
    slots = torch.tensor([tables[s, (n - 1) // block_size] * block_size + (n - 1) % block_size for s, n in enumerate(lens)])
    meta = step_metadata([1] * len(lens), lens, tables, slots)
    qkv = torch.randn(len(lens), (num_heads + 2 * kv_heads) * 64, generator=g).to(dtype)
    q, k, v = qkv.split([num_heads * 64, kv_heads * 64, kv_heads * 64], -1)
    q, k, v = (x.unflatten(-1, (-1, 64)) for x in (q, k, v))
    return q, k, v, cache, meta


@pytest.mark.parametrize("recent,sinks", [(20, 4), (0, 0)])
@pytest.mark.parametrize("dense_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 12])
def test_a_decode_step_in_one_call_equals_its_writes_and_kernel_and_the_torch_path(isa, threads, recent, sinks,
                                                                                  dense_dtype, dtype, window):
    """turboquant_decode_step (decoder_layer.c: the codes, the window's copies and attention in one call) leaves the
    bits that the encoder's and the kernel's calls do, and agrees with the torch path; each sequence's own token and
    those before it in 16 bits where the window stages them (16 x 90: blocks between the windows read codes)."""
    def step(**kernels):
        q, k, v, cache, meta = _decode_after_prefill(recent, sinks, dense_dtype, 16, [90, 9, 33], 6, 2, dtype)
        out = turboquant.paged_attention(q, k, v, cache, meta, 0.125, window, **kernels)
        return out, cache

    (ours, cache), (theirs, calls) = step(decode_step=turboquant_decode_step), step(decode_kernel=turboquant_decode)
    assert ours.dtype == dtype and torch.equal(ours, theirs)
    assert torch.equal(cache.k, calls.k) and torch.equal(cache.v, calls.v)
    if cache.window is not None:
        assert torch.equal(cache.window.k, calls.window.k) and torch.equal(cache.window.v, calls.window.v)
    reference_out, _ = step()
    tol = TOL if dtype == torch.float32 else 2 ** -7 * reference_out.abs().max()  # q and the output in bf16
    assert (ours.float() - reference_out.float()).abs().max() < tol


def test_a_decode_step_declines_rows_it_does_not_read(isa):
    """K/V whose heads are not each token's contiguous run, or in another dtype than q's, are declined (None): the
    step then takes the encoder's and the kernel's calls."""
    q, k, v, cache, meta = _decode_after_prefill(20, 4, torch.float32, 16, [40, 9], 4, 2)
    strided = k.transpose(0, 1).contiguous().transpose(0, 1)  # [B, Hk, D], heads B * D apart
    assert turboquant_decode_step(q, strided, v, cache, meta, 0.125, None) is None
    assert turboquant_decode_step(q, k, v.to(torch.bfloat16), cache, meta, 0.125, None) is None
    assert turboquant_decode_step(q, k, v, cache, meta, 0.125, None) is not None


@pytest.mark.parametrize("kv_dtype", DTYPES + ["tq2-qjl"])
def test_native_encoder_writes_the_bytes_quantize_returns(isa, kv_dtype):
    cache = _cache(kv_dtype, 3, 9, 64)
    x = torch.randn(1024, 3, 64, generator=torch.Generator().manual_seed(4)) * torch.linspace(0.2, 5.0, 64)
    slots = torch.randperm(1024)
    value_scale = torch.linspace(2.0, 0.5, 64).expand(3, 64).contiguous()  # values: a scale and no mean
    for rows, quantizer, scaling in ((cache.k, cache.key_quantizer, (cache.key_mean, cache.key_scale)),
                                     (cache.v, cache.value_quantizer, (None, value_scale))):
        assert _native_write(native_encoder(rows, quantizer, *scaling), rows, x, slots)
        values = x / value_scale if scaling[0] is None else cache.scaled_keys(x)
        ours, want = rows.view(-1, 3, quantizer.nbytes)[slots], quantizer.quantize(values)
        # sums in another order can round a norm to the neighbouring fp16, or move a coordinate that sits on
        # a codebook boundary to the neighbouring code: measured in 0-3 of these 3,072 rows
        assert (ours != want).any(-1).sum() <= 5
        ours, want = quantizer.dequantize(ours), quantizer.dequantize(want)
        error = (ours - want).norm(dim=-1) / want.norm(dim=-1)
        assert error.max() < 0.2 and error.mean() < 1e-3


@pytest.mark.parametrize("dense_dtype", [torch.float32, torch.bfloat16])
def test_native_encoder_mirrors_the_planned_tokens_into_the_window(isa, dense_dtype):
    """The write's copy into the 16-bit window leaves the bits that RecentWindow.write (the reference) does."""
    _, k, v, cache, _ = _windowed_step(6, 4, dense_dtype, 4, [9, 14], 4, 2)
    assert len(cache.window.staging.writes[0]) == 2  # both decode tokens land in staged blocks
    native = cache.window.k.clone(), cache.window.v.clone()
    cache.window.write(k, v)
    assert torch.equal(native[0], cache.window.k) and torch.equal(native[1], cache.window.v)


def test_disabled_native_kernels_fall_back(no_native_kernels):
    _, cache, _ = _decode_step("tq3", [3], 4, 1)
    assert CpuBackend(CpuCapability.detect()).attention(cache) is turboquant.paged_attention
    encoder = native_encoder(cache.k, cache.key_quantizer)
    assert not _native_write(encoder, cache.k, torch.randn(1, 1, 64), torch.tensor([0]))


def test_rows_without_slack_take_the_torch_path(isa):
    """The kernel's wide loads may run past the last row: it only reads rows allocated with the slack after them."""
    q, cache, meta = _decode_step("tq3", [20], 4, 1)
    args = (q.view(1, 1, 4, 64), None, None, cache, meta.decode_block_tables, meta.decode_context_lens, 0.125, None)
    assert turboquant_decode(*args) is not None
    cache.k = cache.k.clone()
    assert turboquant_decode(*args) is None
