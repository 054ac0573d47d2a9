"""The CPU backend's linear methods: which GEMM serves how many rows, per weight format and CPU.

Without AMX, measured on one core of an Intel development machine (AVX-512, no AMX), torch
2.13, CPU time of one thread:
- large batches (prefill chunks, big expert groups): oneDNN's bf16 GEMM runs at 71-77
  GFLOP/s against ~125 for fp32, so batches of at least UPCAST_MIN_ROWS rows upcast to
  fp32 for the multiply (1.3-1.75x faster at 128-1024 rows, same fp32 accumulation,
  result returned in bf16);
- small batches (decode) are bound by reading the weights, where bf16's half-size weights
  win. `NativeBf16` packs a layer once for the native GEMM (kernels/gemm.c: bf16 weights
  widened in registers, float32 FMAs), which beats oneDNN's packed bf16 kernel 1.5-2x at 1
  row (it streams weights faster), 1.4-1.6x at 8-64 rows, and the fp32 upcast below
  NATIVE_MAX_ROWS rows (measured crossover 256). Without it (no AVX-512, no compiler)
  `OneDnnBf16` packs for oneDNN's own layout below UPCAST_MIN_ROWS, 1.2-1.8x faster than
  `F.linear` on the plain weight at 1-16 rows, where torch can pack for it (`CpuCapability.onednn_packs_bf16`;
  otherwise `Upcast`). The plain weight stays for the upcast path. AVX2 builds (AMD Zen 3) have gemm.c's bf16
  loops alone, in 8-lane registers (`CpuCapability.bf16_loops`): `NativeBf16` there too, below NATIVE_MAX_ROWS
  (two threads, SmolLM2's projections at 16 rows: 59-103 GFLOP/s against F.linear's 11-17 and the upcast's
  17-47; at 256 rows 73-111 against the upcast's 71-98), silu(gate) * up in torch after it.

AMD's AVX-512 BF16 cores (Zen 4: `CpuCapability.bf16_dots_win`) are the other case: `vdpbf16ps`
issues as fast as a float32 FMA for twice the multiply-adds, so gemm.c's own `vdpbf16ps` loop on
bf16 panels (the packed bf16 weight as it is; int8 and 4-bit codes widened per call) beats the
loops from DOTS_MIN_ROWS rows, and oneDNN's bf16 GEMM and the upcast at every size: every row
count stays on gemm.c and nothing upcasts there (`GemmPolicy(bf16_dots=True)`).

With AMX, the tile kernels of kernels/gemm.c read the same packed weights from AMX_MIN_ROWS
rows on, at every larger size. Large bf16 batches of shapes they cannot tile go to oneDNN,
which uses AMX itself. int8 and int4 codes (layers/quantization.py) get packed copies for
the same kernels; rows the policy gives no native kernel take PyTorch's.

Batch invariance (`GemmPolicy(invariant=True)`): a row's product must not depend on how many
rows share the call, so every packed layer keeps one reduction order at every row count, never
a library GEMM or an fp32 upcast that blocks K by M. AMX's bf16 dot products do not round as
the AVX-512 FMAs do, so bf16 and int4 (whose AMX kernel widens codes to bf16) take the tiles
from one row; int8 takes exact integer sums of 16-bit fixed-point activations on both, added
to float32 in the same chunks (never widened to bf16), so it may switch by rows. On Intel without
AMX the AVX-512 loops at 512 rows (107-120 GFLOP/s) beat the upcast (95-108), so it is free there;
where bf16 dot products win it costs half of oneDNN's rate on bf16 prefill.
"""
from __future__ import annotations

import ctypes
import math

import torch
import torch.nn.functional as F

from slipstream.backends.cpu import abi
from slipstream.layers.linear import Linear, LinearMethod
from slipstream.layers.quantization import Int4, Int8

