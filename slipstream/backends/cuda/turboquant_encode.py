"""The TurboQuant encoder in Triton: a step's new K or V vectors into their rows of bytes, in place.

Owns: one kernel per channel group (one group, or two for 2.5/3.5 bits) that writes that
group's bytes of each row. Must never choose what is quantized: the constants come from
`TurboQuantizer.encode_tables` and `channel_order`, the byte layout is the one
kvcache/turboquant.py documents, and `TurboQuantizer.quantize` is the reference the kernel is
tested against (bytes equal but for sums in another order, as for the CPU's encoder).

Per vector: optionally (x - mu) / sigma (keys), the channels of the group in group order,
y = R x, the norm |y|, codes = bucketize(y / |y|) against the codebook's boundaries, for
norm correction |y| / <y/|y|, c[codes]>, and for QJL the signs of the residual's sketch and
the residual's norm. Codes are packed least significant bit first, eight codes to a word of
`bits` bytes, which is the layout for every width from 1 to 4.

This module imports triton at import time: import it lazily.
"""
from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from slipstream.backends.cuda.paged_attention import _dot, interpreted
from slipstream.kvcache.turboquant import NORM8_BIAS, TurboQuantizer

BLOCK_T = 16  # vectors per program: tl.dot needs 16 rows


@triton.jit
def _store_fp16(rows, at, value, mask):
    bits = value.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32)
    tl.store(rows + at, (bits & 0xFF).to(tl.uint8), mask=mask)
    tl.store(rows + at + 1, (bits >> 8).to(tl.uint8), mask=mask)


_NORM8_ZERO = tl.constexpr(NORM8_BIAS >> 19)  # NORM8_BIAS's exponent as a code


@triton.jit
def _store_norm8(rows, at, value, mask):
    """NORM8 (kvcache/turboquant.py): round half up in the float's bits, clamp to the byte."""
    code = ((value.to(tl.int32, bitcast=True) + (1 << 18)) >> 19) - _NORM8_ZERO
    tl.store(rows + at, tl.minimum(tl.maximum(code, 0), 255).to(tl.uint8), mask=mask)


