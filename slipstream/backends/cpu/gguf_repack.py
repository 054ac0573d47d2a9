"""GGUF's block formats moved into kernels/gemm.c's layouts at load, and back: the same values, and
(k-quants' 6-bit scales aside, a byte each) the same bytes.

`parse` reads a format's fields per row (`Parts`); `repack` lays them out as the kernels read them:
codes 16 columns side by side (the low four bits as nibbles, Q8_0's as int8 quads), each format's
scales per group and column, and Q5's and Q6_K's higher bits as planes of one dword per group and
column. `selected` and `file_blocks` read rows back (a tied embedding's lookup, the round-trip
tests), `dequantized` gives their float32 values as the torch twin computes them. This module never
knows kernels or models.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from slipstream.backends.cpu.linear import pack_nibbles, pack_quads, unpack_nibbles, unpack_quads
from slipstream.layers.gguf_formats import k_scales, nibbles
from slipstream.layers.gguf_linear import BlockRows

HEADS = {"Q4_0": 1, "Q4_1": 2, "Q5_0": 1, "Q5_1": 2, "Q8_0": 1}  # float16 values heading each block: d (and m)
FIFTH_BITS = {"Q5_0", "Q5_1"}  # their heads are followed by 4 bytes of fifth bits, weight j at bit j
K_QUANTS = {"Q4_K", "Q5_K"}  # d, dmin, 12 bytes of 6-bit group scales and minimums, (Q5_K: 32 bytes of fifth bits), codes
# Q6_K: 128 bytes of low four bits, 64 of the top two, 16 int8 scales (one per 16 weights), d
# A group's fifth bits as gemm.c's plane holds them: K step s at bit (s % 2) * 16 + s // 2
PLANE_BIT = [(s % 2) * 16 + s // 2 for s in range(32)]
REPACKED = {*HEADS, *K_QUANTS, "Q6_K"}
REPACK_ROWS = 4096  # a multiple of 16; a 262k-row LM head's temporaries stay a few MB


@dataclass
class Parts:
    """A block format's fields, per row: `codes` [N, K] (uint8: the low four bits; Q8_0: int8), `scale`
    and `low` [N, S] float16 (d and m, or k-quants' d and dmin per 256), `fifth` and Q6_K's `sixth`
    [N, K/32] int32 (bit j: weight j of the group), k-quants' `group` [N, K/32, 2] uint8 (6-bit scale,
    minimum) or Q6_K's [N, K/16] int8 scales."""

    codes: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor | None = None
    fifth: torch.Tensor | None = None
    group: torch.Tensor | None = None
    sixth: torch.Tensor | None = None


