"""The C boundary of the CPU backend: every kernel entry point with its ctypes signature, every
struct a kernel takes mirrored as a ctypes.Structure, and the limits and enums the C code
defines, read from the built library. Each is declared here once.

A call site asks for the kernels of the engine's build and passes arguments:

    lib = abi.kernels()  # None: no native kernels (SLIPSTREAM_NATIVE=0, or no compiler)
    if lib is not None:
        lib.rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, eps, abi.threads())

Pointers pass as ints (`tensor.data_ptr()`) or None; a struct argument as the struct itself.
This module never knows tensors, layers or caches (the callers fill the structs), nor how a
library is built (build.py).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from slipstream.backends.cpu import build

P, I32, I64, F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
STATUS = ctypes.c_int  # 0, or -1 where the kernel declined (shapes beyond it, no memory): the caller falls back


class DecodeBatch(ctypes.Structure):
    """decode_batch.h: a step's decode queries, one per sequence, shared by both attention kernels."""
    _fields_ = [("batch", I64), ("block_tables", P), ("context_lens", P), ("max_blocks", I32), ("threads", I32)]


class PagedAttention(ctypes.Structure):
    """paged_attention.c: one layer's bf16 or float32 cache, its queries' dtype and the attention's shape."""
    _fields_ = [("k_cache", P), ("v_cache", P), ("num_blocks", I64), ("window", I64), ("block_size", I32),
                ("q_heads", I32), ("kv_heads", I32), ("head_dim", I32), ("scale", F32), ("q_float32", I32),
                ("kv_float32", I32)]


class CodeRows(ctypes.Structure):
    """turboquant_attention.c: a TurboQuant K or V cache and its row layout."""
    _fields_ = [("cache", P), ("pieces", P), ("values", P), ("count", I32), ("bytes", I32), ("width", I32)]


class DenseTokens(ctypes.Structure):
    """turboquant_attention.c: the recent/sink window's 16-bit tokens."""
    _fields_ = [("staging_of", P), ("staged_k", P), ("staged_v", P), ("own_k", P), ("own_v", P), ("key_mean", P),
                ("recent", I64), ("sinks", I64), ("bf16", I32)]


class TurboQuantAttention(ctypes.Structure):
    """turboquant_attention.c: one layer's codes, maps in and out of code space, 16-bit tokens, query rows."""
    _fields_ = [("keys", CodeRows), ("values", CodeRows), ("to_keys", P), ("back", P),
                ("dense", ctypes.POINTER(DenseTokens)), ("query_start", P), ("window", I64), ("kv_heads", I32),
                ("group", I32), ("dim", I32), ("block_size", I32), ("scale", F32)]


class TurboQuantEncode(ctypes.Structure):
    """turboquant_encode.c: one call's rows and the quantizer's tables."""
    _fields_ = [("x", P), ("mean", P), ("scale", P), ("order", P), ("group_info", P), ("constants", P),
                ("slots", P), ("cache", P), ("tokens", I64), ("count", I32), ("heads", I32), ("dim", I32),
                ("nbytes", I32), ("threads", I32), ("staged_bf16", I32), ("staged", P), ("staged_tokens", P),
                ("staged_rows", P), ("staged_count", I64)]


class Blocks(ctypes.Structure):
    """gemm.c: 4-bit codes on nibbles, a GGUF format's (backends/cpu/gguf_repack.py) scales and planes or int4's
    bf16 scales and zero points; NULL where the format has none."""
    _fields_ = [("scale", P), ("low", P), ("high", P), ("sixth", P), ("group", P), ("zero", P)]


class Weight(ctypes.Structure):
    """decoder_layer.c: a linear layer's packed weight, of one of the weight kinds."""
    _fields_ = [("kind", I32), ("parts", I32), ("weight", P), ("scale", P), ("blocks", P), ("n", I64)]


class TurboQuantLayer(ctypes.Structure):
    """decoder_layer.c: a layer's TurboQuant cache and the kernels that attend over it and encode into it."""
    _fields_ = [("attention", TurboQuantAttention), ("window", DenseTokens), ("keys", TurboQuantEncode),
                ("values", TurboQuantEncode), ("attend", P), ("encode", P)]


