"""Paged K/V storage: one K and one V tensor per layer, indexed by physical block.

Shape per layer: [num_blocks, block_size, num_kv_heads, head_dim]. New tokens are written
by slot (block_id * block_size + offset); readers gather whole blocks through a block
table. Only `num_key_value_heads` heads are stored: GQA/MQA never repeat K/V here.
"""
from __future__ import annotations

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


class LayerKVCache:
    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: [T, num_kv_heads, head_dim] for the step's new tokens."""
        self.k.view(-1, *self.k.shape[2:])[slot_mapping] = self._store(k)
        self.v.view(-1, *self.v.shape[2:])[slot_mapping] = self._store(v)

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        if self.k.dtype == torch.float8_e4m3fn:  # saturate: an out-of-range cast is NaN on some devices
            x = x.clamp(-FP8_MAX, FP8_MAX)
        return x.to(self.k.dtype)

    def gather(self, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one sequence's first `length` tokens: [length, num_kv_heads, head_dim]."""
        k = self.k[block_table].flatten(0, 1)[:length]
        v = self.v[block_table].flatten(0, 1)[:length]
        return k.to(dtype), v.to(dtype)

    def gather_batch(self, block_tables: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V through padded block tables [B, max_blocks]: [B, max_blocks*block_size, H, D]."""
        return self.k[block_tables].flatten(1, 2).to(dtype), self.v[block_tables].flatten(1, 2).to(dtype)


class KVCache:
    """All layers' caches, sized from a memory budget; layers may differ in KV heads and head size."""

    def __init__(self, layer_shapes: list[tuple[int, int]], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers = [LayerKVCache(num_blocks, block_size, heads, dim, dtype, device) for heads, dim in layer_shapes]

    @staticmethod
    def bytes_per_token(layer_shapes: list[tuple[int, int]], dtype: torch.dtype) -> int:
        """K and V of one token, summed over layers. `layer_shapes`: (num_kv_heads, head_dim) per layer."""
        return sum(2 * heads * dim * dtype.itemsize for heads, dim in layer_shapes)
