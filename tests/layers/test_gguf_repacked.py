"""GGUF's block formats repacked at load for gemm.c's kernels (backends/cpu/gguf_linear.py, gguf_repack.py).

The repacking is exact: the file's bytes come back, memory holds as many bytes as the file (k-quants'
6-bit scales aside, a byte each), and rows dequantize to the torch twin's values (a tied embedding
reads them so). The kernels are
gemm.c's int4 and int8 loops and int4 AMX tiles with float16 scales, held to dequantize-then-multiply
over every tile remainder within 2^-8 of |x| . |W| per output: one bf16 rounding of the output, and on
AMX of each weight (2^-9 each), and 16-bit fixed-point activations (under 2^-15 of the largest of their
group of 32 in the row).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.backends.cpu import gguf_linear
from slipstream.backends.cpu.gguf_linear import NativeBlocks, NativeQ8
from slipstream.backends.cpu.gguf_repack import K_QUANTS, file_blocks
from slipstream.backends.cpu.linear import GemmPolicy
from slipstream.layers.gguf_formats import block_format, dequantize_rows
from slipstream.layers.gguf_linear import GGUFWeight
from slipstream.layers.linear import Linear, silu_and_mul
from tests.kernels.test_gemm import Forced, kernel  # noqa: F401  (a fixture)
from tests.layers.test_gguf_formats import attach_to, random_blocks

REPACKED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
TOL = 2**-8  # of |x| . |W|
K = 512  # two of the k-quants' super-blocks of 256


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    x, w = x.double(), w.double()
    assert ((out.double() - x @ w.T).abs() <= TOL * (x.abs() @ w.abs().T)).all()


def repacked(fmt: str, n: int, k: int, policy: GemmPolicy, seed: int = 0) -> tuple[Linear, torch.Tensor]:
    """A bf16 model's layer of random `fmt` blocks [n, k] bound to its native method, and the blocks."""
    blocks = random_blocks(fmt, n, k, seed=seed)
    layer = Linear(k, n, bias=False)
    attach_to(layer, GGUFWeight.from_blocks(fmt, blocks.clone(), k))
    layer.dtype = torch.bfloat16
    layer.bind((NativeQ8 if fmt == "Q8_0" else NativeBlocks)(policy, upcast=False))
    return layer, blocks


@pytest.mark.parametrize("fmt", REPACKED)
def test_repacking_is_exact_and_costs_no_bytes(fmt):
    layer, blocks = repacked(fmt, 48, K, GemmPolicy(amx=False, invariant=False))
    assert layer.weight is None and not hasattr(layer, "blocks0")
    assert torch.equal(file_blocks(layer), blocks)
    # k-quants keep each 6-bit scale and minimum in a byte: 16 bytes per 256 weights for the file's 12
    assert sum(b.nbytes for b in layer.buffers()) == blocks.nbytes + (48 * K // 256 * 4 if fmt in K_QUANTS else 0)
    # where the layouts have the blocks' size, the buffers are laid over the blocks' own memory
    storages = {b.untyped_storage().data_ptr() for b in layer.buffers()}
    assert len(storages) == (len(list(layer.buffers())) if fmt in K_QUANTS else 1)
    ids = torch.tensor([47, 0, 17, 17, 16])
    assert torch.equal(layer.method.rows(layer, ids), dequantize_rows(block_format(fmt), blocks)[ids])


def test_native_q8_rows_equal_the_torch_twin_and_refuse_ids_outside_the_table(isa):
    """A tied Q8_0 embedding's lookup (kernels/gemm.c `q8_rows`, every ISA build): every column of a 16-row
    tile, repeated ids, the torch twin's values; an id outside the table is an error, not a read beyond it."""
    layer, blocks = repacked("Q8_0", 48, K, GemmPolicy(amx=False, invariant=False))
    ids = torch.tensor([*range(48), 47, 0, 17, 17])
    assert torch.equal(layer.method.rows(layer, ids), dequantize_rows(block_format("Q8_0"), blocks)[ids])
    for outside in (48, -1):
        with pytest.raises(IndexError, match=rf"token ids \[{outside}\]: the table has rows \[0, 48\)"):
            layer.method.rows(layer, torch.tensor([outside]))


def test_a_shard_s_rows_are_repacked_into_memory_of_their_own():
    """A tensor-parallel shard's rows are a view of the file's tensor: laid over them, the repacked layer
    would keep the whole tensor alive; it gets memory of its own, and the tensor is left as it was."""
    whole = random_blocks("Q8_0", 96, K, seed=3)
    before = whole.clone()
    layer = Linear(K, 48, bias=False)
    attach_to(layer, GGUFWeight.from_blocks("Q8_0", whole[48:], K))
    layer.dtype = torch.bfloat16
    layer.bind(NativeQ8(GemmPolicy(amx=False, invariant=False), upcast=False))
    assert torch.equal(whole, before)
    assert whole.untyped_storage().data_ptr() not in {b.untyped_storage().data_ptr() for b in layer.buffers()}
    assert torch.equal(file_blocks(layer), before[48:])


@pytest.mark.parametrize("rows", [1, 4, 5, 9, 13, 16, 17, 40, 130])  # int8: 6-row tiles; int4: 8 and 4; AMX: 16 and 32
@pytest.mark.parametrize("out_features", [48, 176])  # 3 and 11 blocks of 16 columns: narrow last tiles
@pytest.mark.parametrize("fmt", REPACKED)
def test_repacked_gemm_equals_dequantize_then_multiply(kernel, fmt, rows, out_features):  # noqa: F811
    layer, blocks = repacked(fmt, out_features, K, kernel, seed=rows)
    x = torch.randn(rows, K).bfloat16()
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.bfloat16
    check(out, x, dequantize_rows(block_format(fmt), blocks))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])  # gemm_q8's loops and the int4 loops
