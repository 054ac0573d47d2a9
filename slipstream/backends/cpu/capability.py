"""What this CPU offers the engine: its instruction-set flags, and the native kernels it runs.

Read once per process from /proc/cpuinfo and from the kernel build the engine uses
(build.py, abi.py); the CPU backend decides its paths from this alone, so tests can hand
it a capability of another CPU and check what it would choose. Never decides a path itself.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from slipstream.backends.cpu import abi, build

# flags worth naming at start-up, the most capable first
NOTABLE_FLAGS = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2", "fma")


def usable_flags(flags: frozenset[str], onednn_max_isa: str) -> frozenset[str]:
    """The flags the engine may use: oneDNN's ONEDNN_MAX_CPU_ISA (its cpu_isa names) capped below
    AMX takes the AMX flags away from our kernels too, so that one variable makes an AMX CPU run
    as one without it."""
    isa = onednn_max_isa.upper()
    return flags if isa in ("", "DEFAULT", "ALL") or "AMX" in isa else frozenset(f for f in flags if not f.startswith("amx"))


@dataclass(frozen=True)
class CpuCapability:
    flags: frozenset[str]
    kernels: abi.Kernels | None  # the engine's native kernels, None when off or not built
    isa: str                     # the kernels' build (build.ISAS)
    no_kernels_reason: str = ""
    vendor: str = ""             # /proc/cpuinfo's vendor_id

    @classmethod
    def detect(cls) -> CpuCapability:
        flags = usable_flags(build.cpu_flags(), os.environ.get("ONEDNN_MAX_CPU_ISA", "DEFAULT"))
        if not build.ENABLED:
            return cls(flags, None, build.ISA, "SLIPSTREAM_NATIVE=0", build.cpu_vendor())
        kernels = abi.kernels()
        reason = "" if kernels is not None else f"they did not build with {build.COMPILER!r} (see the warning above)"
        return cls(flags, kernels, build.ISA, reason, build.cpu_vendor())

    @property
    def amx(self) -> bool:
        """oneDNN's bf16 GEMMs run on AMX tiles (torch's own kernels, whatever ours are)."""
        return {"amx_bf16", "amx_tile"} <= self.flags

    @property
    def bf16_arithmetic(self) -> bool:
        """The CPU multiplies bf16 itself (AVX-512 BF16 dot products, AMX tiles)."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def bf16_dots_win(self) -> bool:
        """Without AMX, oneDNN's bf16 GEMMs outrun float32 ones and gemm.c's loops on batches: AMD's
        AVX-512 BF16 (Zen 4 on) issues `vdpbf16ps` as fast as a float32 FMA, for twice the multiply-adds.
        Intel's AVX-512 cores without AMX measured the other way (backends/cpu/linear.py)."""
        return not self.amx and "avx512_bf16" in self.flags and self.vendor == "AuthenticAMD"

    @property
    def onednn_packs_bf16(self) -> bool:
        """oneDNN's packed bf16 linear runs here: torch's weight reorder for it asks for AVX-512 BW, VL and DQ or
        AVX-NE-CONVERT, and raises without them (AVX2 alone: AMD Zen 3)."""
        return {"avx512bw", "avx512vl", "avx512dq"} <= self.flags or "avx_ne_convert" in self.flags

    @property
    def gemm(self) -> bool:
        """kernels/gemm.c has a path for this build (AVX-512)."""
        return self.kernels is not None and self.kernels.gemm_bf16_available() == 1

    @property
    def bf16_loops(self) -> bool:
        """kernels/gemm.c multiplies packed bf16 weights (`gemm_bf16`): every `gemm` build, and AVX2 ones (that
        alone: no codes, no activations, no AMX)."""
        return self.kernels is not None and self.kernels.gemm_bf16_loops_available() == 1

    @property
    def amx_kernels(self) -> bool:
        """kernels/gemm.c and moe_expert.c were built with AMX tiles and Linux lets this process use them."""
        return self.amx and self.kernels is not None and self.kernels.gemm_amx_available() == 1

    @property
    def moe_expert(self) -> bool:
        return self.kernels is not None and self.kernels.moe_expert_available() == 1

    @property
    def level(self) -> str:
        """The best arithmetic the native kernels use: amx, avx512, avx2, generic, or torch (none)."""
        if self.kernels is None:
            return "torch"
        if self.gemm:
            return "amx" if self.amx_kernels else "avx512"
        return "avx2" if self.isa == "x86-64-v3" or "avx2" in self.flags and self.isa == "native" else "generic"

    def summary(self) -> str:
        flags = " ".join(f for f in NOTABLE_FLAGS if f in self.flags) or "none of " + " ".join(NOTABLE_FLAGS)
        kernels = (f"native kernels built for {self.isa} ({build.ISAS[self.isa]})" if self.kernels is not None
                   else f"no native kernels: {self.no_kernels_reason}")
        return f"CPU flags: {flags}; {kernels}"
