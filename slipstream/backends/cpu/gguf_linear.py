"""The CPU backend's methods for GGUF weights as stored: gemm.c's kernels on Q4_0, Q4_1 and Q8_0
repacked, kernels/gguf_gemm.c on every other format's blocks as the file has them.

Q4_0 / Q4_1 (`NativeQ4`) become gemm.c's int4 weights and Q8_0 (`NativeQ8`) its int8 quads, with
the file's float16 scales (and Q4_1's minimums) per group of 32 and column: the same values and the
same bytes per weight, moved once at load into the kernels' layout (16 columns side by side, so
that one vector op applies a group's scale to 16 columns); `file_blocks` moves them back. Q4 takes
the int4 kernels (AVX-512 loops, AMX tiles, the fused decode stack) wherever the GemmPolicy gives
int4 one: 3.8x gguf_gemm.c's per-row kernel on SmolLM2's gate_up at one row (31 vs 117 us, one core
of the AMX machine); Q8_0 the int8 loops below UPCAST_MIN_ROWS (SmolLM2's LM head: 0.73 vs 1.55 ms
per decode step, 2 threads). A tied embedding reads its rows through `Repacked.rows`.

For the other formats (`NativeGGUF`; and every format for float32 activations), below
DEQUANTIZE_MIN_ROWS rows (decode, small batches) every segment of a layer's blocks is
multiplied in place by the native GEMM (codes widened to float32 in registers, the format's
scales per group: see the kernel's header), writing its columns of the output directly. From
there on (prefill) the GEMM is compute bound and the dense GEMMs win, so the kernel dequantizes
tiles of DEQUANTIZE_TILE weights to float32 and oneDNN multiplies them in the activations' dtype
(bf16 on AMX tiles here): only a tile is ever widened, never the layer. Without kernels
(SLIPSTREAM_NATIVE=0, no compiler) the torch twin in layers/gguf_linear.py serves, which is also
the reference the tests hold the kernels to. This module never knows files or models.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.backends.cpu import abi
from slipstream.backends.cpu.linear import (UPCAST_MIN_ROWS, GemmPolicy, NativeCodes, dense_linear, native_matmul,
                                            pack_nibbles, pack_quads, unpack_nibbles, unpack_quads)
from slipstream.layers.gguf_linear import BlockRows, GGUFLinear, segments
from slipstream.layers.linear import Linear, LinearMethod

# One core of the development machine (AMX), CPU time, native GEMM vs dequantizing + bf16 F.linear
# at 16 / 64 / 256 rows: SmolLM2's gate_up (Q4_1, 3072 x 576) 1.54 vs 2.05, 5.9 vs 2.7, 28 vs 4.0 ms;
# Gemma 3's gate_up (Q5_0, 4096 x 640) 3.0 vs 3.3, 11 vs 3.5, 44 vs 6.1 ms: the crossover is near 24 rows
DEQUANTIZE_MIN_ROWS = 32
DEQUANTIZE_TILE = 1 << 21  # weights per dequantized tile: 8 MB of float32


class NativeGGUF(GGUFLinear):
    def __init__(self, lib: abi.Kernels):
        self.lib = lib

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        xf = x.contiguous() if x.shape[0] >= DEQUANTIZE_MIN_ROWS else x.float().contiguous()
        out = torch.empty(x.shape[0], layer.out_features, dtype=xf.dtype)
        col = 0
        for rows in segments(layer):
            n = rows.data.shape[0]
            if x.shape[0] >= DEQUANTIZE_MIN_ROWS:
                self._dense(rows, xf, out[:, col:col + n], layer.in_features)
            else:
                gguf_gemm(self.lib, xf, rows.fmt.ggml_type, rows.data, out[:, col:], layer.in_features)
            col += n
        out = out if layer.bias is None else out.add_(layer.bias)
        return out.to(x.dtype)

    def _dense(self, rows: BlockRows, x: torch.Tensor, out: torch.Tensor, k: int) -> None:
        step = max(1, DEQUANTIZE_TILE // k)
        for start in range(0, rows.data.shape[0], step):
            tile = dequantize(self.lib, rows.fmt.ggml_type, rows.data[start:start + step], k)
            out[:, start:start + tile.shape[0]] = F.linear(x, tile.to(x.dtype))


def gguf_gemm(lib: abi.Kernels, x: torch.Tensor, ggml_type: int, blocks: torch.Tensor, out: torch.Tensor,
              k: int) -> None:
    """out[:, :N] = x [M, K] float32 times blocks [N, row bytes] of format `ggml_type`, transposed."""
    n = blocks.shape[0]
    status = lib.gguf_gemm(ggml_type, x.data_ptr(), blocks.data_ptr(), out.data_ptr(), x.shape[0], n, k,
                           out.stride(0), abi.threads())
    if status != 0:  # formats and shapes were checked at load; what is left is a failed allocation
        raise MemoryError(f"gguf_gemm could not allocate block sums for a {x.shape[0]}x{k} input")


def dequantize(lib: abi.Kernels, ggml_type: int, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """blocks [N, row bytes] of format `ggml_type` -> float32 [N, K]."""
    out = torch.empty(blocks.shape[0], k)
    if lib.gguf_dequantize(ggml_type, blocks.data_ptr(), out.data_ptr(), blocks.shape[0], k, abi.threads()) != 0:
        raise ValueError(f"ggml type {ggml_type} with K={k} has no native dequantization")  # checked at load
    return out


HEADS = {"Q4_0": 1, "Q4_1": 2, "Q8_0": 1}  # float16 values heading each block: d; d and m; d


def repackable(layer: Linear) -> bool:
    """One segment of Q4_0, Q4_1 or Q8_0 whose columns tile by 16, activations in bf16 (the kernels')."""
    formats = layer.block_formats
    return (len(formats) == 1 and formats[0].name in HEADS and layer.out_features % 16 == 0
            and getattr(layer, "dtype", None) == torch.bfloat16)


def repack(rows: BlockRows) -> dict[str, torch.Tensor]:
    """Blocks [N, row bytes] -> gemm.c's layouts: codes `packed` (Q4: nibbles [N/16, K/8, 16, 4]; Q8_0:
    int8 quads [N/16, K/4, 16, 4]), float16 `packed_scale` (d) and, for Q4_1, `packed_low` (m),
    [N/16, K/32, 16]."""
    n, heads = rows.data.shape[0], HEADS[rows.fmt.name]
    blocks = rows.data.view(n, -1, rows.fmt.type_size)
    scales = blocks[..., :2 * heads].contiguous().view(torch.float16)  # [N, groups, heads]
    codes = blocks[..., 2 * heads:]
    if rows.fmt.name == "Q8_0":
        packed = pack_quads(codes.contiguous().view(torch.int8).reshape(n, -1))
    else:  # a block's 16 low nibbles, then its 16 high ones
        packed = pack_nibbles(torch.cat([codes & 15, codes >> 4], dim=-1).reshape(n, -1))
    by_block = lambda t: t.reshape(n // 16, 16, -1).transpose(1, 2).contiguous()  # noqa: E731
    repacked = {"packed": packed, "packed_scale": by_block(scales[..., 0])}
    if heads == 2:
        repacked["packed_low"] = by_block(scales[..., 1])
    return repacked


def _selected(layer: Linear, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Rows `ids` of a repacked layer: their codes [len, K] and float16 heads [len, groups] each."""
    at = (ids // 16, slice(None), ids % 16)
    packed = layer.packed[at].unsqueeze(2)  # [len, steps, 1, 4]
    codes = unpack_quads(packed) if packed.dtype == torch.int8 else unpack_nibbles(packed)
    low = getattr(layer, "packed_low", None)
    return codes, [layer.packed_scale[at]] + ([] if low is None else [low[at]])


def file_blocks(layer: Linear) -> torch.Tensor:
    """`repack` undone: the file's blocks [N, row bytes]."""
    codes, heads = _selected(layer, torch.arange(layer.out_features))
    n, k = codes.shape
    groups = codes.view(n, k // 32, 32)
    payload = groups.view(torch.uint8) if codes.dtype == torch.int8 else groups[..., :16] | (groups[..., 16:] << 4)
    return torch.cat([*(h.unsqueeze(-1).view(torch.uint8) for h in heads), payload], dim=-1).reshape(n, -1)


class Repacked(LinearMethod):
    """Q4_0, Q4_1 and Q8_0 blocks repacked for gemm.c's kernels, multiplied in plain torch: tiles of
    rows dequantized to float32 as the torch twin computes them (d * q + m; Q4_0 d * (q - 8) and
    Q8_0 d * q, both exact). The fallback of the native methods below, for rows their policy gives
    no kernel; a tied embedding's rows."""

    name = "gguf"

    def __init__(self, upcast: bool):
        self.upcast = upcast  # float32 GEMMs for large bf16 batches (CPUs without AMX)

    def create(self, layer: Linear) -> None:
        (rows,) = segments(layer)
        for name, tensor in repack(rows).items():
            layer.register_buffer(name, tensor)
        del layer.blocks0

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], layer.out_features)
        step = max(16, DEQUANTIZE_TILE // layer.in_features // 16 * 16)
        for start in range(0, layer.out_features, step):
            tile = self.rows(layer, torch.arange(start, min(start + step, layer.out_features)))
            out[:, start:start + tile.shape[0]] = dense_linear(x, tile.to(x.dtype), None, self.upcast)
        return out if layer.bias is None else out.add_(layer.bias)

    def rows(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        codes, heads = _selected(layer, ids)
        n, k = codes.shape
        d = heads[0].float().unsqueeze(-1)
        if len(heads) == 2:  # Q4_1
            low = heads[1].float().unsqueeze(-1)
        else:  # Q4_0's codes sit at 8, Q8_0's are signed
            low = -8 * d if codes.dtype == torch.uint8 else 0
        return (d * codes.view(n, k // 32, 32).float() + low).reshape(n, k)


class NativeQ4(NativeCodes, Repacked):
    """Repacked Q4_0 / Q4_1 on gemm.c's int4 kernels with float16 scales (`gemm_q4*`), the decode stack's
    too, wherever the GemmPolicy gives int4 one."""

    layout = "int4"

    def __init__(self, policy: GemmPolicy, upcast: bool):
        super().__init__(upcast)
        self.policy = policy

    def native_mm(self, layer: Linear, x: torch.Tensor, kernel: str, silu: bool = False) -> torch.Tensor:
        return native_matmul(x, layer.packed, layer.packed_scale, getattr(layer, "packed_low", None), kernel=kernel,
                             silu=silu)

    def weight_struct(self, layer: Linear, lib: abi.Kernels) -> abi.Weight:
        low = getattr(layer, "packed_low", None)
        return abi.Weight(lib.weight_kind_q4, layer.packed.data_ptr(), layer.packed_scale.data_ptr(),
                          None if low is None else low.data_ptr(), layer.out_features)


class NativeQ8(NativeCodes, Repacked):
    """Repacked Q8_0 on gemm.c's int8 loops with a float16 scale per group (`gemm_q8`): below
    UPCAST_MIN_ROWS rows, or at every row count where batch invariance asks it (it has no AMX
    form; the per-layer path only, not the decode stack)."""

    def __init__(self, policy: GemmPolicy, upcast: bool):
        super().__init__(upcast)
        self.policy = policy

    def _kernel(self, layer: Linear, x: torch.Tensor) -> str | None:
        native = x.dtype == torch.bfloat16 and (self.policy.invariant or x.shape[0] < UPCAST_MIN_ROWS)
        return "avx512" if native else None

    def native_mm(self, layer: Linear, x: torch.Tensor, kernel: str, silu: bool = False) -> torch.Tensor:
        return native_matmul(x, layer.packed, layer.packed_scale, kernel=kernel)
