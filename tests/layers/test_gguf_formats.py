"""GGUF block formats as stored: dequantization against the `gguf` package, the loaded blocks
against the file's bytes, the torch linear method and embedding, and clear errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from slipstream.layers.gguf_formats import FORMATS, block_format, dequantize_rows
from slipstream.layers.gguf_linear import (
    GGUFEmbedding,
    GGUFLinear,
    GGUFWeight,
    attach,
    segments,
)
from slipstream.layers.linear import Linear

# where each format keeps its fp16 scale (and minimum) bytes: random bytes there would be inf/NaN
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(fmt_name: str, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, row_bytes]: every code pattern at random, fp16 fields finite (|value| < 2)."""
    fmt = block_format(fmt_name)
    g = np.random.default_rng(seed)
    blocks = g.integers(0, 256, size=(rows * k // fmt.block_size, fmt.type_size), dtype=np.uint8)
    for at in FP16_FIELDS[fmt_name]:
        scale = (g.standard_normal(blocks.shape[0]) * 0.05).astype(np.float16)
        blocks[:, at:at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(rows, -1))


def gguf_dequantize(fmt_name: str, blocks: torch.Tensor) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(quants.dequantize(blocks.numpy(), GGMLQuantizationType[fmt_name]).astype(np.float32))


def test_every_format_is_the_gguf_package_s_own():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for fmt in FORMATS.values():
        assert GGMLQuantizationType[fmt.name].value == fmt.ggml_type
        assert GGML_QUANT_SIZES[GGMLQuantizationType[fmt.name]] == (fmt.block_size, fmt.type_size)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_dequantization_is_bit_identical_to_the_gguf_package(fmt_name):
    blocks = random_blocks(fmt_name, rows=6, k=512)
    ours = dequantize_rows(block_format(fmt_name), blocks)
    assert ours.shape == (6, 512)
    assert torch.equal(ours.view(torch.int32), gguf_dequantize(fmt_name, blocks).view(torch.int32))


def _file_tensors(path: str) -> dict:
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(path).tensors}


def test_bundled_file_tensors_dequantize_as_the_gguf_package_does(smollm2_gguf):
    tensors = _file_tensors(smollm2_gguf)
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
        t = tensors[name]
        blocks = torch.from_numpy(np.array(t.data))
        ours = dequantize_rows(block_format(t.tensor_type.name), blocks)
        assert torch.equal(ours, gguf_dequantize(t.tensor_type.name, blocks)), name


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_header_reader_gives_the_gguf_package_s_fields_and_tensors(model):
    """loader/gguf_reader.py against the gguf package's reader on the bundled files: every field's
    value (arrays of strings skipped, and refused by name), every tensor's type, shape, size and bytes."""
    from gguf import GGUFReader as PackageReader

    from slipstream.loader.gguf import GGUFFile
    from slipstream.loader.gguf_reader import GGUFReader, SkippedValue
    from slipstream.loader.registry import resolve_model_path

    path = resolve_model_path(model)
    ours, theirs = GGUFReader(path), PackageReader(path)
    assert ours.fields.keys() == theirs.fields.keys() - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key, value in ours.fields.items():
        expected = theirs.fields[key].contents()
        if isinstance(value, SkippedValue):
            assert all(isinstance(v, str) for v in expected), key
        else:
            assert value == pytest.approx(expected) if isinstance(expected, float) else value == expected, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, package in zip(ours.tensors, theirs.tensors):
        assert (mine.tensor_type, mine.shape, mine.n_bytes) == (package.tensor_type, tuple(package.shape.tolist()),
                                                                package.n_bytes), mine.name
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_norm.weight", "output_norm.weight"):
        mine, package = (next(t for t in r.tensors if t.name == name) for r in (ours, theirs))
        data = ours.read(mine)
        assert data.dtype == package.data.dtype and np.array_equal(data, package.data), name
    with pytest.raises(ValueError, match="'tokenizer.ggml.tokens' is an array of strings"):
        GGUFFile(path).field("tokenizer.ggml.tokens")


def _permute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's permutation, which the loader undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def test_loaded_blocks_round_trip_to_the_file_s_bytes(smollm2_gguf):
    from slipstream.backends.reference import ReferenceBackend
    from slipstream.engine.model_loader import load_model

    loaded = load_model(smollm2_gguf, torch.bfloat16, ReferenceBackend(torch.device("cpu")), "gguf")
    assert loaded.quantization == "gguf"
    model, tensors = loaded.model, _file_tensors(smollm2_gguf)
    qkv, = segments(model.model.layers[3].self_attn.qkv_proj)  # q, k, v: all Q4_1, one segment
    q, k, v = qkv.data.split([576, 192, 192])
    assert torch.equal(_permute_rope_rows(q, 9), torch.from_numpy(np.array(tensors["blk.3.attn_q.weight"].data)))
    assert torch.equal(_permute_rope_rows(k, 3), torch.from_numpy(np.array(tensors["blk.3.attn_k.weight"].data)))
    assert torch.equal(v, torch.from_numpy(np.array(tensors["blk.3.attn_v.weight"].data)))
    down, = segments(model.model.layers[29].mlp.down_proj)
    assert torch.equal(down.data, torch.from_numpy(np.array(tensors["blk.29.ffn_down.weight"].data)))
    head, = segments(model.lm_head)
    assert torch.equal(head.data, torch.from_numpy(np.array(tensors["token_embd.weight"].data)))
    embedding = model.model.embed_tokens  # tied: it reads the head's blocks and holds none of its own
    assert embedding.tied[0] is model.lm_head and not list(embedding.buffers())
    ids = torch.tensor([[0, 7], [49151, 7]])
    assert torch.equal(embedding(ids), dequantize_rows(head.fmt, head.data)[ids].bfloat16())


def test_rope_row_permutation_is_undone_exactly():
    from slipstream.loader.gguf import unpermute_rope_rows

    rows = random_blocks("Q4_1", rows=24, k=64)
    assert torch.equal(unpermute_rope_rows(_permute_rope_rows(rows, 3), 3), rows)
    assert not torch.equal(_permute_rope_rows(rows, 3), rows)


def _mixed_weight(k: int = 256) -> GGUFWeight:
    """Three parts as Gemma 3's q, k, v: two in Q5_0, one in Q8_0."""
    parts = [GGUFWeight.from_blocks(f, random_blocks(f, rows, k, seed=i), k)
             for i, (f, rows) in enumerate([("Q5_0", 48), ("Q5_0", 16), ("Q8_0", 16)])]
    return GGUFWeight.concat(parts)


def test_concat_keeps_one_segment_per_run_of_one_format():
    w = _mixed_weight()
    assert [s.fmt.name for s in w.segments] == ["Q5_0", "Q8_0"]
    assert [s.data.shape[0] for s in w.segments] == [64, 16] and tuple(w.shape) == (80, 256)


def test_linear_method_equals_dequantize_then_multiply():
    w = _mixed_weight()
    layer = Linear(256, 80, bias=True)
    attach_to(layer, w)
    layer.bind(GGUFLinear())
    x = torch.randn(5, 256)
    expected = F.linear(x, w.dequantize(), layer.bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)  # fp32 sums in another order
    assert layer.weight is None


def attach_to(layer: Linear, weight: GGUFWeight) -> None:
    holder = torch.nn.Module()
    holder.layer = layer
    attach(holder, "layer.weight", weight)


def test_embedding_lookup_dequantizes_the_rows_it_reads():
    w = GGUFWeight.from_blocks("Q8_0", random_blocks("Q8_0", 40, 64), 64)
    ids = torch.tensor([[3, 39], [0, 3]])
    expected = w.dequantize()[ids]
    assert torch.equal(GGUFEmbedding(w)(ids), expected)
    assert torch.equal(GGUFEmbedding(w, torch.bfloat16)(ids), expected.bfloat16())


def test_tensor_parallel_shards_take_whole_rows_and_whole_blocks():
    from slipstream.distributed.shard import Shard

    w = _mixed_weight()  # 80 x 256: Q5_0 rows 0-63, Q8_0 rows 64-79
    full = w.dequantize()
    rows = Shard(0, ((40, 40),)).take(w)  # across the formats' boundary
    assert [s.fmt.name for s in rows.segments] == ["Q5_0", "Q8_0"] and torch.equal(rows.dequantize(), full[40:])
    fused = Shard(0, ((0, 8), (64, 8))).take(w)  # a rank's parts of a fused projection
    assert torch.equal(fused.dequantize(), torch.cat([full[:8], full[64:72]]))
    columns = Shard(1, ((128, 128),)).take(w)  # a row-parallel layer's half of K
    assert columns.k == 128 and torch.equal(columns.dequantize(), full[:, 128:])
    padded = Shard(0, ((64, 16),), 24).take(w)  # the last rank's vocabulary rows, padded with zeros
    assert torch.equal(padded.dequantize(), torch.cat([full[64:], torch.zeros(8, 256)]))
    with pytest.raises(ValueError, match="at column 48 cuts a block: tensor parallelism splits them at multiples of 32"):
        Shard(1, ((48, 208),)).take(w)


def test_bad_blocks_are_clear_errors():
    with pytest.raises(ValueError, match="'Q3_K' is not supported; supported: Q4_0"):
        block_format("Q3_K")
    with pytest.raises(ValueError, match=r"Q4_1 blocks for K=64 must be contiguous uint8 \[rows, 40\]"):
        GGUFWeight.from_blocks("Q4_1", torch.zeros(4, 36, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="whole blocks of 256 weights; got K=320"):
        block_format("Q4_K").row_bytes(320)
    with pytest.raises(ValueError, match=r"does not fit a 16x64 layer"):
        attach_to(Linear(64, 16), GGUFWeight.from_blocks("Q8_0", random_blocks("Q8_0", 8, 64), 64))


# --- native kernels (kernels/gguf_gemm.c) -----------------------------------------------------
NATIVE_TOL = 1e-6  # relative to |x| . |W|: float32 sums in another order; measured <= 6e-7 on random blocks


def check_native(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """The kernel is dequantize-then-multiply to float32 rounding."""
    scale = x.abs().double() @ w.abs().T.double()
    assert ((out.double() - x.double() @ w.T.double()).abs() <= NATIVE_TOL * scale).all()


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_native_gemm_equals_dequantize_then_multiply_over_every_tile_remainder(fmt_name, isa):
    from slipstream.backends.cpu import abi
    from slipstream.backends.cpu.gguf_linear import gguf_gemm

    fmt = block_format(fmt_name)
    k = 3 * fmt.block_size
    for m, n in [(1, 1), (1, 7), (2, 9), (4, 6), (5, 3), (7, 17), (9, 4)]:  # tiles of 4x1 and 2x4 rows, and edges
        blocks = random_blocks(fmt_name, n, k, seed=m * 31 + n)
        x = torch.randn(m, k) * torch.rand(m, k // 32, 1).repeat_interleave(32, 1).reshape(m, k)
        out = torch.full((m, n + 2), float("nan"))  # a row stride wider than N: a segment's columns
        gguf_gemm(abi.kernels(), x, fmt.ggml_type, blocks, out, k)
        assert out[:, n:].isnan().all(), "wrote outside its columns"
        check_native(out[:, :n], x, dequantize_rows(fmt, blocks))


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_native_dequantization_equals_the_torch_twin(fmt_name, isa):
    """Exactly: the same values (its zeros are +0 where d * (q - 8) may give -0)."""
    from slipstream.backends.cpu import abi
    from slipstream.backends.cpu.gguf_linear import dequantize

    fmt = block_format(fmt_name)
    blocks = random_blocks(fmt_name, rows=5, k=2 * fmt.block_size)
    ours = dequantize(abi.kernels(), fmt.ggml_type, blocks, 2 * fmt.block_size)
    assert torch.equal(ours, dequantize_rows(fmt, blocks))


@pytest.mark.parametrize("rows", [6, 40])  # the native GEMM, and dequantized tiles on a dense GEMM
def test_native_method_serves_mixed_segments_like_the_torch_twin(rows, isa, monkeypatch):
    from slipstream.backends.cpu import abi, gguf_linear

    monkeypatch.setattr(gguf_linear, "DEQUANTIZE_TILE", 20 * 256)  # several tiles, the last one short
    w = _mixed_weight()
    layer = Linear(256, 80, bias=True)
    attach_to(layer, w)
    layer.bind(gguf_linear.NativeGGUF(abi.kernels()))
    x = torch.randn(rows, 256)
    check_native(layer(x) - layer.bias, x, w.dequantize())
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_cpu_backend_takes_the_torch_twin_without_kernels(no_native_kernels):
    from slipstream.backends.cpu.backend import CpuBackend
    from slipstream.backends.cpu.capability import CpuCapability

    layer = Linear(256, 80, bias=False)
    attach_to(layer, _mixed_weight())
    assert type(CpuBackend(CpuCapability.detect()).linear_method(layer, "gguf")) is GGUFLinear
