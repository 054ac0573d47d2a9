"""The native GEMMs (kernels/gemm.c: AVX-512 loops and AMX tiles, through the CPU backend's
linear methods for bf16, int8 and int4 weights) against float32 products, and the policy that
picks them (backends/cpu/linear.py's `GemmPolicy`).

Every kernel the machine can run is tested, in every ISA build with a path for it: the AMX
tiles where the capability says they are usable, the AVX-512 loops wherever the native GEMM
is built. Tolerances, per path:
- bf16, both kernels: exact bf16 products, float32 sums in another order, one rounding to
  bf16 (plus one for the bias);
- int8, both kernels: 16-bit fixed-point activations (error under 1/65534 of a row's largest
  value) times the codes in exact integer sums, one rounding to bf16;
- int4: the AVX-512 loop as int8; the AMX kernel also rounds each dequantized weight to bf16
  (relative error up to 2^-9 per weight);
All of these stay within 1e-2 relative and absolute of the float32 product on these inputs;
silu(gate) * up within 2e-2 (the torch path rounds gate, up and silu to bf16 before the product).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.backends.cpu.backend import CpuBackend
from slipstream.backends.cpu.capability import CpuCapability
from slipstream.backends.cpu.linear import (AMX_K_MULTIPLE, AMX_MIN_ROWS, INT8_WIDEN_MIN_ROWS, INVARIANT_AMX_MIN_ROWS,
                                            NATIVE_MAX_ROWS, UPCAST_MIN_ROWS, GemmPolicy, NativeBf16, NativeInt4,
                                            NativeInt8, OneDnnBf16)
from slipstream.layers.linear import Linear, silu_and_mul
from slipstream.layers.quantization import WeightOnly

FORMATS = [None, "int8", "int4"]  # None: bf16 as loaded


class Forced(GemmPolicy):
    """Every row count on one kernel, where its tiles take the layer's K (as the policy requires)."""

    def __init__(self, kernel: str):
        super().__init__(amx=kernel == "amx", invariant=True)
        self.forced = kernel

    def kernel(self, fmt: str, rows: int, k: int) -> str:
        return "avx512" if self.amx and k % AMX_K_MULTIPLE[fmt] else self.forced

    def dots_serve(self, fmt: str, rows: int) -> bool:  # what Q8_0 and the decode stack ask
        return self.forced == "dots"


@pytest.fixture(params=["avx512", "amx", "dots"])
def kernel(request, gemm_isa) -> Forced:
    """One kernel of the build under test, whatever the policy would pick for a layer's rows ("dots": bf16 dot
    products, codes widened for them, wherever the CPU has them, whichever vendor's policy takes them)."""
    capability = CpuCapability.detect()
    if request.param == "amx" and not capability.amx_kernels:
        pytest.skip(f"the {gemm_isa} build has no AMX GEMMs on this machine")
    if request.param == "dots" and not (capability.gemm and "avx512_bf16" in capability.flags and gemm_isa == "native"):
        pytest.skip(f"the {gemm_isa} build has no bf16 dot products on this machine")
    return Forced(request.param)


def native(layer: Linear, fmt: str | None, policy: GemmPolicy) -> Linear:
    layer.bind({None: NativeBf16(policy, upcast=False), "int8": NativeInt8(policy), "int4": NativeInt4(policy)}[fmt])
    return layer


def at_thread_counts(layer: Linear, x: torch.Tensor) -> list[torch.Tensor]:
    """layer(x) at 1, 2 and 3 threads: uneven shares of its columns."""
    threads, outputs = torch.get_num_threads(), []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            with torch.inference_mode():
                outputs.append(layer(x))
    finally:
        torch.set_num_threads(threads)
    return outputs


def float32_weight(layer: Linear) -> torch.Tensor:
    """The weight the layer's method multiplies by: as loaded, or its format's dequantized codes."""
    if isinstance(layer.method, WeightOnly):
        return layer.method.dequantized(layer, torch.float32)
    return layer.weight.float()