def test_a_huge_channel_costs_only_its_own_group_precision(kernel, fmt):  # noqa: F811
    """Gemma 3's activations have channels hundreds of times the rest. Fixed point per row would round every
    other channel to steps of that size (about 1 here); per group of 32 only the outlier's group is coarse.
    Its group's weights are zero, so the product is the other groups' alone, to the usual tolerance."""
    blocks = random_blocks(fmt, 48, K, seed=5)
    blocks[:, 2:block_format(fmt).type_size] = 0 if fmt == "Q8_0" else 0x88  # the first block of each row: w = 0
    layer = Linear(K, 48, bias=False)
    attach_to(layer, GGUFWeight.from_blocks(fmt, blocks.clone(), K))
    layer.dtype = torch.bfloat16
    layer.bind((NativeQ8 if fmt == "Q8_0" else NativeBlocks)(kernel, upcast=False))
    x = torch.randn(4, K)
    x[:, 0] = 30000.0
    x = x.bfloat16()
    with torch.inference_mode():
        out = layer(x)
    w = dequantize_rows(block_format(fmt), blocks)
    assert (w[:, :32] == 0).all()
    check(out, x, w)


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("fmt", [f for f in REPACKED if f != "Q8_0"])
def test_repacked_fused_silu_and_mul_equals_the_float32_activation(kernel, fmt, rows):  # noqa: F811
    """On AMX in the int4 tiles' epilogue, else the projection and gemm.c's silu_and_mul_bf16: gate, up, silu
    and the product each rounded to bf16 (within 2e-2 as in test_gemm.py, on activations of its size)."""
    layer, blocks = repacked(fmt, 2 * 96, K, kernel, seed=rows)
    w = dequantize_rows(block_format(fmt), blocks)
    x = (0.02 / w.abs().mean() * torch.randn(rows, K)).bfloat16()  # outputs of order one, whatever the scales
    gate, up = F.linear(x.float(), w).chunk(2, -1)
    with torch.inference_mode():
        out = silu_and_mul(layer, x)
    torch.testing.assert_close(out.float(), F.silu(gate) * up, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fmt", REPACKED)
def test_every_thread_count_computes_the_same_columns(gemm_isa, fmt):
    layer, _ = repacked(fmt, 176, K, GemmPolicy(amx=False, invariant=True))
    x = torch.randn(3, K).bfloat16()
    threads, outputs = torch.get_num_threads(), []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outputs.append(layer(x))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


@pytest.mark.parametrize("fmt", REPACKED)
def test_rows_without_a_kernel_multiply_dequantized_tiles(gemm_isa, fmt, monkeypatch):
    """Prefill without AMX: no kernel from UPCAST_MIN_ROWS rows; tiles of 32 columns, the last one short."""
    monkeypatch.setattr(gguf_linear, "DEQUANTIZE_TILE", 32 * K)
    layer, blocks = repacked(fmt, 176, K, GemmPolicy(amx=False, invariant=False))
    x = torch.randn(200, K).bfloat16()
    assert layer.method._kernel(layer, x) is None
    check(layer(x), x, dequantize_rows(block_format(fmt), blocks))


def test_cpu_backend_repacks_single_format_layers_of_bf16_models(gemm_isa):
    from slipstream.backends.cpu.backend import CpuBackend
    from slipstream.backends.cpu.capability import CpuCapability

    backend = CpuBackend(CpuCapability.detect())
    for fmt, method in [("Q4_0", NativeBlocks), ("Q4_1", NativeBlocks), ("Q5_0", NativeBlocks), ("Q5_1", NativeBlocks),
                        ("Q4_K", NativeBlocks), ("Q5_K", NativeBlocks), ("Q6_K", NativeBlocks), ("Q8_0", NativeQ8)]:
        layer = Linear(256, 32, bias=False)
        attach_to(layer, GGUFWeight.from_blocks(fmt, random_blocks(fmt, 32, 256), 256))
        layer.dtype = torch.bfloat16
        assert type(backend.linear_method(layer, "gguf")) is method, fmt
        layer.dtype = torch.float32  # the int4/int8 kernels take bf16 activations: float32 keeps gguf_gemm.c
        assert type(backend.linear_method(layer, "gguf")) is gguf_linear.NativeGGUF, fmt


def test_a_layer_fused_from_two_formats_runs_each_part_on_its_own_kernel(gemm_isa):
    """Gemma 3's q/k (Q5_0) and v (Q8_0) in one projection: a part per format, outputs side by side."""
    from slipstream.backends.cpu.backend import CpuBackend
    from slipstream.backends.cpu.capability import CpuCapability

    qk, v = random_blocks("Q5_0", 64, K, seed=1), random_blocks("Q8_0", 32, K, seed=2)
    layer = Linear(K, 96, bias=False)
    attach_to(layer, GGUFWeight.concat([GGUFWeight.from_blocks("Q5_0", qk.clone(), K),
                                        GGUFWeight.from_blocks("Q8_0", v.clone(), K)]))
    layer.dtype = torch.bfloat16
    layer.bind(CpuBackend(CpuCapability.detect()).linear_method(layer, "gguf"))
    assert [type(part.method) for part in layer.parts] == [NativeBlocks, NativeQ8]
    assert torch.equal(file_blocks(layer.parts[0]), qk) and torch.equal(file_blocks(layer.parts[1]), v)
    x = torch.randn(3, K).bfloat16()
    with torch.inference_mode():
        out = layer(x)
    check(out, x, torch.cat([dequantize_rows(block_format("Q5_0"), qk), dequantize_rows(block_format("Q8_0"), v)]))
