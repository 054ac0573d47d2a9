"""CpuBackend: the native C kernels where they are built and win, plain torch elsewhere.

Which paths run follows from the CpuCapability alone (flags, kernels built and for which
ISA), so the choice is made once and can be tested for any CPU: attention on bf16 caches and
on TurboQuant codes through the native kernels (backends/cpu/attention.py); bf16, int8 and
int4 weights packed for kernels/gemm.c under one GemmPolicy (backends/cpu/linear.py), which is
batch-invariant by default where that costs nothing (no AMX) and on request (`deterministic`); GGUF
blocks as stored on kernels/gguf_gemm.c (backends/cpu/gguf_linear.py); MoE
experts on kernels/moe_expert.c (backends/cpu/moe.py); the fused decode stack
(backends/cpu/decode_stack.py); otherwise the reference's torch paths.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from slipstream.attention import reference, turboquant
from slipstream.backends.base import AttentionImpl
from slipstream.backends.cpu.attention import (DENSE_DTYPES, dense_attention, dense_decode, dense_prefill,
                                              turboquant_decode, turboquant_decode_step, turboquant_prefill)
from slipstream.backends.cpu.capability import CpuCapability
from slipstream.backends.cpu.decode_stack import DecodeStack
from slipstream.backends.cpu.gguf_linear import (DEQUANTIZE_MIN_ROWS, NativeBlocks, NativeGGUF, NativeQ8, Segmented,
                                                 repackable)
from slipstream.backends.cpu.gguf_repack import REPACKED
from slipstream.backends.cpu.linear import (DOTS_MIN_ROWS, INT8_WIDEN_MIN_ROWS, NATIVE_MAX_ROWS, UPCAST_MIN_ROWS,
                                            GemmPolicy, NativeBf16, NativeInt4, NativeInt8, OneDnnBf16, Upcast,
                                            native_fits)
from slipstream.backends.cpu.moe import UPCAST_MIN_TOKENS, CpuExperts
from slipstream.backends.reference import ReferenceBackend
from slipstream.kvcache.cache import LayerKVCache
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache
from slipstream.layers.linear import Linear, LinearMethod
from slipstream.layers.moe import Experts, ExpertsMethod


class CpuBackend(ReferenceBackend):
    def __init__(self, capability: CpuCapability, deterministic: bool | None = None):
        """deterministic: batch-invariant kernels (True), the fastest (False), or invariant where
        that is free (None: without AMX or AMD's bf16 dot products; with them the fast paths' row-count
        choices win up to 2x)."""
        super().__init__(torch.device("cpu"))
        self.capability = capability
        self.runs_gguf_blocks = capability.kernels is not None
        costly = capability.amx_kernels or capability.bf16_dots_win  # invariance forgoes a faster GEMM
        self.batch_invariant = capability.gemm and (not costly if deterministic is None else deterministic)
        self.policy = GemmPolicy(capability.amx_kernels, self.batch_invariant, capability.bf16_dots_win)
        # float32 GEMMs beat oneDNN's bf16 on large batches, unless AMX or AMD's bf16 dot products serve it
        upcast = not (capability.amx or capability.bf16_dots_win)
        self.native = {None: NativeBf16(self.policy, upcast), "int8": NativeInt8(self.policy),
                       "int4": NativeInt4(self.policy)}
        q8, nibbles = NativeQ8(self.policy, upcast), NativeBlocks(self.policy, upcast)
        self.repacked = {fmt: q8 if fmt == "Q8_0" else nibbles for fmt in REPACKED}
        onednn = torch.backends.mkldnn.is_available() and capability.onednn_packs_bf16
        self.bf16 = OneDnnBf16(upcast) if onednn else Upcast(upcast)
        # AVX2 builds: gemm.c's bf16 loops alone, for the shapes they tile
        self.bf16_loops = (NativeBf16(self.policy, upcast, activations=False)
                           if capability.bf16_loops and not capability.gemm else None)
        # oneDNN's bf16 experts outrun moe_expert.c's float32 FMAs at every group size where bf16 dots win
        # (Mixtral-shaped expert, AMD Zen 4, 1 thread: 56 / 26 GFLOP/s at 8 tokens, 193 / 101 at 256)
        kernel = capability.moe_expert and not (capability.bf16_dots_win and not self.batch_invariant)
        expert_kernel = ("amx" if capability.amx_kernels else "avx512") if kernel else None
        self.experts = CpuExperts(expert_kernel, upcast, self.batch_invariant)

    @property
    def every_query_native(self) -> bool:
        """Prefill queries over a bf16 cache through paged_attention.c too: batch invariance needs it, and
        its AVX-512 build outruns torch's SDPA without AMX (SmolLM2, 512 tokens, AMD Zen 4: ~3 against 5.4
        ms a layer; SDPA on AMX tiles: 3.1-3.5 against 10.4-11.4, README)."""
        return self.batch_invariant or self.capability.gemm and not self.capability.amx_kernels

    @property
    def name(self) -> str:
        return f"cpu-{self.capability.level}"

    @property
    def default_dtype(self) -> torch.dtype:
        return _default_dtype(self.capability)[0]

    def attention(self, cache) -> AttentionImpl:
        if self.capability.kernels is not None:
            if isinstance(cache, TurboQuantLayerCache):
                dense = dense_prefill if self.every_query_native else reference.prefill_attention
                return functools.partial(turboquant.paged_attention, decode_kernel=turboquant_decode,
                                         prefill_kernel=functools.partial(turboquant_prefill, dense=dense),
                                         dense_prefill=dense, decode_step=turboquant_decode_step)
            if isinstance(cache, LayerKVCache) and cache.k.dtype in DENSE_DTYPES:
                if cache.k.dtype == torch.bfloat16 and self.every_query_native:
                    return dense_attention
                return functools.partial(reference.paged_attention, decode_kernel=dense_decode)
        return super().attention(cache)

    def linear_method(self, layer: Linear, fmt: str | None) -> LinearMethod:
        if self.capability.gemm and fmt in self.native and native_fits(layer, fmt):
            return self.native[fmt]
        if self.capability.gemm and fmt == "gguf" and repackable(layer):
            return self.repacked[layer.block_formats[0].name]
        if self.capability.gemm and fmt == "gguf" and len(layer.block_formats) > 1:
            return Segmented(lambda part: self.linear_method(part, "gguf"))
        if fmt is None and layer.weight.dtype == torch.bfloat16:
            return self.bf16_loops if self.bf16_loops is not None and native_fits(layer, fmt) else self.bf16
        if fmt == "gguf" and self.capability.kernels is not None:
            return NativeGGUF(self.capability.kernels)
        return super().linear_method(layer, fmt)

    def experts_method(self, experts: Experts) -> ExpertsMethod:
        return self.experts

    def decode_stack(self, model: nn.Module) -> DecodeStack | None:
        return DecodeStack(model.model.layers, model.model.norm, self.policy) if self.capability.gemm else None

    def invariance_gaps(self, model: nn.Module) -> list[str]:
        native = [*self.native.values(), *self.repacked.values()]  # the methods bound to layers gemm.c tiles
        gaps = [(n, m) for n, m in model.named_modules()  # a Segmented layer's parts are listed themselves
                if isinstance(m, Linear) and m.method not in native and not isinstance(m.method, Segmented)]
        linear = [n for n, m in gaps if not isinstance(m.method, NativeGGUF)]
        blocks = [n for n, m in gaps if isinstance(m.method, NativeGGUF)]
        experts = [n for n, m in model.named_modules() if isinstance(m, Experts) and not self.experts.serves(m)]
        return [f"{what} {_first(names)} ({why})" for what, names, why in (
            ("linear layers", linear, "shapes gemm.c cannot tile"),
            ("GGUF layers", blocks, "rows gemm.c cannot tile by 16; dtype='bfloat16' widens them"),
            ("MoE experts", experts, "moe_expert.c takes SiLU experts of the shapes it tiles")) if names]

    def describe(self) -> list[str]:
        cap, native = self.capability, self.capability.kernels is not None
        prefill = "paged_attention.c for every query" if self.every_query_native else "native decode kernels"
        dtype, why = _default_dtype(cap)
        return [f"backend {self.name}: {cap.summary()}",
                f"dtype auto: {str(dtype).removeprefix('torch.')} ({why})",
                "attention: " + (f"{prefill} on bf16 caches, native decode on float32 ones; TurboQuant codes "
                                 "natively for decode and prefill over a cached prefix; torch for other prefill"
                                 if native else "torch"),
                "linear: " + _linear_policy(cap, self.policy, self.bf16),
                "GGUF weights: " + _gguf_policy(cap, native),
                "MoE experts: " + _experts_policy(self.experts),
                "decode stack: " + (_decode_stack_policy(self.policy) if cap.gemm else "none (the per-layer torch path)"),
                "batch invariance: " + _invariance(cap, self.batch_invariant)]


def _default_dtype(cap: CpuCapability) -> tuple[torch.dtype, str]:
    """bf16 where the CPU multiplies it or gemm.c reads it (widening in registers: decode then reads half
    float32's bytes); float32 where torch alone would emulate bf16 arithmetic. With the reason."""
    if cap.bf16_arithmetic:
        return torch.bfloat16, "the CPU's bf16 arithmetic"
    if cap.gemm:
        return torch.bfloat16, "gemm.c widens bf16 weights in registers; the CPU has no bf16 arithmetic"
    return torch.float32, "no bf16 arithmetic, no native GEMMs"


def _linear_policy(cap: CpuCapability, policy: GemmPolicy, bf16: LinearMethod) -> str:
    if cap.amx_kernels:
        rows = ", ".join(f"{fmt} from {n}" for fmt, n in policy.amx_min_rows.items())
        widened = "" if policy.invariant else f", int8 widened to bf16 tiles from {INT8_WIDEN_MIN_ROWS}"
        return f"packed weights on AMX tiles ({rows} rows{widened}), AVX-512 loops below (kernels/gemm.c)"
    if cap.gemm and policy.invariant:
        return "packed weights on AVX-512 loops (kernels/gemm.c) for every row count"
    if cap.gemm and policy.bf16_dots:
        rows = ", ".join(f"{fmt} from {n}" for fmt, n in DOTS_MIN_ROWS.items())
        return (f"packed weights on gemm.c's bf16 dot products ({rows} rows; codes widened to bf16), AVX-512 "
                "loops below (kernels/gemm.c)")
    if cap.gemm:
        return (f"packed weights on AVX-512 loops (kernels/gemm.c) below {NATIVE_MAX_ROWS} rows in bf16, "
                f"{UPCAST_MIN_ROWS} in int8/int4; float32 GEMMs above")
    if cap.bf16_loops:
        return (f"bf16 weights packed for gemm.c's AVX2 loops below {NATIVE_MAX_ROWS} rows, float32 GEMMs above; "
                "int8/int4 on PyTorch's kernels")
    above = ("oneDNN bf16 (AMX) above" if cap.amx else "oneDNN bf16 (dot products) above" if cap.bf16_dots_win
             else "float32 GEMMs above")
    below = ("oneDNN packed bf16 weights" if isinstance(bf16, OneDnnBf16)
             else "bf16 weights on F.linear (oneDNN cannot pack them)")
    return f"{below} below {UPCAST_MIN_ROWS} rows, {above}; int8/int4 on PyTorch's kernels"


def _gguf_policy(cap: CpuCapability, native: bool) -> str:
    if not native:
        return "as stored, dequantized per call (torch)"
    repacked = ("bf16 models' repacked for gemm.c (and the decode stack): Q4_0/Q4_1 on the int4 kernels above, "
                "Q5_0/Q5_1/Q4_K/Q5_K/Q6_K on them with planes of higher bits and their own scales, Q8_0 on the int8 "
                "loops, a fused layer per format; others " if cap.gemm else "")
    return (f"as stored (quantization='gguf'): {repacked}on kernels/gguf_gemm.c below {DEQUANTIZE_MIN_ROWS} rows, "
            "dequantized tiles on oneDNN above")


def _decode_stack_policy(policy: GemmPolicy) -> str:
    most = policy.decode_stack_max_tokens()
    return "decoder_layer.c for every all-decode step" + ("" if most is None else f" below {most} tokens")


def _invariance(cap: CpuCapability, invariant: bool) -> str:
    if invariant:
        return "on: bf16, int8 and int4 weights on bf16 KV caches (not TurboQuant caches or float32)"
    if cap.gemm:
        return ("off: --deterministic turns it on (one GEMM kernel per layer at every row count, prefill "
                "attention through the decode kernel: 0.5-0.8x prefill, 0.6-0.7x int4 decode on AMX)")
    return "none (PyTorch's GEMMs and SDPA block their sums by shape)"


def _first(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _experts_policy(experts: CpuExperts) -> str:
    if experts.kernel == "amx":
        return "moe_expert.c on AMX tiles for every group"
    if experts.kernel and experts.min_tokens["avx512"] == 1:
        return "moe_expert.c (float32 FMAs) for every group"
    if experts.kernel:
        return f"moe_expert.c (float32 FMAs) for groups from {experts.min_tokens['avx512']} tokens, bf16 torch below"
    return "torch, one expert at a time" + (f", float32 from {UPCAST_MIN_TOKENS} tokens" if experts.upcast else "")