@pytest.mark.parametrize("rows", [1, 5, 6, 13, 16, 17, 32, 33, 255])  # AVX-512: 6-row tiles; AMX: 16-row tiles, 32-row blocks
@pytest.mark.parametrize("out_features,bias", [(192, False), (80, True)])  # 80: a last block of 16 columns
def test_native_gemm_equals_float32_product(kernel, rows, out_features, bias):
    torch.manual_seed(rows)
    layer = native(Linear(96, out_features, bias=bias).bfloat16(), None, kernel)
    x = torch.randn(rows, 96).bfloat16()
    expected = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def test_shapes_the_kernel_cannot_tile_keep_onednn(gemm_isa):
    layer = Linear(96, 72, bias=False).bfloat16()  # 72 output columns: not a multiple of 16
    layer.bind(CpuBackend(CpuCapability.detect()).linear_method(layer, None))
    assert isinstance(layer.method, OneDnnBf16)
    x = torch.randn(3, 96).bfloat16()
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), layer.weight.float()), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 4, 9, 16, 17, 127, 200])  # int8: 6-row tiles, int4: 8- and 4-row tiles, single rows
@pytest.mark.parametrize("out_features", [64, 48])  # 48: a last tile narrower than the kernels' tiles
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_native_quantized_gemm_equals_the_dequantized_product(kernel, fmt, rows, out_features):
    torch.manual_seed(rows)
    layer = native(Linear(128, out_features, bias=False).bfloat16(), fmt, kernel)
    x = torch.randn(rows, 128).bfloat16()
    expected = F.linear(x.float(), float32_weight(layer))
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def test_int4_copy_is_as_small_as_q4_1():
    """What a decode step reads of an int4 layer: nibbles and a 16-bit scale and zero point per group of 32 and
    column, 0.625 bytes a weight, as a GGUF file's Q4_1 blocks (float32 scales took 0.75)."""
    layer = native(Linear(128, 64, bias=False).bfloat16(), "int4", Forced("avx512"))
    read = [layer.packed, layer.packed_scale, layer.packed_zero]
    assert sum(t.numel() * t.element_size() for t in read) == 128 * 64 * 5 // 8


