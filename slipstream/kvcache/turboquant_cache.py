"""Paged storage of TurboQuant codes: per layer, one uint8 row per (token, KV head) for K and V.

Shape per layer: [num_blocks, block_size, num_kv_heads, nbytes]. Writing quantizes the
step's new K/V (keys after rotary, as they are stored); `gather_codes` hands attention the
codes through block tables. `gather`/`gather_batch` dequantize and exist for the reference
path (dequantize-then-attend) that tests compare the code-reading attention against.

Keys are stored centred: the per-channel mean mu of each KV head (measured once) is
subtracted before quantizing. Attention is unchanged by it, since <q, k_t> = <q, k_t - mu> +
<q, mu> and the last term is the same for every key of a query, which softmax ignores;
the quantizer then spends its bits on what varies between keys. The reference path adds mu
back. The mean, and with 2.5/3.5 bits the outlier channels of each KV head, are taken from
the first K/V ever written to the layer and then fixed, so that every stored block (and
the prefix cache) stays valid; the engine writes a fixed calibration prompt first.
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
        self.key_mean = torch.zeros(num_kv_heads, head_dim, device=device)
        self.calibrated = False

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, bits: float, key_mode: str) -> int:
        k = TurboQuantizer(head_dim, bits, mode=key_mode).nbytes
        v = TurboQuantizer(head_dim, bits, mode="mse").nbytes
        return num_kv_heads * (k + v)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if not self.calibrated:
            self.key_mean = k.float().mean(0)
            self.key_quantizer.calibrate(k - self.key_mean)
            self.value_quantizer.calibrate(v)
            self.calibrated = True
        self.k.view(-1, *self.k.shape[2:])[slot_mapping] = self.key_quantizer.quantize(k - self.key_mean)
        self.v.view(-1, *self.v.shape[2:])[slot_mapping] = self.value_quantizer.quantize(v)

    def gather_codes(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes through block tables [..., n_blocks] -> [..., n_blocks * block_size, H, nbytes]."""
        k = self.k[block_tables].flatten(-4, -3)
        v = self.v[block_tables].flatten(-4, -3)
        return k, v

    def gather(self, block_table: torch.Tensor, length: int, dtype: torch.dtype):
        """Dequantized, in the dense cache's layout: [num_kv_heads, length, head_dim]."""
        k, v = self._dequantize(*self.gather_codes(block_table), dtype)
        return k[:length].transpose(0, 1), v[:length].transpose(0, 1)

    def gather_batch(self, block_tables: torch.Tensor, dtype: torch.dtype):
        """Dequantized, in the dense cache's layout: [num_kv_heads, B, L, head_dim]."""
        k, v = self._dequantize(*self.gather_codes(block_tables), dtype)
        return k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)

    def _dequantize(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype):
        return ((self.key_quantizer.dequantize(k) + self.key_mean).to(dtype),
                self.value_quantizer.dequantize(v).to(dtype))
