"""GGUF's block formats as llama.cpp defines them: their sizes, and their dequantization in plain torch.

A block format stores a row of K weights as K / block_size blocks of `type_size` bytes each:
fp16 scales (and minimums) followed by packed integer codes. This module owns the byte layout
of each format and its dequantization, written op for op as the `gguf` package writes it
(float32 products in the same order, so the results are bit-identical to its numpy code). It
never knows layers, files or kernels.

- Q4_0, Q5_0, Q8_0: w = d * (q - offset), one fp16 d per 32 weights;
- Q4_1, Q5_1: w = d * q + m, fp16 d and m per 32 weights;
- Q4_K, Q5_K: 256-weight super-blocks of eight 32-weight groups, w = (d * sc) * q - (dmin * mn)
  with 6-bit sc, mn per group and fp16 d, dmin per super-block;
- Q6_K: 256-weight super-blocks of sixteen 16-weight groups, w = (d * sc) * (q - 32), int8 sc.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int          # GGMLQuantizationType's value, as the file stores it
    block_size: int         # weights per block
    type_size: int          # bytes per block
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor]  # uint8 [B, type_size] -> float32 [B, block_size]

    def row_bytes(self, k: int) -> int:
        if k % self.block_size:
            raise ValueError(f"{self.name} rows hold whole blocks of {self.block_size} weights; got K={k}")
        return k // self.block_size * self.type_size


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 bytes [B, 2] -> float32 [B, 1]."""
    return b.contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[B, n] bytes -> [B, 2n] codes: the n low nibbles, then the n high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[B, n] bytes -> [B, 8n] bits, least significant first (a little-endian bit field)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return (_f16(b[:, :2]) * nibbles(b[:, 4:]).float()) + _f16(b[:, 2:4])


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return nibbles(qs) | (_bits(qh) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_five_bit(b[:, 2:6], b[:, 6:]).to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return (_f16(b[:, :2]) * _five_bit(b[:, 4:8], b[:, 8:]).float()) + _f16(b[:, 2:4])


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> the eight 6-bit group scales and minimums [B, 8] (uint8).
    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top bits of scales 4-7, bytes 4-7 the same
    for minimums; bytes 8-11 the low nibbles of scales 4-7 (low) and minimums 4-7 (high)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_groups(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: codes q [B, 8, 32] with the super-block's scales applied."""
    sc, mn = k_scales(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.float()).unsqueeze(-1)
    dm = (_f16(b[:, 2:4]) * mn.float()).unsqueeze(-1)
    return (d * q.float() - dm).flatten(1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # each 32 bytes of codes hold two groups: low nibbles the first, high nibbles the second
    return _k_groups(b, nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    low = nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    # bit g of byte i of qh is the fifth bit of weight i of group g
    high = ((b[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8, device=b.device)[:, None]) & 1)
    return _k_groups(b, low | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 1, 32)
    low = nibbles(ql).reshape(-1, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[:, None]
    high = (qh >> shifts) & 3
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(-1, 16, 16).float()
    d = (_f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
    return (d * q).flatten(1)


FORMATS = {f.name: f for f in (
    BlockFormat("Q4_0", 2, 32, 18, _q4_0), BlockFormat("Q4_1", 3, 32, 20, _q4_1),
    BlockFormat("Q5_0", 6, 32, 22, _q5_0), BlockFormat("Q5_1", 7, 32, 24, _q5_1),
    BlockFormat("Q8_0", 8, 32, 34, _q8_0), BlockFormat("Q4_K", 12, 256, 144, _q4_k),
    BlockFormat("Q5_K", 13, 256, 176, _q5_k), BlockFormat("Q6_K", 14, 256, 210, _q6_k),
)}


def block_format(name: str) -> BlockFormat:
    if name not in FORMATS:
        raise ValueError(f"GGUF block format {name!r} is not supported; supported: {', '.join(FORMATS)}")
    return FORMATS[name]


def dequantize_rows(fmt: BlockFormat, rows: torch.Tensor) -> torch.Tensor:
    """uint8 [N, row_bytes] blocks -> float32 [N, K]."""
    n = rows.shape[0]
    return fmt.dequantize_blocks(rows.reshape(-1, fmt.type_size)).reshape(n, -1)