def parse(rows: BlockRows) -> Parts:
    """The file's blocks [N, row bytes] -> their fields."""
    n, name = rows.data.shape[0], rows.fmt.name
    blocks = rows.data.view(n, -1, rows.fmt.type_size)
    if name == "Q6_K":  # halves of 128 weights: four groups of 32 each, low nibbles of 64 bytes, 2 bits of 32
        ql = blocks[..., :128].reshape(n, -1, 2, 64)
        codes = nibbles(ql).reshape(n, -1)
        top = (blocks[..., 128:192].reshape(n, -1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3
        fifth, sixth = (_words(b.reshape(n, -1, 32)) for b in (top & 1, top >> 1))
        return Parts(codes, blocks[..., 208:].contiguous().view(torch.float16)[..., 0], None, fifth,
                     blocks[..., 192:208].contiguous().view(torch.int8).reshape(n, -1), sixth)
    if name in K_QUANTS:
        heads = blocks[..., :4].contiguous().view(torch.float16)
        sc, mn = k_scales(blocks[..., 4:16].reshape(-1, 12))
        fifth = None
        if name == "Q5_K":  # bit g of byte l: weight l of group g
            bits = (blocks[..., 16:48].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
            fifth = _words(bits).reshape(n, -1)
        qs = blocks[..., 48 if fifth is not None else 16:].reshape(n, -1, 32)  # 32 bytes: two groups' nibbles
        return Parts(nibbles(qs).reshape(n, -1), heads[..., 0], heads[..., 1], fifth,
                     torch.stack([sc, mn], dim=-1).reshape(n, -1, 2))
    heads = HEADS[name]
    scales = blocks[..., :2 * heads].contiguous().view(torch.float16)  # [N, groups, heads]
    fifth = blocks[..., 2 * heads:2 * heads + 4].contiguous().view(torch.int32)[..., 0] if name in FIFTH_BITS else None
    qs = blocks[..., 2 * heads + (0 if fifth is None else 4):]
    codes = qs.contiguous().view(torch.int8) if name == "Q8_0" else nibbles(qs)
    return Parts(codes.reshape(n, -1), scales[..., 0], scales[..., 1] if heads == 2 else None, fifth)


def _words(bits: torch.Tensor) -> torch.Tensor:
    """[..., 32] bits -> [...] int32 words, bit j from bits[..., j]."""
    return (bits.int() << torch.arange(32, dtype=torch.int32)).sum(-1, dtype=torch.int32)


def _bits(words: torch.Tensor) -> torch.Tensor:
    """`_words` undone: [...] int32 -> [..., 32] bits (uint8)."""
    return ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)


def unparse(parts: Parts) -> torch.Tensor:
    """`parse` undone: the file's blocks [N, row bytes]."""
    n, k = parts.codes.shape
    if parts.sixth is not None:  # Q6_K
        c = parts.codes.view(n, k // 256, 2, 4, 32)
        ql = torch.cat([c[..., 0, :] | (c[..., 2, :] << 4), c[..., 1, :] | (c[..., 3, :] << 4)], dim=-1)
        top = (_bits(parts.fifth) | (_bits(parts.sixth) << 1)).view(n, k // 256, 2, 4, 32)
        qh = sum(top[..., j, :] << (2 * j) for j in range(4))
        return torch.cat([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), parts.group.view(torch.uint8).view(n, -1, 16),
                          parts.scale.unsqueeze(-1).view(torch.uint8)], dim=-1).reshape(n, -1)
    if parts.group is not None:
        sc, mn = parts.group.reshape(-1, 8, 2).unbind(-1)
        qs = parts.codes.view(n, k // 64, 64)
        fields = [torch.stack([parts.scale, parts.low], -1).view(torch.uint8), _k_scale_bytes(sc, mn).view(n, -1, 12)]
        if parts.fifth is not None:  # byte l: bit g from weight l of group g
            bits = _bits(parts.fifth.view(n, -1, 8))  # [N, S, g, l]
            fields.append((bits << torch.arange(8, dtype=torch.uint8)[:, None]).sum(-2, dtype=torch.uint8))
        fields.append((qs[..., :32] | (qs[..., 32:] << 4)).reshape(n, k // 256, 128))
        return torch.cat(fields, dim=-1).reshape(n, -1)
    groups = parts.codes.view(n, k // 32, 32)
    payload = groups.view(torch.uint8) if groups.dtype == torch.int8 else groups[..., :16] | (groups[..., 16:] << 4)
    fields = [h.unsqueeze(-1).view(torch.uint8) for h in (parts.scale, parts.low) if h is not None]
    if parts.fifth is not None:
        fields.append(parts.fifth.unsqueeze(-1).view(torch.uint8))
    return torch.cat(fields + [payload], dim=-1).reshape(n, -1)


def _k_scale_bytes(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """`k_scales` undone: eight 6-bit scales and minimums [B, 8] -> 12 bytes [B, 12]."""
    return torch.cat([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                      (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], dim=-1)


def repack(rows: BlockRows, in_place: bool = False) -> dict[str, torch.Tensor]:
    """Blocks [N, row bytes] -> gemm.c's layouts: codes `packed` (nibbles [N/16, K/8, 16, 4]; Q8_0: int8
    quads [N/16, K/4, 16, 4]) and, each [N/16, ..., 16], float16 `packed_scale` and `packed_low` (Q4_1,
    Q5_1, k-quants), the planes of fifth and sixth bits `packed_high` and `packed_sixth` (int32; Q5_0,
    Q5_1, Q5_K, Q6_K) and `packed_group` (k-quants' [N/16, K/32, 2, 16] bytes, Q6_K's [N/16, K/16, 16]
    int8). REPACK_ROWS rows at a time, so that repacking adds no more than the result to memory.
    in_place (the rows are the caller's to overwrite): where the result has the blocks' size (every
    format but the k-quants), it takes their bytes, and loading a 178 MB LM head no longer holds it twice."""
    n, out, over = rows.data.shape[0], {}, None
    for start in range(0, n, REPACK_ROWS):
        chunk = _repack_rows(BlockRows(rows.fmt, rows.data[start:start + REPACK_ROWS]))
        if not out:
            shapes = {name: (t.dtype, (n // 16, *t.shape[1:])) for name, t in chunk.items()}
            over = _laid_over(rows.data, shapes) if in_place else None
            out = {name: over[name] if over and name == "packed" else torch.empty(shape, dtype=dtype)
                   for name, (dtype, shape) in shapes.items()}
        # the codes last: in place they overwrite this chunk's blocks, which must all have been read
        for name, t in sorted(chunk.items(), key=lambda item: item[0] == "packed"):
            out[name][start // 16:start // 16 + t.shape[0]] = t
    if not over:
        return out
    for name, view in over.items():  # after the codes, now that no block is left to read
        if name != "packed":
            view.copy_(out[name])
    return over


def _laid_over(data: torch.Tensor, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict | None:
    """Tensors of `shapes` end to end over `data`'s bytes, the codes first (the chunk of codes written
    from a chunk of blocks then never reaches blocks not yet read: a row of codes is shorter than a row of
    blocks); None where they do not fill exactly those bytes, or `data` is not the whole of its memory (a
    tensor-parallel shard's rows: views of the file's tensor would keep all of it)."""
    sizes = {name: dtype.itemsize * math.prod(shape) for name, (dtype, shape) in shapes.items()}
    whole = data.is_contiguous() and data.untyped_storage().nbytes() == data.nbytes
    if not whole or sum(sizes.values()) != data.nbytes:
        return None
    flat, views, at = data.view(-1), {}, 0
    for name in ["packed", *(name for name in shapes if name != "packed")]:
        dtype, shape = shapes[name]
        views[name] = flat[at:at + sizes[name]].view(dtype).view(shape)
        at += sizes[name]
    return views


def _repack_rows(rows: BlockRows) -> dict[str, torch.Tensor]:
    parts = parse(rows)
    n = parts.codes.shape[0]
    by_block = lambda t: t.reshape(n // 16, 16, *t.shape[1:]).movedim(1, -1).contiguous()  # noqa: E731
    codes = pack_quads(parts.codes) if parts.codes.dtype == torch.int8 else pack_nibbles(parts.codes)
    plane = lambda words: None if words is None else _move_bits(words, PLANE_BIT)  # noqa: E731
    repacked = {"packed": codes, "packed_scale": parts.scale, "packed_low": parts.low, "packed_high": plane(parts.fifth),
                "packed_group": parts.group, "packed_sixth": plane(parts.sixth)}
    return {name: t if name == "packed" else by_block(t) for name, t in repacked.items() if t is not None}


def _move_bits(words: torch.Tensor, to: list[int]) -> torch.Tensor:
    """int32 words with bit j moved to bit to[j]."""
    wide = words.long() & 0xFFFFFFFF
    moved = sum(((wide >> j) & 1) << to[j] for j in range(32))
    return (moved - ((moved >> 31) << 32)).int()  # back to int32, two's complement


def selected(layer: nn.Module, ids: torch.Tensor) -> Parts:
    """Rows `ids` of a repacked layer, as `parse` gives them."""
    at = (ids // 16, Ellipsis, ids % 16)
    packed = layer.packed[ids // 16, :, ids % 16].unsqueeze(2)  # [len, steps, 1, 4]
    codes = unpack_quads(packed) if packed.dtype == torch.int8 else unpack_nibbles(packed)
    field = lambda name: None if getattr(layer, name, None) is None else getattr(layer, name)[at]  # noqa: E731
    words = lambda plane: None if plane is None else _move_bits(plane, [PLANE_BIT.index(b) for b in range(32)])  # noqa: E731
    return Parts(codes, field("packed_scale"), field("packed_low"), words(field("packed_high")), field("packed_group"),
                 words(field("packed_sixth")))


def file_blocks(layer: nn.Module) -> torch.Tensor:
    """`repack` undone: the file's blocks [N, row bytes]."""
    return unparse(selected(layer, torch.arange(layer.out_features)))


def dequantized(parts: Parts) -> torch.Tensor:
    """Parts' weights [N, K] float32, as the torch twin computes them."""
    n, k = parts.codes.shape
    q = parts.codes.view(n, k // 32, 32).float()
    if parts.fifth is not None:
        q += 16 * _bits(parts.fifth)
    d = parts.scale.float().unsqueeze(-1)
    if parts.sixth is not None:  # Q6_K: d * sc per 16 times q - 32
        q = (q + 32 * _bits(parts.sixth) - 32).view(n, k // 16, 16)
        return (d.repeat_interleave(16, dim=1) * parts.group.float().unsqueeze(-1) * q).reshape(n, k)
    if parts.group is not None:  # d * sc and dmin * mn per group
        sc, mn = parts.group.float().unbind(-1)
        d = d.repeat_interleave(8, dim=1) * sc.unsqueeze(-1)
        low = -(parts.low.float().repeat_interleave(8, dim=1) * mn.float()).unsqueeze(-1)
    elif parts.low is not None:  # Q4_1, Q5_1
        low = parts.low.float().unsqueeze(-1)
    else:  # Q4_0's codes sit at 8, Q5_0's at 16, Q8_0's are signed
        low = (-8 if parts.fifth is None else -16) * d if parts.codes.dtype == torch.uint8 else 0
    return (d * q + low).reshape(n, k)
