"""The Triton TurboQuant encoder against `TurboQuantizer.quantize`: the same bytes at the same slots,
for every bit width and key mode, keys scaled by the cache's mu and sigma and values by a scale alone, outlier
channels permuted."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.steps import DEVICE, kernels
from tests.gpu.test_triton_turboquant_attention import build_cache

DTYPES = ["tq4", "tq3.5", "tq3", "tq2.5", "tq2", "tq4-qjl", "tq3-qjl", "tq2.5-qjl", "tq2-qjl"]


def encode_both(kv_dtype, dim=64, heads=3, tokens=40):
    kernel = kernels("turboquant_encode")
    cache = build_cache(kv_dtype, heads * 2, heads, dim, 4, 16)
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(tokens, heads, dim, generator=g) * torch.linspace(0.2, 5.0, dim) + 1).to(DEVICE)
    slots = torch.randperm(cache.k.shape[0] * cache.block_size, generator=g)[:tokens].to(DEVICE)
    value_scale = torch.linspace(2.0, 0.5, dim).expand(heads, dim).contiguous().to(DEVICE)  # a scale, no mean
    for rows, quantizer, scaling in ((cache.k, cache.key_quantizer, (cache.key_mean, cache.key_scale)),
                                     (cache.v, cache.value_quantizer, (None, value_scale))):
        kernel.encode(rows, quantizer, x, slots, *scaling)
        values = x / value_scale if scaling[0] is None else cache.scaled_keys(x)
        yield quantizer, rows.view(-1, heads, quantizer.nbytes)[slots], quantizer.quantize(values)


def check(kv_dtype, **shape):
    for quantizer, ours, want in encode_both(kv_dtype, **shape):
        # sums in another order can round a norm to the neighbouring fp16, or move a coordinate that sits
        # on a codebook boundary to the neighbouring code (as for the CPU's encoder): a few rows at most
        assert (ours != want).any(-1).sum() <= 3
        ours, want = quantizer.dequantize(ours), quantizer.dequantize(want)
        error = (ours - want).norm(dim=-1) / want.norm(dim=-1)
        assert error.max() < 0.2 and error.mean() < 1e-3


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_bytes_equal_quantize(kv_dtype):
    check(kv_dtype)


@pytest.mark.parametrize("dim", [128, 256])
def test_larger_heads(dim):
    check("tq2.5-qjl", dim=dim, heads=1, tokens=17)


def test_bad_rows_are_named():
    kernel = kernels("turboquant_encode")
    cache = build_cache("tq3", 2, 1, 64, 4, 4)
    with pytest.raises(ValueError, match="contiguous uint8"):
        kernel.encode(cache.k.float(), cache.key_quantizer, torch.zeros(1, 1, 64, device=DEVICE),
                      torch.zeros(1, dtype=torch.long, device=DEVICE))
