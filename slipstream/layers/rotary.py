"""Rotary position embedding (the non-interleaved "rotate half" layout of transformers).

cos/sin are computed for the flattened `positions` of a step (row t for token t), so prefill
chunks and decode tokens mix freely. Every layer of a step passes the same `positions`
tensor, so they are computed once per step. Not precomputed for every position up to the
model's limit (Gemma 3's two 32k tables are 64 MB, a quarter of its 4-bit weights); the CPU
decode stack, where a step's four ops cost ~50 us, grows its own to the longest context served
(backends/cpu/decode_stack.py's RotaryTables). The product position x frequency is the same
float32 either way, so are the tables.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from slipstream.backends.cpu import abi

SUPPORTED_ROPE_TYPES = ("default", "llama3")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        inv_freq = _scale_inv_freq(inv_freq, scaling)
        # radians per position of each channel pair (i, i + head_dim / 2), float32 on the model's device
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D]; returns both rotated, in their own dtype."""
        cos, sin = self.tables(positions)
        lib = abi.kernels() if _native(q, k) else None
        if lib is not None:  # in place: q and k are views of a fresh QKV projection, or their norms' outputs
            lib.rotary_bf16(q.data_ptr(), k.data_ptr(), q.stride(0), k.stride(0), q.shape[0], q.shape[1], k.shape[1],
                            q.shape[2], cos.data_ptr(), sin.data_ptr(), abi.threads())
            return q, k
        qk = _rotate(torch.cat([q, k], dim=1), cos[:, None], sin[:, None])  # one pass over both: half the ops
        return qk.split([q.shape[1], k.shape[1]], dim=1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim / 2] float32 of the step's positions [T], computed once per step."""
        if self._step is None or self._step[0] is not positions:
            freqs = positions.float()[:, None] * self.inv_freq.float()  # float32 even if the module was cast
            self._step = (positions, freqs.cos(), freqs.sin())
        return self._step[1], self._step[2]


def _native(q: torch.Tensor, k: torch.Tensor) -> bool:
    """bf16 CPU tensors whose heads lie packed within a token."""
    return (q.dtype == k.dtype == torch.bfloat16 and q.device.type == "cpu" and not torch.is_grad_enabled()
            and q.stride()[1:] == (q.shape[2], 1) and k.stride()[1:] == (k.shape[2], 1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, a smooth ramp between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