@triton.jit
def _store_packed(rows, at, codes, t_ok, DG: tl.constexpr, DG_PAD: tl.constexpr, BITS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """codes [BLOCK, DG_PAD] (zero past DG) -> DG * BITS / 8 bytes at rows + at[t]."""
    words = tl.sum(tl.reshape(codes.to(tl.int64), (BLOCK, DG_PAD // 8, 8)) << (tl.arange(0, 8) * BITS)[None, None, :], 2)
    w = tl.arange(0, DG_PAD // 8)
    k = tl.arange(0, 4)
    parts = (words[:, :, None] >> (8 * k)[None, None, :]) & 0xFF
    mask = t_ok[:, None, None] & (w < DG // 8)[None, :, None] & (k < BITS)[None, None, :]
    tl.store(rows + at[:, None, None] + (w * BITS)[None, :, None] + k[None, None, :], parts.to(tl.uint8), mask=mask)


@triton.jit
def _encode_group(x, mean, scale, order, constants, slots, rows, num_tokens, channel_start, byte_start,
                  rotation_at, centroids_at, boundaries_at, sketch_at,
                  HK: tl.constexpr, D: tl.constexpr, NBYTES: tl.constexpr, DG: tl.constexpr, DG_PAD: tl.constexpr,
                  MSE_BITS: tl.constexpr, QJL: tl.constexpr, NORM_CORRECTION: tl.constexpr, NORM_BYTES: tl.constexpr,
                  CENTERED: tl.constexpr, SCALED: tl.constexpr, PERMUTED: tl.constexpr, BLOCK: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    head = tl.program_id(1)
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    t_ok = t < num_tokens
    j = tl.arange(0, DG_PAD)
    j_ok = j < DG
    channel = channel_start + j
    if PERMUTED:
        channel = tl.load(order + head * D + channel_start + j, mask=j_ok, other=0)
    mask = t_ok[:, None] & j_ok[None, :]
    xv = tl.load(x + (t * HK + head)[:, None] * D + channel[None, :], mask=mask, other=0.0).to(tl.float32)
    if CENTERED:  # keys: (x - mu) / sigma, values x / s, per head and channel
        xv = xv - tl.load(mean + head * D + channel, mask=j_ok, other=0.0)[None, :]
    if SCALED:
        sigma = tl.load(scale + head * D + channel, mask=j_ok, other=1.0)
        xv = tl.where(mask, xv / sigma[None, :], 0.0)
    square = j_ok[:, None] & j_ok[None, :]
    rotation_t = tl.load(constants + rotation_at + j[:, None] * DG + j[None, :], mask=square, other=0.0)
    y = _dot(xv, rotation_t, INTERPRETED)  # x @ R.T
    norm = tl.sqrt(tl.sum(y * y, 1))
    unit = y / tl.maximum(norm, 1.1754943508222875e-38)[:, None]
    row = (tl.load(slots + t, mask=t_ok, other=0) * HK + head) * NBYTES + byte_start
    at = row
    if MSE_BITS > 0:
        b = tl.arange(0, 16)
        bounds = tl.load(constants + boundaries_at + b, mask=b < (1 << MSE_BITS) - 1, other=float("inf"))
        codes = tl.sum((unit[:, :, None] > bounds[None, None, :]).to(tl.int32), 2)
        codes = tl.where(mask, codes, 0)
        _store_packed(rows, at, codes, t_ok, DG, DG_PAD, MSE_BITS, BLOCK)
        at += DG * MSE_BITS // 8
        centroid = tl.load(constants + centroids_at + codes, mask=mask, other=0.0)
        if NORM_CORRECTION:  # store |x|^2 / <x, x_hat_unit> so that <x, x_hat> = |x|^2
            norm = norm / tl.maximum(tl.sum(unit * centroid, 1), 1e-3)
        unit = tl.where(mask, unit - centroid, 0.0)
    if QJL:
        sketch = tl.load(constants + sketch_at + j[:, None] * DG + j[None, :], mask=square, other=0.0)
        signs = tl.where(mask, (_dot(unit, sketch, INTERPRETED) >= 0).to(tl.int32), 0)
        _store_packed(rows, at, signs, t_ok, DG, DG_PAD, 1, BLOCK)
        at += DG // 8
        _store_fp16(rows, at, tl.sqrt(tl.sum(unit * unit, 1)), t_ok)
        at += 2
    if NORM_BYTES == 1:
        _store_norm8(rows, at, norm, t_ok)
    else:
        _store_fp16(rows, at, norm, t_ok)


def encode(rows: torch.Tensor, quantizer: TurboQuantizer, x: torch.Tensor, slots: torch.Tensor,
           mean: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> None:
    """Write quantize((x - mean) / scale) of x [T, Hk, D] (mean 0 and scale 1 where None) into rows
    [num_blocks, block_size, Hk, nbytes] at slots [T], as TurboQuantLayerCache.write does."""
    tokens, heads, dim = x.shape
    if rows.dtype != torch.uint8 or rows.shape[-2:] != (heads, quantizer.nbytes) or not rows.is_contiguous():
        raise ValueError(f"TurboQuant rows must be contiguous uint8 [..., {heads}, {quantizer.nbytes}] for x of shape "
                         f"{tuple(x.shape)}; got {rows.dtype} {tuple(rows.shape)}")
    if tokens == 0:
        return
    constants, order, groups = _tables(quantizer, x.device)
    x, slots = x.contiguous(), slots.contiguous()
    mean_, scale_ = (t.float().contiguous() if t is not None else constants for t in (mean, scale))
    for dg, mse_bits, qjl, norm_correction, norm_bytes, channel, byte, rotation_at, centroids_at, boundaries_at, \
            sketch_at in groups:
        _encode_group[(triton.cdiv(tokens, BLOCK_T), heads)](
            x, mean_, scale_, order, constants, slots, rows, tokens, channel, byte,
            rotation_at, centroids_at, boundaries_at, sketch_at,
            HK=heads, D=dim, NBYTES=quantizer.nbytes, DG=dg, DG_PAD=triton.next_power_of_2(dg),
            MSE_BITS=mse_bits, QJL=bool(qjl), NORM_CORRECTION=bool(norm_correction), NORM_BYTES=norm_bytes,
            CENTERED=mean is not None, SCALED=scale is not None,
            PERMUTED=quantizer.channel_order is not None, BLOCK=BLOCK_T, INTERPRETED=interpreted())


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tables(quantizer: TurboQuantizer, device: torch.device):
    """The quantizer's constants and channel order on `device`, and per group its launch values
    (dim, mse bits, QJL, norm correction, norm bytes, first channel, first byte, offsets into the constants),
    built once per device (and again once calibration has fixed the channel order)."""
    key = (device, quantizer.channel_order is not None)
    per_key = _TABLES.setdefault(quantizer, {})
    if key not in per_key:
        info, constants = quantizer.encode_tables
        order = quantizer.channel_order
        order = torch.zeros(1, dtype=torch.int32) if order is None else order.to(torch.int32).contiguous()
        per_key[key] = (constants.to(device), order.to(device), _groups(info.tolist()))
    return per_key[key]


def _groups(info: list[list[int]]) -> list[tuple[int, ...]]:
    groups, channel, byte, offset = [], 0, 0, 0
    for dg, mse_bits, qjl, norm_correction, norm_bytes in info:
        rotation_at, offset = offset, offset + dg * dg
        centroids_at = boundaries_at = sketch_at = 0
        if mse_bits:  # centroids, then boundaries
            centroids_at, boundaries_at = offset, offset + 2 ** mse_bits
            offset += 2 ** (mse_bits + 1) - 1
        if qjl:
            sketch_at, offset = offset, offset + dg * dg
        groups.append((dg, mse_bits, qjl, norm_correction, norm_bytes, channel, byte, rotation_at, centroids_at,
                       boundaries_at, sketch_at))
        channel += dg
        byte += dg * mse_bits // 8 + (dg // 8 + 2 if qjl else 0) + norm_bytes
    return groups
