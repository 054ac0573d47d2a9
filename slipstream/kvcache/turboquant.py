"""TurboQuant: one KV-cache vector as one fixed-length row of bytes, and attention on the rows.

Owns: the seeded rotations, codebooks, QJL projection, bit packing and byte layout of a
compressed head vector, the choice of outlier channels for 2.5/3.5 bits, the two
attention primitives that read codes directly (`scores`, `weighted_sum`), and the tables
that native kernels read to do the same (`row_layout`, `encode_tables`). Must never know
about blocks, pages, sequences or models: a paged cache stores the rows returned here as a
uint8 tensor [num_blocks, block_size, num_kv_heads, nbytes].

A row is the concatenation, over channel groups (one group, or two for 2.5/3.5 bits), of
    [codes: group_dim * mse_bits / 8][signs: group_dim / 8][gamma: fp16][norm: fp16, or 1 byte]
where signs and gamma exist only in "prod" mode, mse_bits = bits ("mse") or bits - 1
("prod"), and fp16 values are stored little-endian. A group of at most 2-bit codes stores its norm in one byte
(`NORM8`): its rounding (1.4% RMS) is small beside those codes' error (34% RMS at 2 bits) and measured no worse
(tq2.5 at 8k, code: KL 0.0248 -> 0.0243), and the byte a side buys staging for more recent tokens; at 4 bits it
measured KL 0.0053 -> 0.0068 (tq4), so wider codes keep fp16.

Everything here works in a "code space": per group, the rotated centroid vector times the
norm, followed (prod) by the QJL signs times norm * gamma * sqrt(pi/2) / group_dim. A fixed
"lift" matrix (the rotation, stacked over the Gaussian projection S for prod) maps code space
back to channels, so x_hat = z @ lift, <q, x_hat> = <q @ lift.T, z>, and
sum_t p_t x_hat_t = (p @ z) @ lift: queries and outputs are rotated once, never the cache.
"""
from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from slipstream.kvcache.codebooks import sphere_codebook

BITS = (1, 2, 2.5, 3, 3.5, 4)
MODES = ("mse", "prod")
ROTATIONS = ("qr", "hadamard")
# (fraction of channels, bits) per group; the first group holds the outlier channels.
SPLITS = {2.5: ((1 / 4, 4), (3 / 4, 2)), 3.5: ((1 / 2, 4), (1 / 2, 3))}
# A 1-byte norm is an unsigned float, 4 exponent bits (2^-8 to 2^7) over 4 mantissa bits, byte 0 meaning 0:
# (byte << 19) + NORM8_BIAS are its float32 bits, so a kernel decodes it with a shift and an add. The cache keeps
# norms near 1 (TurboQuantLayerCache: scales with a median norm of 1 per KV head), where the range is centred.
NORM8_BIAS = 119 << 23
# Codes per decode-table row: rows of at most 12 bits keep each table within a cache.
_CODES_PER_ROW = {1: 8, 2: 4, 3: 4, 4: 2}


