"""GGUF weights kept as the file stores them: the weight type, its place on a layer, and its plain-torch methods.

A `GGUFWeight` is a weight [N, K] as row segments of block codes (uint8 [rows, row_bytes],
the file's bytes unchanged); a fused projection whose parts the file stores in different
formats (Gemma 3's q/k in Q5_0, v in Q8_0) keeps one segment per run of rows of one format.
Concatenating or permuting whole rows is exact on blocks, which run along K within a row:
that is how q/k/v fuse and how llama.cpp's rope permutation of Q/K rows is undone.

`attach` puts such a weight on the layers that share a parameter: a tied LM head holds the
blocks, and its embedding reads rows through the head's method (`rows`), so that a backend may
lay the head's blocks out as its kernels read them. `GGUFLinear` is the reference method:
dequantize each segment to float32, multiply, concatenate; backends subclass it with native
GEMMs per segment (`segment_mm`) or repack whole layers. `GGUFEmbedding` looks rows up and
dequantizes only those. Under tensor parallelism a weight narrows to a rank's rows, or to its
columns in whole blocks (`narrow`). This module never knows files (loader/gguf.py reads them)
nor kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.layers.embedding import vocab_parallel_lookup
from slipstream.layers.gguf_formats import BlockFormat, block_format, dequantize_rows
from slipstream.layers.linear import Linear, LinearMethod


@dataclass(frozen=True)
class BlockRows:
    fmt: BlockFormat
    data: torch.Tensor  # uint8 [rows, fmt.row_bytes(K)]


class GGUFWeight:
    """A weight [N, K] as stored, in row segments of one block format each."""

    def __init__(self, segments: list[BlockRows], k: int):
        for s in segments:
            if (s.data.dtype != torch.uint8 or s.data.dim() != 2 or s.data.shape[1] != s.fmt.row_bytes(k)
                    or not s.data.is_contiguous()):  # the kernels read rows of exactly row_bytes(k)
                raise ValueError(f"{s.fmt.name} blocks for K={k} must be contiguous uint8 [rows, {s.fmt.row_bytes(k)}]; "
                                 f"got {s.data.dtype} {tuple(s.data.shape)}")
        self.segments, self.k = segments, k

    @classmethod
    def from_blocks(cls, fmt_name: str, data: torch.Tensor, k: int) -> GGUFWeight:
        return cls([BlockRows(block_format(fmt_name), data)], k)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(s.data.shape[0] for s in self.segments), self.k))

    @staticmethod
    def concat(weights: list[GGUFWeight]) -> GGUFWeight:
        """The weights' rows one after another; neighbouring rows of one format share a segment."""
        runs: list[list[BlockRows]] = []
        for s in (s for w in weights for s in w.segments):
            if runs and runs[-1][0].fmt == s.fmt:
                runs[-1].append(s)
            else:
                runs.append([s])
        merged = [r[0] if len(r) == 1 else BlockRows(r[0].fmt, torch.cat([s.data for s in r])) for r in runs]
        return GGUFWeight(merged, weights[0].k)

    def narrow(self, dim: int, start: int, length: int) -> GGUFWeight:
        """Rows [start, start + length) (dim 0), or those columns of every row (dim 1: whole blocks
        only), as a tensor-parallel shard takes them (distributed/shard.py)."""
        if dim == 1:
            return GGUFWeight([BlockRows(s.fmt, s.data[:, _block_bytes(s.fmt, start, self.k):
                                                      _block_bytes(s.fmt, start + length, self.k)].contiguous())
                               for s in self.segments], length)
        segments, first = [], 0
        for s in self.segments:
            lo, hi = max(start - first, 0), min(start + length - first, s.data.shape[0])
            if lo < hi:
                segments.append(BlockRows(s.fmt, s.data[lo:hi]))
            first += s.data.shape[0]
        return GGUFWeight(segments, self.k)

    def new_zeros(self, shape: list[int]) -> GGUFWeight:
        """`shape[0]` rows of zero weights (all-zero blocks: every scale 0), in the first segment's format."""
        fmt = self.segments[0].fmt
        return GGUFWeight([BlockRows(fmt, torch.zeros(shape[0], fmt.row_bytes(shape[1]), dtype=torch.uint8))], shape[1])

    @staticmethod
    def cat(weights: list[GGUFWeight], dim: int) -> GGUFWeight:
        if dim != 0:
            raise ValueError("GGUF weights join by whole rows (dim 0) only")
        return GGUFWeight.concat(weights)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([dequantize_rows(s.fmt, s.data) for s in self.segments])

    def nbytes(self) -> int:
        return sum(s.data.nbytes for s in self.segments)