class Layer(ctypes.Structure):
    """decoder_layer.c: one llama-family or Gemma 3 decoder layer bound to its KV cache."""
    _fields_ = [("input_norm", P), ("mlp_norm", P), ("attention_out_norm", P), ("mlp_out_norm", P), ("q_norm", P),
                ("k_norm", P), ("qkv", Weight), ("o", Weight), ("gate_up", Weight), ("down", Weight),
                ("turboquant", ctypes.POINTER(TurboQuantLayer)), ("k_cache", P), ("v_cache", P), ("num_blocks", I64),
                ("window", I64), ("block_size", I32), ("q_heads", I32), ("kv_heads", I32), ("head_dim", I32),
                ("hidden", I32), ("intermediate", I32), ("unit_offset", I32), ("gelu", I32), ("rope", I32),
                ("eps", F32), ("scale", F32)]


class Step(ctypes.Structure):
    """decoder_layer.c: what every layer of a decode step shares."""
    _fields_ = [("tokens", I64), ("slots", P), ("block_tables", P), ("context_lens", P), ("positions", P),
                ("cos", P * 2), ("sin", P * 2), ("max_blocks", I32), ("threads", I32), ("kernel", I32 * 4)]


# each mirror and the kernel that exports its C size (`sizeof_<name>`), checked when a build loads
MIRRORS = {DecodeBatch: "paged_attention", PagedAttention: "paged_attention", CodeRows: "turboquant_attention",
           DenseTokens: "turboquant_attention", TurboQuantAttention: "turboquant_attention",
           TurboQuantEncode: "turboquant_encode", Weight: "decoder_layer", Layer: "decoder_layer",
           Step: "decoder_layer", TurboQuantLayer: "decoder_layer"}


class Function:
    """The declaration of a C function of kernels/<source>.c: argument and result types."""

    def __init__(self, source: str, *argtypes, restype=None):
        self.source, self.argtypes, self.restype = source, list(argtypes), restype


class Constant:
    """The declaration of a `const int32_t` that kernels/<source>.c exports."""

    def __init__(self, source: str):
        self.source = source