class TurboQuantizer:
    """Compress vectors of size `dim` to `nbytes` bytes each (TurboQuant_mse or _prod).

    bits: 1, 2, 3, 4, or 2.5 / 3.5 (two channel groups, each with its own rotation and
    codebook: for d=128, 32 channels at 4 bits + 96 at 2, or 64 at 4 + 64 at 3).
    mode: "mse" (b-bit codes + norm) or "prod" ((b-1)-bit codes + 1-bit QJL signs of the
    residual + residual norm + norm; unbiased inner products, meant for keys only).
    seed: fixes every random matrix; use one per layer and per K/V, shared by its heads.
    rotation: "qr" (Haar-random orthogonal, the default: its error does not depend on the
    input) or "hadamard" (random signs, then Walsh-Hadamard / sqrt(d); needs power-of-two
    groups, so not 2.5 bits). Both are applied as dense matrices: a butterfly transform in
    plain torch measured slower than one matmul.

    Each group's codebook is Lloyd-Max for the exact coordinate density of a rotated unit
    vector at the group's dimension (`sphere_codebook`), not its N(0, 1/d) approximation.
    norm_correction (mse mode only): store s = |x|^2 / <x, x_hat_unit> in place of |x|, so
    that <x, x_hat> = |x|^2 exactly. On random vectors it gives a larger reconstruction
    error at 1-3 bits; on SmolLM2's keys it cut the KL of tq4 by a third (see the cache).

    Shapes: vectors are (..., dim), rows (..., nbytes): the bytes stored per vector (one head
    of one token: codes, signs and norms). With 2.5/3.5 bits the high-bit group is the
    first channels (`outlier_channels` is None) until `calibrate` picks the highest-RMS
    channels of each KV head; from then on inputs must carry the KV-head axis, as documented
    on each method.
    """

    def __init__(self, dim: int, bits: float, mode: str = "mse", seed: int = 0,
                 rotation: str = "qr", norm_correction: bool = False):
        _validate(dim, bits, mode, rotation)
        if norm_correction and mode != "mse":
            raise ValueError("norm_correction applies to mode='mse' only (prod is already unbiased)")
        self.dim, self.bits, self.mode, self.rotation = dim, bits, mode, rotation
        generator = torch.Generator().manual_seed(seed)
        self._groups = [_Group(size, group_bits, mode, rotation, generator, norm_correction)
                        for size, group_bits in _group_sizes(dim, bits)]
        self.nbytes = sum(group.nbytes for group in self._groups)
        self._lift = _Constants(lift=torch.block_diag(*(g.lift for g in self._groups)))
        self._permutation: _Constants | None = None
        self.outlier_channels: torch.Tensor | None = None

    def calibrate(self, samples: torch.Tensor) -> None:
        """Fix the outlier channels of each KV head from samples (N, num_kv_heads, dim).

        Picks the highest-RMS channels per head for the high-bit group, once: rows written
        before a second choice would be misread, so calling again raises. With integer bits
        there is no channel split and this does nothing. Afterwards `quantize`/`dequantize`
        take (..., num_kv_heads, dim) and `scores`/`weighted_sum` take *batch ending in
        num_kv_heads; `outlier_channels` is (num_kv_heads, n) in ascending order.
        """
        if len(self._groups) == 1:
            return
        if self._permutation is not None:
            raise RuntimeError("TurboQuantizer.calibrate was already called; the outlier "
                               "channels are fixed so that stored codes stay valid")
        if samples.dim() != 3 or samples.shape[-1] != self.dim:
            raise ValueError(f"calibration samples must be (N, num_kv_heads, {self.dim}), "
                             f"got shape {tuple(samples.shape)}")
        energy = samples.detach().float().square().mean(0).cpu()
        outliers = energy.topk(self._groups[0].dim, dim=-1).indices.sort(-1).values
        rest = torch.ones_like(energy, dtype=torch.bool).scatter_(1, outliers, False)
        channels = torch.arange(self.dim).expand_as(energy)[rest].view(len(energy), -1)
        order = torch.cat([outliers, channels], -1)
        self._permutation = _Constants(forward=order, inverse=order.argsort(-1))
        self.outlier_channels = outliers

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """(..., dim) float -> (..., nbytes) uint8; after calibrate, (..., num_kv_heads, dim)."""
        x = self._permute(_check_last(x, self.dim, "x").float(), head_axis=-2)
        rows, start = [], 0
        for group in self._groups:
            rows.append(group.encode(x[..., start:start + group.dim]))
            start += group.dim
        return torch.cat(rows, -1)

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """(..., nbytes) uint8 -> (..., dim) float32 reconstruction (the reference path)."""
        lift = self._lift.on(codes.device).lift
        return self._permute(self.code_space(codes) @ lift, head_axis=-2, inverse=True)

    def scores(self, q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Estimates of <q, k_t>: q (*batch, M, dim), codes (*batch, T, nbytes) -> (*batch, M, T).

        M is query heads per KV head times query tokens; after calibrate, *batch must end in
        num_kv_heads. Queries are rotated (and projected by S) once; keys stay as codes.
        """
        q = self.rotate_queries(q)
        scores, start = None, 0
        for unit, scale in self._parts(codes):  # scales applied to (M, T) scores, not (T, width) codes
            width = unit.shape[-1]
            part = (q[..., start:start + width] @ unit.transpose(-1, -2)) * scale.transpose(-1, -2)
            scores, start = part if scores is None else scores + part, start + width
        return scores

    def weighted_sum(self, p: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """sum_t p_t v_t: p (*batch, M, T), codes (*batch, T, nbytes) -> (*batch, M, dim).

        Accumulates in code space and maps back to channels once per row of p.
        """
        p = p.float()
        return self.restore(_concat([(p * scale.transpose(-1, -2)) @ unit for unit, scale in self._parts(codes)]))

    def rotate_queries(self, q: torch.Tensor) -> torch.Tensor:
        """(*batch, M, dim) -> (*batch, M, code_width): <q, x_hat> = <rotate_queries(q), code-space x>."""
        lift = self._lift.on(q.device).lift
        return self._permute(_check_last(q, self.dim, "q").float(), head_axis=-3) @ lift.T

    def restore(self, z: torch.Tensor) -> torch.Tensor:
        """(*batch, M, code_width) code-space sums -> (*batch, M, dim) in channels."""
        return self._permute(z @ self._lift.on(z.device).lift, head_axis=-3, inverse=True)

    @property
    def code_width(self) -> int:
        return self._lift.cpu["lift"].shape[0]

    @functools.cached_property
    def row_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A row's pieces, in code-space order, for native kernels that read rows directly.

        int32 (pieces, 6): byte offset of the codes, bits per code, number of codes, byte
        offset of the norm, byte offset of the fp16 gamma (-1: none), bytes of the norm (2: fp16,
        1: NORM8). float32
        (pieces, 17): a constant factor, then each code's value (padded to 16). A piece's
        code-space entries are value[code] * norm * gamma * factor.
        """
        ints, floats, start = [], [], 0
        for group in self._groups:
            for offset, bits, values, gamma_at, factor in group.pieces():
                ints.append([start + offset, bits, group.dim, start + group.nbytes - group.norm_bytes,
                             -1 if gamma_at is None else start + gamma_at, group.norm_bytes])
                floats.append(torch.cat([torch.tensor([factor]), F.pad(values.float(), (0, 16 - len(values)))]))
            start += group.nbytes
        return torch.tensor(ints, dtype=torch.int32), torch.stack(floats).float().contiguous()

    @functools.cached_property
    def encode_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What `quantize` computes with, for native encoders: int32 (groups, 5) = (dim, mse bits, QJL,
        norm correction, norm bytes), and float32 per group, back to back: the rotation transposed (dim x dim:
        y = x @ it, row by row as the encoders read it), centroids and boundaries (mse bits > 0), residual_to_sketch
        (QJL)."""
        info, constants = [], []
        for group in self._groups:
            c = group._constants.cpu
            info.append([group.dim, group.mse_bits, int(group.qjl), int(group.norm_correction), group.norm_bytes])
            constants += [c["rotation"].T.flatten()]
            constants += [c["centroids"], c["boundaries"]] if group.mse_bits else []
            constants += [c["residual_to_sketch"].flatten()] if group.qjl else []
        return torch.tensor(info, dtype=torch.int32), torch.cat(constants).float().contiguous()

    @property
    def channel_order(self) -> torch.Tensor | None:
        """(num_kv_heads, dim): the channels of each head in group order (outliers first); None before calibrate."""
        return None if self._permutation is None else self._permutation.cpu["forward"]

    def code_space(self, codes: torch.Tensor) -> torch.Tensor:
        """(..., nbytes) uint8 -> (..., code_width) float32: what scores and sums read, before any rotation."""
        return _concat([unit * scale for unit, scale in self._parts(codes)])

    def _parts(self, codes: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Code space as (unit (..., T, width), scale (..., T, 1)) pieces, in lift order."""
        if codes.dtype != torch.uint8:
            raise ValueError(f"codes must be uint8, got {codes.dtype}")
        codes = _check_last(codes, self.nbytes, "codes")
        parts, start = [], 0
        for group in self._groups:
            parts += group.parts(codes[..., start:start + group.nbytes])
            start += group.nbytes
        return parts

    def _permute(self, x: torch.Tensor, head_axis: int, inverse: bool = False) -> torch.Tensor:
        """Reorder channels per KV head so the outlier group comes first (or undo it)."""
        if self._permutation is None:
            return x
        tables = self._permutation.on(x.device)
        order = tables.inverse if inverse else tables.forward
        heads = len(order)
        if x.dim() < -head_axis or x.shape[head_axis] != heads:
            raise ValueError(f"after calibrate, axis {head_axis} must be num_kv_heads={heads}; "
                             f"got shape {tuple(x.shape)}")
        index = order.view(heads, *[1] * (-head_axis - 2), self.dim)
        return torch.take_along_dim(x, index.expand(*x.shape[:head_axis], *index.shape), dim=-1)


class _Group:
    """TurboQuant at an integer bit width on `dim` consecutive (permuted) channels."""

    def __init__(self, dim: int, bits: int, mode: str, rotation: str, generator: torch.Generator,
                 norm_correction: bool = False):
        self.dim, self.norm_correction = dim, norm_correction
        self.mse_bits = bits if mode == "mse" else bits - 1
        self.qjl = mode == "prod"
        rotate = _ROTATION_MATRICES[rotation](dim, generator)
        constants = {"rotation": rotate.float(),
                     "sign_table": decode_table(torch.tensor([-1.0, 1.0]), 1)}
        if self.mse_bits:
            book = sphere_codebook(dim, self.mse_bits)
            constants["centroids"] = torch.tensor(book.centroids)
            constants["boundaries"] = torch.tensor(book.boundaries)
            constants["centroid_table"] = decode_table(constants["centroids"], self.mse_bits)
        lifts = [rotate] if self.mse_bits else []
        if self.qjl:
            projection = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
            constants["residual_to_sketch"] = (rotate @ projection.T).float()
            lifts.append(projection)
        self._constants = _Constants(**constants)
        self.lift = torch.cat(lifts).float()
        self.code_bytes = dim * self.mse_bits // 8
        self.sign_bytes = dim // 8 if self.qjl else 0
        self.norm_bytes = 1 if self.mse_bits <= 2 else 2
        self.nbytes = self.code_bytes + self.sign_bytes + 2 * self.qjl + self.norm_bytes  # fp16 gamma, norm
        # E[<Sq, sign(Sr)>] = sqrt(2/pi) * d * <q, r>/|r| for N(0,1) rows of S.
        self.sign_factor = math.sqrt(math.pi / 2) / dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(..., dim) float32 -> (..., nbytes) uint8."""
        c = self._constants.on(x.device)
        y = x @ c.rotation.T
        norm = y.norm(dim=-1, keepdim=True)
        y = y / norm.clamp_min(torch.finfo(torch.float32).tiny)
        parts = []
        if self.mse_bits:
            index = torch.bucketize(y, c.boundaries)
            parts.append(pack_bits(index, self.mse_bits))
            if self.norm_correction:  # |x|^2 / <x, norm * c[idx]> * norm = norm / <y, c[idx]>
                norm = norm / (y * c.centroids[index]).sum(-1, keepdim=True).clamp_min(1e-3)
            y = y - c.centroids[index]
        if self.qjl:
            parts.append(pack_bits(y @ c.residual_to_sketch >= 0, 1))
            parts.append(_fp16_to_bytes(y.norm(dim=-1, keepdim=True)))
        parts.append(_norm8_to_bytes(norm) if self.norm_bytes == 1 else _fp16_to_bytes(norm))
        return torch.cat(parts, -1)

    def pieces(self) -> list[tuple[int, int, torch.Tensor, int | None, float]]:
        """(byte offset, bits, code values, gamma byte offset or None, factor) per `parts` entry."""
        c = self._constants.cpu
        pieces = [(0, self.mse_bits, c["centroids"], None, 1.0)] if self.mse_bits else []
        if self.qjl:
            pieces.append((self.code_bytes, 1, torch.tensor([-1.0, 1.0]), self.nbytes - self.norm_bytes - 2,
                           self.sign_factor))
        return pieces

    def parts(self, codes: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(..., nbytes) uint8 -> pieces (unit, scale) whose unit * scale, concatenated, is the
        float32 code-space vector z with x_hat = z @ lift."""
        c = self._constants.on(codes.device)
        norm = _bytes_to_norm8(codes[..., -1:]) if self.norm_bytes == 1 else _bytes_to_fp16(codes[..., -2:])
        parts, start = [], self.code_bytes
        if self.mse_bits:
            parts.append((lookup(codes[..., :start], c.centroid_table, self.mse_bits), norm))
        if self.qjl:
            signs = lookup(codes[..., start:start + self.sign_bytes], c.sign_table, 1)
            gamma = _bytes_to_fp16(codes[..., -self.norm_bytes - 2:-self.norm_bytes])
            parts.append((signs, norm * gamma * self.sign_factor))
        return parts


class _Constants:
    """Constant tensors kept on the CPU and copied once to each device that asks for them."""

    def __init__(self, **tensors: torch.Tensor):
        self.cpu = tensors
        self._copies: dict[torch.device, SimpleNamespace] = {}

    def on(self, device: torch.device) -> SimpleNamespace:
        if device not in self._copies:
            self._copies[device] = SimpleNamespace(
                **{name: t.to(device) for name, t in self.cpu.items()})
        return self._copies[device]


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., n) integers in [0, 2**bits), n % 8 == 0 -> (..., n * bits / 8) uint8, LSB first."""
    _check_code_bits(bits)
    shifts = torch.arange(8, device=codes.device) * bits
    word = (codes.to(torch.int64).unflatten(-1, (-1, 8)) << shifts).sum(-1, keepdim=True)
    return ((word >> torch.arange(0, 8 * bits, 8, device=codes.device)) & 0xFF).to(
        torch.uint8).flatten(-2)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_bits: (..., n * bits / 8) uint8 -> (..., n) int64."""
    _check_code_bits(bits)
    return lookup(packed, decode_table(torch.arange(2**bits), bits), bits)