def _block_bytes(fmt: BlockFormat, column: int, k: int) -> int:
    """Where column `column` starts in a row's bytes; it must start a block."""
    if column % fmt.block_size:
        raise ValueError(f"a split of {fmt.name} rows (K={k}) at column {column} cuts a block: tensor parallelism "
                         f"splits them at multiples of {fmt.block_size} only (choose a tensor_parallel_size that does)")
    return column // fmt.block_size * fmt.type_size


def attach(model: nn.Module, param_name: str, weight: GGUFWeight) -> None:
    """Give the blocks to every module whose weight is `param_name`'s parameter; their float weight is
    dropped. An embedding tied to an LM head reads the head's blocks (through the head's method, in
    whatever layout a backend gives them), not a copy."""
    param = model.get_parameter(param_name)
    owners = [(name, m) for name, m in model.named_modules() if getattr(m, "weight", None) is param]
    heads = [m for _, m in owners if isinstance(m, Linear)]
    for name, module in owners:
        if isinstance(module, Linear):
            _attach_linear(module, weight)
        elif isinstance(module, nn.Embedding):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child,
                    GGUFEmbedding(weight, head=heads[0] if heads else None, vocab_start=getattr(module, "vocab_start", 0)))
        else:
            raise TypeError(f"{param_name!r} belongs to a {type(module).__name__}, which cannot hold GGUF blocks")


def _attach_linear(layer: Linear, weight: GGUFWeight) -> None:
    if tuple(weight.shape) != (layer.out_features, layer.in_features):
        raise ValueError(f"GGUF weight {tuple(weight.shape)} does not fit a {layer.out_features}x{layer.in_features} layer")
    layer.weight = None
    layer.block_formats = tuple(s.fmt for s in weight.segments)
    for i, s in enumerate(weight.segments):
        layer.register_buffer(f"blocks{i}", s.data)


def split_segments(layer: Linear) -> list[Linear]:
    """A Linear (no bias, the layer's activation dtype) for each of the layer's segments, holding its blocks."""
    parts = []
    for rows in segments(layer):
        part = Linear(layer.in_features, rows.data.shape[0], bias=False, device="meta")
        _attach_linear(part, GGUFWeight([rows], layer.in_features))
        part.dtype = getattr(layer, "dtype", torch.float32)
        parts.append(part)
    return parts


def segments(module: nn.Module) -> list[BlockRows]:
    """A module's blocks as attached (read from its buffers, so they follow `.to(device)`)."""
    return [BlockRows(fmt, getattr(module, f"blocks{i}")) for i, fmt in enumerate(module.block_formats)]


def has_blocks(layer: nn.Module) -> bool:
    return hasattr(layer, "block_formats")


class GGUFLinear(LinearMethod):
    """Blocks as stored; per segment dequantize to float32 and multiply (the reference and fallback)."""

    name = "gguf"

    def create(self, layer: Linear) -> None:
        if not has_blocks(layer):
            raise ValueError("quantization='gguf' serves layers loaded from a GGUF file's blocks; this layer has none")

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([self.segment_mm(s, x) for s in segments(layer)], dim=-1)
        out = out if layer.bias is None else out + layer.bias
        return out.to(x.dtype)

    def segment_mm(self, rows: BlockRows, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] times one segment's weight, transposed: [M, rows] float32."""
        return F.linear(x.float(), dequantize_rows(rows.fmt, rows.data))

    def rows(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, float32 [len(ids), K] (a tied embedding's lookup)."""
        (blocks,) = segments(layer)
        return dequantize_rows(blocks.fmt, blocks.data[ids])


class GGUFEmbedding(nn.Module):
    """An embedding table as stored: a lookup dequantizes the rows it reads, to `dtype`. Tied to an
    LM head (`head`), it holds no blocks: the head's method reads its rows."""

    def __init__(self, weight: GGUFWeight, dtype: torch.dtype = torch.float32, head: Linear | None = None,
                 vocab_start: int = 0):
        super().__init__()
        self.vocab_start = vocab_start  # of this rank's rows under tensor parallelism
        if len(weight.segments) != 1:
            raise ValueError("a GGUF embedding table is one tensor of one block format")
        self.num_embeddings, self.embedding_dim = weight.shape
        self.block_formats, self.dtype = (weight.segments[0].fmt,), dtype
        self.tied = (head,) if head is not None else ()  # a tuple: the head stays a submodule of its model alone
        if head is None:
            self.register_buffer("blocks0", weight.segments[0].data)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(ids, self.vocab_start, self.num_embeddings, self._lookup)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.tied:
            x = self.tied[0].method.rows(self.tied[0], flat)
        else:
            (blocks,) = segments(self)
            x = dequantize_rows(blocks.fmt, blocks.data[flat])
        return x.reshape(*ids.shape, self.embedding_dim).to(self.dtype)