class Kernels:
    """One ISA build of the kernels. The class body declares the C side (read it as the header);
    an instance holds each function typed and bound to its library, each constant as an int."""

    # (x, weight, out, rows, dim, eps, threads)
    rms_norm_bf16 = Function("norm", P, P, P, I64, I32, F32, I32)
    # (x, weight, out, rows, dim, eps, offset, threads): scaled by weight + offset in float32, rounded once
    rms_norm_cast_last_bf16 = Function("norm", P, P, P, I64, I32, F32, F32, I32)
    # (q, k, token stride, tokens, q_heads, k_heads, dim, cos [tokens, dim / 2], sin, threads)
    rotary_bf16 = Function("rotary", P, P, I64, I64, I64, I32, I32, I32, P, P, I32)
    # (k, v, k_cache, v_cache, slots, tokens, token stride, heads, dim, num_slots)
    cache_write_bf16 = Function("cache_write", P, P, P, P, P, I64, I64, I32, I32, I64)
    # (layer, batch, q, out)
    paged_decode_attention = Function("paged_attention", ctypes.POINTER(PagedAttention), ctypes.POINTER(DecodeBatch),
                                      P, P, restype=STATUS)
    # (layer, batch: its sequences, with layer.query_start their query rows, q, out)
    turboquant_paged_attention = Function("turboquant_attention", ctypes.POINTER(TurboQuantAttention),
                                           ctypes.POINTER(DecodeBatch), P, P, restype=STATUS)
    # (rows, block table, length, heads, block size, bf16, out [heads, length, width], threads)
    turboquant_expand = Function("turboquant_attention", ctypes.POINTER(CodeRows), P, I64, I32, I32, I32, P, I32,
                                 restype=STATUS)
    # 0 where turboquant_paged_attention serves this layer's shapes and layouts
    turboquant_attention_fits = Function("turboquant_attention", ctypes.POINTER(TurboQuantAttention), restype=STATUS)
    turboquant_encode = Function("turboquant_encode", ctypes.POINTER(TurboQuantEncode), restype=STATUS)
    # 1 where built with a path for this ISA (AVX-512), else 0 and every call but gemm_bf16's returns -1
    gemm_bf16_available = Function("gemm", restype=ctypes.c_int)
    # 1 where gemm_bf16 runs (AVX-512 or AVX2 builds: the AVX2 build has it alone), else 0 and it returns -1
    gemm_bf16_loops_available = Function("gemm", restype=ctypes.c_int)
    # (x, packed w, y, m, n, k, threads); int8 takes its scale after w
    gemm_bf16 = Function("gemm", P, P, P, I64, I64, I64, I32, restype=STATUS)
    gemm_int8 = Function("gemm", P, P, P, P, I64, I64, I64, I32, restype=STATUS)
    # int8 with a float16 scale per group of 32 and column (GGUF's Q8_0 repacked); int4 and GGUF's formats on nibbles
    gemm_q8 = Function("gemm", P, P, P, P, I64, I64, I64, I32, restype=STATUS)
    gemm_blocks = Function("gemm", P, P, ctypes.POINTER(Blocks), P, I64, I64, I64, I32, restype=STATUS)
    # (packed, scale, ids int64, count, n, k, out float32 [count, K]): rows of a gemm_q8 weight; -1: an id outside N
    q8_rows = Function("gemm", P, P, P, I64, I64, I64, P, restype=STATUS)
    # 1 where built with AMX tiles and Linux lets this process use them, else 0 and the _amx calls return -1;
    # the same arguments as above; _silu: the weight is a fused [gate; up] and y [M, N/2] = silu(gate) * up
    gemm_amx_available = Function("gemm", restype=ctypes.c_int)
    gemm_bf16_amx = Function("gemm", P, P, P, I64, I64, I64, I32, restype=STATUS)
    gemm_int8_amx = Function("gemm", P, P, P, P, I64, I64, I64, I32, restype=STATUS)
    gemm_bf16_amx_silu = Function("gemm", P, P, P, I64, I64, I64, I32, restype=STATUS)
    gemm_int8_amx_silu = Function("gemm", P, P, P, P, I64, I64, I64, I32, restype=STATUS)
    gemm_int8_amx_widened = Function("gemm", P, P, P, P, I64, I64, I64, I32, restype=STATUS)
    gemm_int8_amx_widened_silu = Function("gemm", P, P, P, P, I64, I64, I64, I32, restype=STATUS)
    gemm_blocks_amx = Function("gemm", P, P, ctypes.POINTER(Blocks), P, I64, I64, I64, I32, restype=STATUS)
    gemm_blocks_amx_silu = Function("gemm", P, P, ctypes.POINTER(Blocks), P, I64, I64, I64, I32, restype=STATUS)
    # gemm_bf16, gemm_int8, gemm_q8 and gemm_blocks with bf16 dot products on bf16 panels (codes widened to
    # them; -1 where built without AVX512-BF16)
    gemm_bf16_dots = Function("gemm", P, P, P, I64, I64, I64, I32, restype=STATUS)
    gemm_int8_dots = Function("gemm", P, P, P, P, I64, I64, I64, I32, restype=STATUS)
    gemm_q8_dots = Function("gemm", P, P, P, P, I64, I64, I64, I32, restype=STATUS)
    gemm_blocks_dots = Function("gemm", P, P, ctypes.POINTER(Blocks), P, I64, I64, I64, I32, restype=STATUS)
    # (gate_up, act, tokens, width, threads): act [tokens, width] = silu(gate) * up, as the _silu epilogues round;
    # gelu(gate) * up (tanh approximation) rounded alike
    silu_and_mul_bf16 = Function("gemm", P, P, I64, I64, I32, restype=STATUS)
    gelu_tanh_and_mul_bf16 = Function("gemm", P, P, I64, I64, I32, restype=STATUS)
    moe_expert_available = Function("moe_expert", restype=ctypes.c_int)
    moe_expert_amx_available = Function("moe_expert", restype=ctypes.c_int)
    # (x, tokens, weights, m, gate_up, down, out, hidden, intermediate, threads)
    moe_expert_silu = Function("moe_expert", P, P, P, I64, P, P, P, I64, I64, I32, restype=STATUS)
    moe_expert_silu_amx = Function("moe_expert", P, P, P, I64, P, P, P, I64, I64, I32, restype=STATUS)
    # (ggml type id, x float32 [M, K], W's blocks [N, row bytes], y float32, m, n, k, ldy, threads)
    gguf_gemm = Function("gguf_gemm", I32, P, P, P, I64, I64, I64, I64, I32, restype=STATUS)
    # (ggml type id, W's blocks [N, row bytes], out float32 [N, K], n, k, threads)
    gguf_dequantize = Function("gguf_gemm", I32, P, P, I64, I64, I32, restype=STATUS)
    # (flag, seq): publish that this rank's slot holds call `seq`
    shm_publish = Function("shm_sync", P, I64)
    # (flags, stride in int64s, ranks, seq, timeout ns): 0 once every flag reached seq, -1 at the timeout
    shm_wait = Function("shm_sync", P, I32, I32, I64, I64, restype=STATUS)
    # (layers, count, final norm, step, x)
    decoder_layers_decode = Function("decoder_layer", ctypes.POINTER(Layer), I32, P, ctypes.POINTER(Step), P,
                                     restype=STATUS)
    # (layer, batch, slots, q, k, v, q stride, k/v stride, bf16, out): a step of decodes' TurboQuant write and attention
    turboquant_decode_attention = Function("decoder_layer", ctypes.POINTER(TurboQuantLayer),
                                           ctypes.POINTER(DecodeBatch), P, P, P, P, I64, I64, I32, P, restype=STATUS)

    paged_attention_max_group = Constant("paged_attention")
    paged_attention_max_head_dim = Constant("paged_attention")
    paged_attention_max_block = Constant("paged_attention")
    turboquant_row_slack = Constant("turboquant_attention")
    weight_kind_bf16 = Constant("decoder_layer")
    weight_kind_int8 = Constant("decoder_layer")
    weight_kind_blocks = Constant("decoder_layer")
    weight_kind_q8 = Constant("decoder_layer")
    weight_kind_segments = Constant("decoder_layer")

    def __init__(self, isa: str, libraries: dict[str, ctypes.CDLL]):
        self.isa = isa
        for name, declared in vars(Kernels).items():
            if isinstance(declared, Function):
                fn = libraries[declared.source][name]  # a fresh function object: its types are this build's own
                fn.argtypes, fn.restype = declared.argtypes, declared.restype
                setattr(self, name, fn)
            elif isinstance(declared, Constant):
                setattr(self, name, I32.in_dll(libraries[declared.source], name).value)
        for mirror, source in MIRRORS.items():
            size = I32.in_dll(libraries[source], f"sizeof_{mirror.__name__}").value
            if size != ctypes.sizeof(mirror):
                raise RuntimeError(f"abi.{mirror.__name__} is {ctypes.sizeof(mirror)} bytes but {size} in "
                                   f"kernels/{source}.c: update its mirror in backends/cpu/abi.py")


def kernels(isa: str | None = None) -> Kernels | None:
    """The kernels built for `isa` (default: the engine's, SLIPSTREAM_KERNEL_ISA, else native), or
    None when native kernels are off (SLIPSTREAM_NATIVE=0) or could not be built. Raises ValueError
    for an ISA that does not exist or that this CPU cannot execute."""
    if not build.ENABLED:
        return None
    return _kernels(isa or build.ISA)


@functools.cache
def _kernels(isa: str) -> Kernels | None:
    libraries = build.build(isa)
    return None if libraries is None else Kernels(isa, libraries)


def available_isas() -> tuple[str, ...]:
    """The builds this CPU can execute, the native one first (build.ISAS lists them all)."""
    return build.available_isas()


def threads() -> int:
    """Threads for a kernel call: torch's, since kernels and torch share one OpenMP pool."""
    return torch.get_num_threads()