def decode_table(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Row r lists values[code] for each code packed, least significant first, in integer r."""
    per_row = _CODES_PER_ROW[bits]
    rows = torch.arange(2 ** (per_row * bits))
    return values[(rows[:, None] >> torch.arange(per_row) * bits) & (2**bits - 1)]


def lookup(packed: torch.Tensor, table: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., n * bits / 8) packed codes -> (..., n) values from a decode_table.

    One gather per table row instead of shifts and masks per code, which would otherwise
    dominate attention on codes. With 1, 2 or 4 bits a row is one byte; with 3 bits, every 3
    bytes (8 codes) form one 24-bit word that holds two 12-bit rows.
    """
    if bits != 3:
        return F.embedding(packed.to(torch.int32), table).flatten(-2)
    # a zero fourth byte makes each group one int32 (little-endian, as on every torch device;
    # measured 1.5x faster than shifting and or-ing the three bytes)
    word = F.pad(packed.unflatten(-1, (-1, 3)), (0, 1)).view(torch.int32)
    return F.embedding(torch.cat([word & 0xFFF, word >> 12], -1), table).flatten(-3)


def _check_code_bits(bits: int) -> None:
    if bits not in _CODES_PER_ROW:
        raise ValueError(f"codes are 1 to 4 bits wide, got bits={bits!r}")


def _fp16_to_bytes(value: torch.Tensor) -> torch.Tensor:
    bits = value.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.cat([bits & 0xFF, bits >> 8], -1).to(torch.uint8)


def _bytes_to_fp16(pair: torch.Tensor) -> torch.Tensor:
    bits = pair[..., :1].to(torch.int32) | pair[..., 1:].to(torch.int32) << 8
    signed = bits - (bits >> 15 << 16)  # two's complement without relying on int16 wrap
    return signed.to(torch.int16).view(torch.float16).float()


def _norm8_to_bytes(value: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 -> NORM8 bytes, rounded to nearest (half up in the float's bits), clamped to the range."""
    code = ((value.float().view(torch.int32) + (1 << 18)) >> 19) - (NORM8_BIAS >> 19)
    return code.clamp(0, 255).to(torch.uint8)


def _bytes_to_norm8(byte: torch.Tensor) -> torch.Tensor:
    code = byte.to(torch.int32)
    return torch.where(code > 0, ((code << 19) + NORM8_BIAS).view(torch.float32), 0.0)


def _qr_rotation(dim: int, generator: torch.Generator) -> torch.Tensor:
    gaussian = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    return q * torch.sign(torch.diagonal(r))  # sign fix makes Q Haar-distributed


def _hadamard_rotation(dim: int, generator: torch.Generator) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while len(h) < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    signs = torch.randint(0, 2, (dim,), generator=generator, dtype=torch.float64) * 2 - 1
    return h * signs / math.sqrt(dim)  # flip signs, then transform: H @ diag(signs) / sqrt(d)


_ROTATION_MATRICES = {"qr": _qr_rotation, "hadamard": _hadamard_rotation}


def _group_sizes(dim: int, bits: float) -> list[tuple[int, int]]:
    if bits in SPLITS:
        return [(int(dim * share), group_bits) for share, group_bits in SPLITS[bits]]
    return [(dim, int(bits))]


def _validate(dim: int, bits: float, mode: str, rotation: str) -> None:
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation must be one of {ROTATIONS}, got {rotation!r}")
    multiple = 32 if bits in SPLITS else 8
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % multiple:
        raise ValueError(f"dim must be a positive multiple of {multiple} for bits={bits} "
                         f"(codes are packed into whole bytes per channel group), got {dim!r}")
    sizes = [size for size, _ in _group_sizes(dim, bits)]
    if rotation == "hadamard" and any(size & (size - 1) for size in sizes):
        raise ValueError(f"rotation='hadamard' needs power-of-two channel groups; dim={dim} "
                         f"at bits={bits} gives groups of {sizes}; use rotation='qr'")


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, -1)


def _check_last(x: torch.Tensor, size: int, name: str) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] != size:
        raise ValueError(f"{name} must have last dimension {size}, got shape {tuple(x.shape)}")
    return x
