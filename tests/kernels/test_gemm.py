"""The native small-batch GEMMs (Linear after prepack_weights, Int8Linear, Int4Linear), in every kernel
build with a path for them, against float32 products."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.backends.cpu import abi
from slipstream.layers.linear import Linear, prepack_weights
from slipstream.layers.quantization import Int4Linear, Int8Linear


@pytest.mark.parametrize("rows", [1, 5, 6, 13, 32, 255])  # full 6-row tiles and every remainder
@pytest.mark.parametrize("out_features,bias", [(192, False), (80, True)])  # 80: a last tile of 16 columns
def test_native_gemm_equals_float32_product(gemm_isa, rows, out_features, bias):
    torch.manual_seed(rows)
    layer = Linear(96, out_features, bias=bias).bfloat16()
    prepack_weights(layer)
    assert layer.native
    x = torch.randn(rows, 96).bfloat16()
    expected = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    # exact bf16 products, float32 sums in another order, one rounding to bf16 (plus one for the bias)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def test_shapes_the_kernel_cannot_tile_keep_onednn(gemm_isa):
    layer = Linear(96, 72, bias=False).bfloat16()  # 72 output columns: not a multiple of 16
    prepack_weights(layer)
    assert not layer.native and layer.packed is not None
    x = torch.randn(3, 96).bfloat16()
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), layer.weight.float()), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 4, 9, 127])  # int8: 6-row tiles, int4: 4-row tiles and single rows
@pytest.mark.parametrize("out_features", [64, 48])  # 48: a last tile narrower than the kernels' tiles
@pytest.mark.parametrize("method", [Int8Linear, Int4Linear])
def test_native_quantized_gemm_equals_the_dequantized_product(gemm_isa, method, rows, out_features):
    torch.manual_seed(rows)
    layer = method(Linear(128, out_features, bias=False).bfloat16())
    assert layer.packed is not None
    x = torch.randn(rows, 128).bfloat16()
    expected = F.linear(x.float(), layer.dequantized(torch.float32))
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("method", [None, Int8Linear, Int4Linear])
def test_every_thread_count_computes_the_same_columns(gemm_isa, method, rows):
    # 176 columns = 11 blocks of 16: uneven shares and narrow last tiles for 2 and 3 threads
    torch.manual_seed(rows)
    layer = Linear(128, 176, bias=False).bfloat16()
    if method is None:
        prepack_weights(layer)
    else:
        layer = method(layer)
    x = torch.randn(rows, 128).bfloat16()
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            with torch.inference_mode():
                outputs.append(layer(x))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
    reference = F.linear(x.float(), layer.weight.float() if method is None else layer.dequantized(torch.float32))
    torch.testing.assert_close(outputs[0].float(), reference, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("method", [None, Int8Linear, Int4Linear])
def test_builds_without_a_gemm_path_keep_pytorch_gemms(isa, method):
    """Where gemm.c reports no path (AVX2 and baseline builds), layers pack for PyTorch's kernels instead."""
    if abi.kernels().gemm_bf16_available():
        pytest.skip(f"the {isa} gemm.c has a path (tested above)")
    layer = Linear(128, 64, bias=False).bfloat16()
    if method is None:
        prepack_weights(layer)
    else:
        layer = method(layer)
    assert (layer.packed is None) if method else not layer.native
    x = torch.randn(3, 128).bfloat16()
    with torch.inference_mode():
        out = layer(x)
    reference = F.linear(x.float(), layer.weight.float() if method is None else layer.dequantized(torch.float32))
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)
