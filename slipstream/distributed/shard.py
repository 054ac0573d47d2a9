"""Shard: which part of a checkpoint tensor this rank's parameter holds.

A sharded parameter carries `tp_shards`, one `Shard` per checkpoint tensor that fills it (the
q, k and v parts of a fused projection each have their own; a tensor the checkpoint already
stores fused has key None). The weight loader narrows each tensor to its shard before
copying it, so a rank copies only what it holds. Parameters of a single-rank model carry
none. A tensor may also be a GGUF file's blocks (layers/gguf_linear.py's GGUFWeight, which
narrows, zero-fills and joins as tensors do, along K in whole blocks). This module never
knows layers or models.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    dim: int
    pieces: tuple[tuple[int, int], ...]  # (start, length) ranges of the full tensor along dim, concatenated
    size: int | None = None  # the local size along dim, where it exceeds the pieces: zeros fill the rest

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [tensor.narrow(self.dim, start, length) for start, length in self.pieces]
        missing = (self.size or 0) - sum(length for _, length in self.pieces)
        if missing > 0:
            shape = list(tensor.shape)
            shape[self.dim] = missing
            parts.append(tensor.new_zeros(shape))
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts, self.dim) if isinstance(parts[0], torch.Tensor) else type(parts[0]).cat(parts, self.dim)


def set_shards(param: torch.Tensor, shards: dict[int | None, Shard]) -> None:
    param.tp_shards = shards


def shard_of(param: torch.Tensor, index: int | None, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (checkpoint part `index` of `param`) cut to what this rank holds."""
    shards = getattr(param, "tp_shards", None)
    return tensor if shards is None else shards[index].take(tensor)