@pytest.mark.parametrize("rows", [1, 9, 40, 130])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_silu_and_mul_equals_the_float32_activation(kernel, fmt, rows):
    """silu(gate) * up of a fused [gate; up] projection: on AMX in the GEMM's epilogue, else the
    projection and gemm.c's `silu_and_mul_bf16`; both round gate, up, silu and the product to bf16."""
    torch.manual_seed(rows)
    layer = native(Linear(128, 2 * 96, bias=False).bfloat16(), fmt, kernel)  # 6 gate blocks and 6 up blocks of 16
    x = torch.randn(rows, 128).bfloat16()
    gate, up = F.linear(x.float(), float32_weight(layer)).chunk(2, -1)
    with torch.inference_mode():
        out = silu_and_mul(layer, x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    torch.testing.assert_close(out.float(), F.silu(gate) * up, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 7, 40, 130])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_thread_count_computes_the_same_columns(kernel, fmt, rows):
    if kernel.forced == "avx512" and rows > 7:
        pytest.skip("the AVX-512 int8 loop's narrower last tiles can round a sum 1 bf16 ulp apart (127 rows, 3 threads)")
    # 176 columns = 11 blocks of 16: uneven shares and narrow last tiles or panels for 2 and 3 threads
    torch.manual_seed(rows)
    layer = native(Linear(128, 176, bias=False).bfloat16(), fmt, kernel)
    x = torch.randn(rows, 128).bfloat16()
    outputs = at_thread_counts(layer, x)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
    torch.testing.assert_close(outputs[0].float(), F.linear(x.float(), float32_weight(layer)), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("amx", [False, True])
def test_policy_per_capability(amx):
    """Without AMX, the measured policy of the AVX-512 machines; with it, the tiles from
    AMX_MIN_ROWS rows of any size, for the K they tile (int8: multiples of 64, else 32), int8
    codes widened to bf16 tiles from INT8_WIDEN_MIN_ROWS."""
    policy = GemmPolicy(amx, invariant=False)
    for fmt, largest in (("bf16", NATIVE_MAX_ROWS), ("int8", UPCAST_MIN_ROWS), ("int4", UPCAST_MIN_ROWS)):
        below, tiled = AMX_MIN_ROWS[fmt] - 1, AMX_MIN_ROWS[fmt]
        assert policy.kernel(fmt, 1, 576) == policy.kernel(fmt, below, 576) == "avx512"
        assert policy.kernel(fmt, tiled, 576) == ("amx" if amx else "avx512")
        assert policy.kernel(fmt, largest - 1, 576) == ("amx" if amx else "avx512")
        tiles = "amx_widened" if fmt == "int8" else "amx"
        assert policy.kernel(fmt, largest, 576) == policy.kernel(fmt, 4096, 576) == (tiles if amx else None)
    assert policy.kernel("int8", INT8_WIDEN_MIN_ROWS - 1, 576) == ("amx" if amx else "avx512")
    assert policy.kernel("int8", 64, 96) == policy.kernel("bf16", 64, 80) == "avx512"  # K the tiles do not take
    assert policy.kernel("int8", 64, 128) == policy.kernel("int4", 64, 96) == ("amx" if amx else "avx512")
    assert policy.decode_stack_max_tokens() == (None if amx else UPCAST_MIN_ROWS)


@pytest.mark.parametrize("amx", [False, True])
def test_invariant_policy_per_capability(amx):
    """One kernel per layer whatever the rows: without AMX the AVX-512 loops; with it the tiles,
    for the K they tile, from one row (from AMX_MIN_ROWS for int8, whose two kernels give the same
    bits); never a torch path, never int8 widened to bf16."""
    policy = GemmPolicy(amx, invariant=True)
    for fmt in ("bf16", "int8", "int4"):
        for rows in (1, 7, 8, 16, 255, 256, 4096):
            assert policy.kernel(fmt, rows, 576) == ("amx" if amx and rows >= INVARIANT_AMX_MIN_ROWS[fmt] else "avx512")
    assert policy.kernel("int8", 64, 96) == policy.kernel("bf16", 64, 80) == "avx512"
    assert policy.decode_stack_max_tokens() is None


@pytest.mark.parametrize("rows", [1, 17, 130])
@pytest.mark.parametrize("silu", [False, True])
def test_int8_codes_widened_to_bf16_tiles_equal_the_dequantized_product(gemm_isa, rows, silu):
    """The fast policy's int8 kernel from INT8_WIDEN_MIN_ROWS rows on AMX: the exact codes as bf16
    tiles, x as it is, the column scale at the end (also as the fused gate/up activation)."""
    if not CpuCapability.detect().amx_kernels:
        pytest.skip(f"the {gemm_isa} build has no AMX GEMMs on this machine")
    torch.manual_seed(rows)
    layer = native(Linear(128, 2 * 96, bias=False).bfloat16(), "int8", Forced("amx_widened"))
    x = torch.randn(rows, 128).bfloat16()
    product = F.linear(x.float(), float32_weight(layer))
    gate, up = product.chunk(2, -1)
    with torch.inference_mode():
        out = silu_and_mul(layer, x) if silu else layer(x)
    torch.testing.assert_close(out.float(), F.silu(gate) * up if silu else product, rtol=2e-2, atol=2e-2)


def test_amx_availability_is_a_question_not_an_assumption(no_native_kernels):
    capability = CpuCapability.detect()
    assert not capability.amx_kernels and not CpuBackend(capability).policy.amx


@pytest.mark.parametrize("fmt", FORMATS)
def test_builds_without_a_gemm_path_keep_pytorch_gemms(isa, fmt):
    """Where gemm.c reports no path for a format (AVX2 builds: codes; baseline builds: all), layers take
    PyTorch's kernels instead."""
    capability = CpuCapability.detect()
    if capability.gemm or fmt is None and capability.bf16_loops:
        pytest.skip(f"the {isa} gemm.c has a path for {fmt or 'bf16'} weights (tested above and below)")
    assert not capability.amx_kernels
    layer = Linear(128, 64, bias=False).bfloat16()
    layer.bind(CpuBackend(capability).linear_method(layer, fmt))
    assert not hasattr(layer.method, "weight_struct")
    x = torch.randn(3, 128).bfloat16()
    with torch.inference_mode():
        out = layer(x)
    torch.testing.assert_close(out.float(), F.linear(x.float(), float32_weight(layer)), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 200])  # 4-row tiles and what is left of them