UPCAST_MIN_ROWS = 128
NATIVE_MAX_ROWS = 256
INT8_WIDEN_MIN_ROWS = 128  # int8 on AMX: codes widened to bf16 tiles beat the integer tiles from here
# From how many rows the AMX tile kernels beat the AVX-512 loops, per weight format, and the
# multiple of K they tile. benchmarks/gemm.py on the AMX machine (1 thread, cold weights,
# GFLOP/s AVX-512 / AMX) for SmolLM2's qkv, o, gate_up, down: bf16 at 4 rows 40/52, 37/32,
# 40/49, 34/31 and at 8 rows 54/67, 53/62, 56/62, 48/63; int8 at 4 rows 53/75, 42/39, 59/73,
# 47/39 and at 8 rows 81/135, 67/78, 79/78, 69/76; int4 at 8 rows 83/68, 61/60, 78/69, 63/56
# and at 16 rows 91/147, 80/105, 97/122, 78/120. One row streams weights equally fast either way.
AMX_MIN_ROWS = {"bf16": 8, "int8": 8, "int4": 16}
INVARIANT_AMX_MIN_ROWS = {"bf16": 1, "int8": 8, "int4": 1}  # their AMX and AVX-512 sums round differently
AMX_K_MULTIPLE = {"bf16": 32, "int8": 64, "int4": 32}
# Where bf16 dot products win (CpuCapability.bf16_dots_win), weights from DOTS_MIN_ROWS rows take gemm.c's
# `vdpbf16ps` loop ("dots"), codes (int8, Q8_0, int4, GGUF's nibble formats) widened to a bf16 panel per call. The
# AMD Zen 4 machine, 1 thread, GFLOP/s loops / dots / oneDNN bf16 on the plain weight, SmolLM2-360M's bf16 qkv, o,
# gate_up, down: at 1 row 69/64/24, 62/57/22, 64/68/26, 77/69/26; at 2 rows 97/124/47, 90/114/43, 103/129/48,
# 105/137/54; at 32 114/228/186, 113/225/179, 110/223/160, 114/231/189; at 512 112/223/219, 112/227/218,
# 112/220/207, 112/228/216. Loops / dots for Gemma 3's Q5_0 / Q4_K / Q5_0 / Q6_K qkv, o, gate_up, down at 7 rows
# 62/93, 118/104, 64/97, 63/88; at 64 147/197, 165/203, 148/199, 107/196; at 512 143/219, 159/224, 143/218, 106/220.
# The same int8 projections: at 12 rows 161/139, 158/136, 164/140, 165/141; at 16 140/154, 138/151, 142/154,
# 143/157; at 512 161/223, 162/223, 161/220, 164/223 (oneDNN on the dequantized bf16 weight 197, 202, 194, 200).
DOTS_MIN_ROWS = {"bf16": 2, "int8": 16, "int4": 16}


class GemmPolicy:
    """Which kernel of kernels/gemm.c multiplies how many rows, on a CPU with or without usable
    AMX tiles; `invariant`: each row's product the same bits at any row count."""

    def __init__(self, amx: bool, invariant: bool, bf16_dots: bool = False):
        """bf16_dots: gemm.c's bf16 dot products outrun the loops from DOTS_MIN_ROWS rows (no AMX)."""
        self.amx, self.invariant, self.bf16_dots = amx, invariant, bf16_dots
        self.amx_min_rows = INVARIANT_AMX_MIN_ROWS if invariant else AMX_MIN_ROWS

    def kernel(self, fmt: str, rows: int, k: int) -> str | None:
        """For `rows` rows times a packed `fmt` weight ("bf16", "int8", "int4") of K input
        features: "amx", "amx_widened" (int8 codes as bf16 tiles), "dots" (bf16 dot products; codes widened
        to bf16 for them), "avx512", or None when a torch path is faster (never when invariant)."""
        if self.amx_serves(fmt, rows) and k % AMX_K_MULTIPLE[fmt] == 0:
            widen = fmt == "int8" and not self.invariant and rows >= INT8_WIDEN_MIN_ROWS
            return "amx_widened" if widen else "amx"
        if self.dots_serve(fmt, rows):
            return "dots"
        if self.invariant or rows < self.native_max_rows(fmt):
            return "avx512"
        return None

    def native_max_rows(self, fmt: str) -> float:
        """Without AMX, from how many rows a torch GEMM beats the loops on `fmt` weights."""
        if self.bf16_dots:
            return math.inf
        return NATIVE_MAX_ROWS if fmt == "bf16" else UPCAST_MIN_ROWS

    def amx_serves(self, fmt: str, rows: int) -> bool:
        """Whether the AMX kernels take `rows` rows of `fmt` weights whose K they can tile."""
        return self.amx and rows >= self.amx_min_rows[fmt]

    def dots_serve(self, fmt: str, rows: int) -> bool:
        """Whether `rows` rows of `fmt` weights take the bf16 dot products (never when invariant)."""
        return self.bf16_dots and rows >= DOTS_MIN_ROWS[fmt] and not self.invariant

    def stack_kernel(self, fmt: str, rows: int) -> int:
        """The decode stack's code for `fmt`'s kernel at `rows` tokens (decoder_layer.c: 0 the loops, 1 AMX
        tiles where K tiles, 2 the dot products)."""
        return 2 if self.dots_serve(fmt, rows) else int(self.amx_serves(fmt, rows))

    def decode_stack_max_tokens(self) -> int | None:
        """Decode batches from this many tokens leave the fused stack: without AMX the AVX-512
        GEMMs lose to the fp32 upcast there, unless invariance keeps them (None: every size)."""
        return None if self.amx or self.invariant or self.bf16_dots else UPCAST_MIN_ROWS


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, upcast: bool) -> torch.Tensor:
    """F.linear, in float32 for large bf16 batches where `upcast` (CPUs without AMX)."""
    if upcast and x.dtype == torch.bfloat16 and x.shape[0] >= UPCAST_MIN_ROWS:
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


