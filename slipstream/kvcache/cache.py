"""Paged K/V storage: one K and one V tensor per layer, indexed by physical block.

Shape per layer: [num_blocks, block_size, num_kv_heads, head_dim]. New tokens are written
by slot (block_id * block_size + offset); readers gather whole blocks through a block
table. Only `num_key_value_heads` heads are stored: GQA/MQA never repeat K/V here.
"""
from __future__ import annotations

import torch

from slipstream.kvcache.dtype import KVCacheDtype
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache

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
    """All layers' caches, sized from a memory budget; layers may differ in KV heads and head size.

    With TurboQuant, the first and last `dense_layers` layers keep a bf16/fp32 cache.
    """

    def __init__(self, layer_shapes: list[tuple[int, int]], kv_dtype: KVCacheDtype, model_dtype: torch.dtype,
                 memory: int, block_size: int, device: torch.device, dense_layers: int = 0):
        n = len(layer_shapes)
        self.turboquant = [kv_dtype.is_turboquant and dense_layers <= i < n - dense_layers for i in range(n)]
        self.kv_dtype = kv_dtype
        self.dense_dtype = kv_dtype.dense or model_dtype
        self.bytes_per_token = self.bytes_per_token_of(layer_shapes, kv_dtype, model_dtype, dense_layers)
        self.block_size = block_size
        self.num_blocks = memory // (self.bytes_per_token * block_size)
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory={memory} bytes is too small for one block "
                             f"({self.bytes_per_token * block_size} bytes)")
        self.layers = [self._layer(i, heads, dim, device) for i, (heads, dim) in enumerate(layer_shapes)]

    @staticmethod
    def bytes_per_token_of(layer_shapes: list[tuple[int, int]], kv_dtype: KVCacheDtype,
                           model_dtype: torch.dtype = torch.bfloat16, dense_layers: int = 0) -> int:
        """K and V of one token, all layers. `layer_shapes`: (num_kv_heads, head_dim) per layer."""
        n, total = len(layer_shapes), 0
        for i, (heads, dim) in enumerate(layer_shapes):
            if kv_dtype.is_turboquant and dense_layers <= i < n - dense_layers:
                total += TurboQuantLayerCache.bytes_per_token(heads, dim, kv_dtype.bits, kv_dtype.key_mode)
            else:
                total += 2 * heads * dim * (kv_dtype.dense or model_dtype).itemsize
        return total

    def _layer(self, index: int, heads: int, dim: int, device: torch.device):
        if self.turboquant[index]:
            return TurboQuantLayerCache(self.num_blocks, self.block_size, heads, dim, self.kv_dtype.bits,
                                        self.kv_dtype.key_mode, seed=index, device=device)
        return LayerKVCache(self.num_blocks, self.block_size, heads, dim, self.dense_dtype, device)

    @property
    def needs_calibration(self) -> bool:
        return any(not getattr(layer, "calibrated", True) for layer in self.layers)