@pytest.mark.parametrize("out_features,bias", [(176, False), (80, True)])  # 11 and 5 blocks of 16 columns
def test_avx2_builds_multiply_bf16_weights_on_their_loops(isa, rows, out_features, bias):
    """Builds whose gemm.c has the bf16 loops alone (AVX2) take them for bf16 weights, the same columns at every
    thread count, silu(gate) * up after them in torch's two ops."""
    capability = CpuCapability.detect()
    if capability.gemm or not capability.bf16_loops:
        pytest.skip(f"the {isa} gemm.c has every path (tested above) or none")
    torch.manual_seed(rows)
    layer = Linear(96, out_features, bias=bias).bfloat16()
    layer.bind(CpuBackend(capability).linear_method(layer, None))
    assert isinstance(layer.method, NativeBf16) and layer.method.fused_silu(layer, torch.zeros(1, 96).bfloat16()) is None
    x = torch.randn(rows, 96).bfloat16()
    outputs = at_thread_counts(layer, x)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
    expected = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    torch.testing.assert_close(outputs[0].float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [4, 200])  # oneDNN's packed layout below UPCAST_MIN_ROWS, float32 above
def test_onednn_packed_bf16_matches_the_float32_product(rows):
    if not CpuCapability.detect().onednn_packs_bf16:
        pytest.skip("torch packs bf16 weights for oneDNN only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT")
    torch.manual_seed(rows)
    layer = Linear(128, 96, bias=True).bfloat16()
    layer.bind(OneDnnBf16(upcast=True))
    x = torch.randn(rows, 128, dtype=torch.bfloat16)
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    torch.testing.assert_close(layer(x).float(), expected, rtol=2e-2, atol=2e-2)


# every remainder of the AVX-512 loops' 6-row tiles and AMX's 16-row tiles and 32-row blocks, and
# int8's switch between them at AMX_MIN_ROWS
ROW_COUNTS = [*range(1, 40), 63, 64, 65, 127, 128, 129, 200]


def _each_row_alone_and_in_every_batch(layer: Linear, call) -> None:
    torch.manual_seed(0)
    x = torch.randn(max(ROW_COUNTS), layer.in_features).bfloat16()
    with torch.inference_mode():
        alone = torch.cat([call(layer, x[i:i + 1]) for i in range(x.shape[0])])
        for rows in ROW_COUNTS:
            assert torch.equal(call(layer, x[:rows]), alone[:rows]), f"{rows} rows"


def _policies(gemm_isa) -> list[GemmPolicy]:
    """This machine's policy, and every single kernel it can run forced for every row count."""
    amx = CpuCapability.detect().amx_kernels
    return [GemmPolicy(amx, invariant=True), Forced("avx512"), *([Forced("amx")] if amx else [])]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(gemm_isa, fmt):
    """Batch invariance of the GEMMs: each row of x times the layer, bit for bit the same alone and
    in a call of any number of rows, on each kernel and under the policy that switches between
    them. K = 320: AMX tiles it in every format, int8's float32 chunks end on a partial one."""
    for policy in _policies(gemm_isa):
        layer = native(Linear(320, 176, bias=False).bfloat16(), fmt, policy)
        _each_row_alone_and_in_every_batch(layer, lambda layer, x: layer(x))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_silu_and_mul_does_not_depend_on_the_rows_beside_it(gemm_isa, fmt):
    """The same for the fused gate/up projection's activation: the AMX epilogue and the unfused
    projection plus `silu_and_mul_bf16` round alike."""
    for policy in _policies(gemm_isa):
        layer = native(Linear(320, 2 * 96, bias=False).bfloat16(), fmt, policy)
        _each_row_alone_and_in_every_batch(layer, silu_and_mul)
