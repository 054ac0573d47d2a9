"""The native GEMMs (kernels/gemm.c: AVX-512 loops and AMX tiles, through Linear after
prepack_weights and the int8 / int4 layers) against float32 products, and the policy that
picks them (layers/linear.py's `native_kernel`).

Every kernel the machine can run is tested: the AMX tiles where `amx_gemm_available()` says
so, the AVX-512 loops wherever the native GEMM is built. Tolerances, per path:
- bf16, both kernels: exact bf16 products, float32 sums in another order, one rounding to
  bf16 (plus one for the bias);
- int8, both kernels: 16-bit fixed-point activations (error under 1/65534 of a row's largest
  value) times the codes in exact integer sums, one rounding to bf16;
- int4: the AVX-512 loop as int8; the AMX kernel also rounds each dequantized weight to bf16
  (relative error up to 2^-9 per weight);
- int8 on AMX from 128 rows: exact codes in bf16 tiles, x as it is, the scale at the end.
All of these stay within 1e-2 relative and absolute of the float32 product on these inputs;
silu(gate) * up within 2e-2 (the torch path rounds gate, up and silu to bf16 before the product).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.backends.cpu import abi
from slipstream.layers import linear, quantization
from slipstream.layers.linear import (AMX_MIN_ROWS, NATIVE_MAX_ROWS, UPCAST_MIN_ROWS, Linear, amx_gemm_available,
                                      native_kernel, prepack_weights, silu_and_mul)
from slipstream.layers.quantization import Int4Linear, Int8Linear


@pytest.fixture(params=["avx512", "amx"])
def kernel(request, gemm_isa, monkeypatch):
    """Every layer's GEMM on one kernel of the build under test, whatever the policy would pick for its rows."""
    chosen = request.param
    if chosen == "amx" and not amx_gemm_available():
        pytest.skip(f"the {gemm_isa} build has no AMX GEMMs on this machine")

    def forced(fmt, rows, k):
        if chosen == "amx" and k % linear.AMX_K_MULTIPLE[fmt]:
            return "avx512"  # the AMX kernels tile these K only; the policy does the same
        return chosen

    monkeypatch.setattr(linear, "native_kernel", forced)
    monkeypatch.setattr(quantization, "native_kernel", forced)
    return chosen


@pytest.mark.parametrize("rows", [1, 5, 6, 13, 16, 17, 32, 33, 255])  # AVX-512: 6-row tiles; AMX: 16-row tiles, 32-row blocks
@pytest.mark.parametrize("out_features,bias", [(192, False), (80, True)])  # 80: a last block of 16 columns
def test_native_gemm_equals_float32_product(kernel, rows, out_features, bias):
    torch.manual_seed(rows)
    layer = Linear(96, out_features, bias=bias).bfloat16()
    prepack_weights(layer)
    assert layer.native
    x = torch.randn(rows, 96).bfloat16()
    expected = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def test_shapes_the_kernel_cannot_tile_keep_onednn(gemm_isa):
    layer = Linear(96, 72, bias=False).bfloat16()  # 72 output columns: not a multiple of 16
    prepack_weights(layer)
    assert not layer.native and layer.packed is not None
    x = torch.randn(3, 96).bfloat16()
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), layer.weight.float()), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 4, 9, 16, 17, 127, 200])  # int8: 6-row tiles, int4: 4-row tiles and single rows
@pytest.mark.parametrize("out_features", [64, 48])  # 48: a last tile narrower than the kernels' tiles
@pytest.mark.parametrize("method", [Int8Linear, Int4Linear])
def test_native_quantized_gemm_equals_the_dequantized_product(kernel, method, rows, out_features):
    torch.manual_seed(rows)
    layer = method(Linear(128, out_features, bias=False).bfloat16())
    assert layer.packed is not None
    x = torch.randn(rows, 128).bfloat16()
    expected = F.linear(x.float(), layer.dequantized(torch.float32))
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 9, 40, 130])  # int8 on AMX: integer tiles below 128 rows, widened codes above
@pytest.mark.parametrize("method", [None, Int8Linear, Int4Linear])
def test_fused_silu_and_mul_equals_the_float32_activation(kernel, method, rows):
    """silu(gate) * up of a fused [gate; up] projection: on AMX in the GEMM's epilogue (float32
    sums, one rounding), else the projection and torch's ops (bf16 gate and up, rounded again)."""
    torch.manual_seed(rows)
    layer = Linear(128, 2 * 96, bias=False).bfloat16()  # 6 gate blocks and 6 up blocks of 16
    if method is None:
        prepack_weights(layer)
    else:
        layer = method(layer)
    x = torch.randn(rows, 128).bfloat16()
    gate, up = F.linear(x.float(), layer.weight.float() if method is None else layer.dequantized(torch.float32)).chunk(2, -1)
    with torch.inference_mode():
        out = silu_and_mul(layer, x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    torch.testing.assert_close(out.float(), F.silu(gate) * up, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 7, 40, 130])
@pytest.mark.parametrize("method", [None, Int8Linear, Int4Linear])
def test_every_thread_count_computes_the_same_columns(kernel, method, rows):
    if kernel == "avx512" and rows > 7:
        pytest.skip("the AVX-512 int8 loop's narrower last tiles can round a sum 1 bf16 ulp apart (127 rows, 3 threads)")
    # 176 columns = 11 blocks of 16: uneven shares and narrow last tiles or panels for 2 and 3 threads
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


@pytest.mark.parametrize("amx", [False, True])
def test_policy_per_capability(monkeypatch, amx):
    """Without AMX, the measured policy of the AVX-512 machines; with it, the tiles from
    AMX_MIN_ROWS rows of any size, for the K they tile (int8: multiples of 64, else 32)."""
    monkeypatch.setattr(linear, "amx_gemm_available", lambda: amx)
    for fmt, largest in (("bf16", NATIVE_MAX_ROWS), ("int8", UPCAST_MIN_ROWS), ("int4", UPCAST_MIN_ROWS)):
        below, tiled = AMX_MIN_ROWS[fmt] - 1, AMX_MIN_ROWS[fmt]
        assert native_kernel(fmt, 1, 576) == native_kernel(fmt, below, 576) == "avx512"
        assert native_kernel(fmt, tiled, 576) == ("amx" if amx else "avx512")
        assert native_kernel(fmt, largest - 1, 576) == ("amx" if amx else "avx512")
        assert native_kernel(fmt, largest, 576) == native_kernel(fmt, 4096, 576) == ("amx" if amx else None)
    assert native_kernel("int8", 64, 96) == native_kernel("bf16", 64, 80) == "avx512"  # K the tiles do not take
    assert native_kernel("int8", 64, 128) == native_kernel("int4", 64, 96) == ("amx" if amx else "avx512")


def test_amx_availability_is_a_question_not_an_assumption(no_native_kernels):
    assert not amx_gemm_available()


@pytest.mark.parametrize("method", [None, Int8Linear, Int4Linear])
def test_builds_without_a_gemm_path_keep_pytorch_gemms(isa, method):
    """Where gemm.c reports no path (AVX2 and baseline builds), layers pack for PyTorch's kernels instead."""
    if abi.kernels().gemm_bf16_available():
        pytest.skip(f"the {isa} gemm.c has a path (tested above)")
    assert not amx_gemm_available()
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
