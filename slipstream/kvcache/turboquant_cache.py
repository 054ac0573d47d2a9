"""Paged storage of TurboQuant codes: per layer, one uint8 row per (token, KV head) for K and V.

Shape per layer: [num_blocks, block_size, num_kv_heads, nbytes]. Writing quantizes the
step's new K/V (keys after rotary, as they are stored); `gather_codes` hands attention the
codes through block tables. `gather`/`gather_batch` dequantize and exist for the reference
path (dequantize-then-attend) that tests compare the code-reading attention against.

With 2.5/3.5 bits the outlier channels of each KV head are chosen from the first K/V ever
written to the layer and then fixed, so that every stored block (and the prefix cache)
stays valid; the engine writes a fixed calibration prompt first.
"""
from __future__ import annotations

import torch

from slipstream.kvcache.turboquant import TurboQuantizer


class TurboQuantLayerCache:
    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 bits: float, key_mode: str, seed: int, device: torch.device):
        self.block_size = block_size
        self.key_quantizer = TurboQuantizer(head_dim, bits, mode=key_mode, seed=2 * seed)
        self.value_quantizer = TurboQuantizer(head_dim, bits, mode="mse", seed=2 * seed + 1)
        self.k = torch.zeros(num_blocks, block_size, num_kv_heads, self.key_quantizer.nbytes,
                             dtype=torch.uint8, device=device)
        self.v = torch.zeros(num_blocks, block_size, num_kv_heads, self.value_quantizer.nbytes,
                             dtype=torch.uint8, device=device)
        self.calibrated = bits == int(bits)

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, bits: float, key_mode: str) -> int:
        k = TurboQuantizer(head_dim, bits, mode=key_mode).nbytes
        v = TurboQuantizer(head_dim, bits, mode="mse").nbytes
        return num_kv_heads * (k + v)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if not self.calibrated:
            self.key_quantizer.calibrate(k)
            self.value_quantizer.calibrate(v)
            self.calibrated = True
        self.k.view(-1, *self.k.shape[2:])[slot_mapping] = self.key_quantizer.quantize(k)
        self.v.view(-1, *self.v.shape[2:])[slot_mapping] = self.value_quantizer.quantize(v)

    def gather_codes(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes through block tables [..., n_blocks] -> [..., n_blocks * block_size, H, nbytes]."""
        k = self.k[block_tables].flatten(-4, -3)
        v = self.v[block_tables].flatten(-4, -3)
        return k, v

    def gather(self, block_table: torch.Tensor, length: int, dtype: torch.dtype):
        k, v = self.gather_codes(block_table)
        return (self.key_quantizer.dequantize(k[:length]).to(dtype),
                self.value_quantizer.dequantize(v[:length]).to(dtype))

    def gather_batch(self, block_tables: torch.Tensor, dtype: torch.dtype):
        k, v = self.gather_codes(block_tables)
        return self.key_quantizer.dequantize(k).to(dtype), self.value_quantizer.dequantize(v).to(dtype)