class OneDnnBf16(LinearMethod):
    """bf16 weights without the native GEMM: oneDNN's packed layout for small batches."""

    name = "onednn-bf16"

    def __init__(self, upcast: bool):
        self.upcast = upcast

    def create(self, layer: Linear) -> None:
        layer.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < UPCAST_MIN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
        return dense_linear(x, layer.weight, layer.bias, self.upcast)


class Upcast(LinearMethod):
    """bf16 weights where oneDNN cannot pack them: F.linear, in float32 for large batches without AMX."""

    name = "dense"

    def __init__(self, upcast: bool):
        self.upcast = upcast

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, layer.weight, layer.bias, self.upcast)


class NativeBf16(LinearMethod):
    """bf16 weights packed for kernels/gemm.c; the plain weight stays for the rows it does not serve."""

    name = "native-bf16"

    def __init__(self, policy: GemmPolicy, upcast: bool, activations: bool = True):
        """activations: gemm.c's silu_and_mul runs in this build (not AVX2's: torch's ops follow its GEMM)."""
        self.policy, self.upcast, self.activations = policy, upcast, activations

    def create(self, layer: Linear) -> None:
        layer.register_buffer("packed", pack_columns(layer.weight.detach()))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        kernel = self.policy.kernel("bf16", x.shape[0], layer.in_features) if x.dtype == torch.bfloat16 else None
        if kernel is None:
            return dense_linear(x, layer.weight, layer.bias, self.upcast)
        out = native_matmul(x, layer.packed, kernel=kernel)
        return out if layer.bias is None else out.add_(layer.bias)

    def fused_silu(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        if x.dtype != torch.bfloat16 or not self.activations:
            return None
        if (layer.bias is None and layer.out_features % 32 == 0
                and self.policy.kernel("bf16", x.shape[0], layer.in_features) == "amx"):
            return native_matmul(x, layer.packed, kernel="amx", silu=True)
        return native_silu_and_mul(self.apply(layer, x))

    def weight_struct(self, layer: Linear, lib: abi.Kernels) -> abi.Weight:
        return abi.Weight(kind=lib.weight_kind_bf16, weight=layer.packed.data_ptr(), n=layer.out_features)


class NativeCodes:
    """Mixed into a format's torch method: its codes also packed for kernels/gemm.c."""

    policy: GemmPolicy
    layout: str  # the GemmPolicy's name for the packed codes: "int8" or "int4"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        kernel = self._kernel(layer, x)
        if kernel is None:
            return super().apply(layer, x)
        out = self.native_mm(layer, x, kernel)
        return out if layer.bias is None else out + layer.bias

    def fused_silu(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        kernel = self._kernel(layer, x)
        if kernel is None:
            return None
        if kernel.startswith("amx") and layer.bias is None and layer.packed.shape[0] % 2 == 0:
            return self.native_mm(layer, x, kernel, silu=True)
        return native_silu_and_mul(self.apply(layer, x))

    def _kernel(self, layer: Linear, x: torch.Tensor) -> str | None:
        return self.policy.kernel(self.layout, x.shape[0], layer.in_features) if x.dtype == torch.bfloat16 else None


class NativeInt8(NativeCodes, Int8):
    """int8 codes multiplied in integer arithmetic against 16-bit fixed-point activations; the
    codes are a second, packed copy."""

    layout = "int8"

    def __init__(self, policy: GemmPolicy):
        self.policy = policy

    def create(self, layer: Linear) -> None:
        super().create(layer)
        layer.register_buffer("packed", pack_quads(layer.qweight))
        layer.register_buffer("scale_f32", layer.scale.float())

    def native_mm(self, layer: Linear, x: torch.Tensor, kernel: str, silu: bool = False) -> torch.Tensor:
        return native_matmul(x, layer.packed, layer.scale_f32, kernel=kernel, silu=silu)

    def weight_struct(self, layer: Linear, lib: abi.Kernels) -> abi.Weight:
        return abi.Weight(kind=lib.weight_kind_int8, weight=layer.packed.data_ptr(), scale=layer.scale_f32.data_ptr(),
                          n=layer.out_features)


class NativeNibbles(NativeCodes):
    """Mixed into a method whose layers hold 4-bit codes as `pack_nibbles` lays them out, with the
    buffers `blocks_of` reads: gemm.c's kernels for 4-bit codes (`gemm_blocks*`)."""

    layout = "int4"

    def native_mm(self, layer: Linear, x: torch.Tensor, kernel: str, silu: bool = False) -> torch.Tensor:
        return native_matmul(x, layer.packed, kernel=kernel, silu=silu, blocks=blocks_of(layer))

    def weight_struct(self, layer: Linear, lib: abi.Kernels) -> abi.Weight:
        return abi.Weight(kind=lib.weight_kind_blocks, weight=layer.packed.data_ptr(),
                          blocks=ctypes.addressof(blocks_of(layer)), n=layer.out_features)


class NativeInt4(NativeNibbles, Int4):
    """int4 codes on the kernels of GGUF's nibble formats, with the bf16 scales and zero points PyTorch's
    kernel takes (gemm.c's `Blocks.zero`): the same values, 0.625 bytes a weight."""

    def __init__(self, policy: GemmPolicy):
        self.policy = policy

    def create(self, layer: Linear) -> None:
        super().create(layer)
        scale, zero = layer.scales_and_zeros.to(torch.bfloat16).unbind(-1)  # [groups, N]: bf16 models' own values
        by_block = lambda t: t.view(t.shape[0], -1, 16).transpose(0, 1).contiguous()  # noqa: E731
        layer.register_buffer("packed", pack_nibbles(self.codes(layer)))
        layer.register_buffer("packed_scale", by_block(scale))  # [N/16, groups, 16]
        layer.register_buffer("packed_zero", by_block(zero))


def blocks_of(layer: Linear) -> abi.Blocks:
    """The Blocks of a layer's nibbles (`packed_scale`, and GGUF's minimums and planes or int4's zero points),
    built once for where its buffers lie (7 us a call, a quarter of a small projection's; a layer's
    buffers move together, so its codes' address keys them)."""
    at, blocks = layer.__dict__.get("blocks_struct", (None, None))
    if at != layer.packed.data_ptr():
        pointer = lambda name: None if getattr(layer, name, None) is None else getattr(layer, name).data_ptr()  # noqa: E731
        at = layer.packed.data_ptr()
        blocks = abi.Blocks(*(pointer("packed_" + f) for f in ("scale", "low", "high", "sixth", "group", "zero")))
        layer.__dict__["blocks_struct"] = at, blocks
    return blocks


def native_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused projection's bf16 output [M, 2I], rounded as the AMX kernels'
    fused epilogue rounds (kernels/gemm.c), so that a token's activation is the same bits
    whichever kernel its step's row count picked."""
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    act = gate_up.new_empty(tokens, width)
    abi.kernels().silu_and_mul_bf16(gate_up.contiguous().data_ptr(), act.data_ptr(), tokens, width, abi.threads())
    return act


def native_fits(layer: Linear, fmt: str | None) -> bool:
    """Whether kernels/gemm.c can tile `layer` in format `fmt` (None: bf16 as loaded): a bf16
    CPU weight, N a multiple of 16, K of 2 (int8: of 4, for its quads)."""
    n, k = layer.out_features, layer.in_features
    return (layer.weight.dtype == torch.bfloat16 and layer.weight.device.type == "cpu" and n % 16 == 0
            and k % (4 if fmt == "int8" else 2) == 0)


def pack_columns(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/2, 16, 2]: each pair of K steps of 16 output columns contiguous (gemm.c)."""
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()


NIBBLE_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the K steps of a column's dword of codes, low nibbles first


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] 4-bit codes (uint8) -> [N/16, K/8, 16, 4] bytes: eight K steps per column's dword,
    nibbles in NIBBLE_ORDER (kernels/gemm.c's int4 layout)."""
    n, k = codes.shape
    steps = codes.view(n // 16, 16, k // 8, 8)[..., NIBBLE_ORDER]
    return (steps[..., 0::2] | (steps[..., 1::2] << 4)).transpose(1, 2).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`pack_nibbles` undone, for blocks of any number of columns C: [B, K/8, C, 4] -> [B * C, K] codes."""
    blocks, steps, columns = packed.shape[:3]
    bytes_ = packed.transpose(1, 2)
    ordered = torch.stack([bytes_ & 15, bytes_ >> 4], dim=-1).flatten(-2)
    return ordered[..., [NIBBLE_ORDER.index(i) for i in range(8)]].reshape(blocks * columns, steps * 8)


def pack_quads(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 -> [N/16, K/4, 16, 4]: quads of K steps of 16 output columns, each in the order
    k0 k2 k1 k3 (kernels/gemm.c)."""
    n, k = codes.shape
    return codes.view(n // 16, 16, k // 4, 4)[..., [0, 2, 1, 3]].transpose(1, 2).contiguous()


def unpack_quads(packed: torch.Tensor) -> torch.Tensor:
    """`pack_quads` undone (its order is its own inverse), for blocks of C columns: [B, K/4, C, 4] -> [B * C, K]."""
    blocks, steps, columns = packed.shape[:3]
    return packed.transpose(1, 2)[..., [0, 2, 1, 3]].reshape(blocks * columns, steps * 4)


def native_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor | None = None, kernel: str = "avx512",
                  silu: bool = False, blocks: abi.Blocks | None = None) -> torch.Tensor:
    """x [M, K] bf16 times a packed weight, transposed: [M, N] bf16, on `kernel` ("avx512", "amx"
    or, for int8, "amx_widened"; for 4-bit codes, "dots": see `GemmPolicy`). The weight is bf16 (`pack_columns`), int8
    codes with a float32 `scale` per output column (`pack_quads`), int8 codes with a float16 scale per group (GGUF's
    Q8_0 repacked), or 4-bit codes (int4, GGUF's other formats repacked on nibbles) as `blocks` describes them
    (gguf_repack.py). With `silu` (AMX only) the weight is a fused [gate; up]
    projection and the result silu(gate) * up, [M, N/2]."""
    x = x.contiguous()
    columns, k = packed.shape[0] * 16, x.shape[1]
    out = x.new_empty(x.shape[0], columns // 2 if silu else columns)
    lib = abi.kernels()
    args = (out.data_ptr(), x.shape[0], columns, k, abi.threads())
    suffix = ("" if kernel == "avx512" else "_" + kernel) + ("_silu" if silu else "")
    if packed.dtype == torch.bfloat16:
        status = getattr(lib, "gemm_bf16" + suffix)(x.data_ptr(), packed.data_ptr(), *args)
    elif blocks is not None:
        status = getattr(lib, "gemm_blocks" + suffix)(x.data_ptr(), packed.data_ptr(), blocks, *args)
    elif scale.dtype == torch.float16:  # GGUF's Q8_0 repacked (gguf_linear.py)
        status = getattr(lib, "gemm_q8" + suffix)(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), *args)
    else:
        status = getattr(lib, "gemm_int8" + suffix)(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), *args)
    if status != 0:  # shapes were checked when packing; what is left is a failed allocation
        raise MemoryError(f"native GEMM could not allocate its copy of the {x.shape[0]}x{k} input")
    return out
