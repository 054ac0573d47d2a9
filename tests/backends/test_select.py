"""Which backend and which paths a machine gets: the choice follows from the capability alone,
so every CPU kind is tested here by forcing one (flags, and a build that reports which of
its kernels have a path), whatever this machine is."""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from slipstream.backends.cpu.backend import CpuBackend
from slipstream.backends.cpu.build import cpu_flags
from slipstream.backends.cpu.capability import CpuCapability, usable_flags
from slipstream.backends.cpu.linear import DOTS_MIN_ROWS, OneDnnBf16, Upcast
from slipstream.backends.cuda.backend import CudaBackend
from slipstream.backends.reference import ReferenceBackend
from slipstream.backends.select import select_backend

AMX_FLAGS = {"amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx512bw", "avx512vl",
             "avx512dq", "avx2", "fma"}
AVX512_FLAGS = AMX_FLAGS - {"amx_bf16", "amx_int8", "amx_tile"}
NO_BF16 = AVX512_FLAGS - {"avx512_bf16"}  # AVX-512 with VNNI but no bf16 arithmetic (a cpu model 207 here)
AVX2_FLAGS = {"avx2", "fma"}  # no AVX-512 at all (AMD Zen 3 here)


def build(isa: str, gemm: bool, amx: bool, loops: bool | None = None):
    """A kernel build as far as the policy asks it: whether gemm.c / moe_expert.c have a path, with tiles or not,
    and whether gemm.c has the bf16 loops (loops None: with the path; AVX2 builds: alone)."""
    answer = lambda value: (lambda: int(value))  # noqa: E731
    return SimpleNamespace(isa=isa, gemm_bf16_available=answer(gemm), moe_expert_available=answer(gemm),
                           gemm_amx_available=answer(amx), moe_expert_amx_available=answer(amx),
                           gemm_bf16_loops_available=answer(gemm if loops is None else loops))


CASES = {  # capability -> (backend name, what its linear, MoE and decode-stack lines must say)
    "amx": (CpuCapability(AMX_FLAGS, build("native", True, True), "native"),
            "cpu-amx", ["AMX tiles", "AMX tiles for every group", "every all-decode step"]),
    "avx512": (CpuCapability(AVX512_FLAGS, build("native", True, False), "native"),
               "cpu-avx512", ["AVX-512 loops", "float32 FMAs", "every all-decode step"]),
    "avx2": (CpuCapability(AVX512_FLAGS, build("x86-64-v3", False, False, loops=True), "x86-64-v3"),
             "cpu-avx2", ["gemm.c's AVX2 loops below 256 rows", "torch, one expert", "none"]),
    "torch-on-amx": (CpuCapability(AMX_FLAGS, None, "native", "SLIPSTREAM_NATIVE=0"),
                     "cpu-torch", ["oneDNN bf16 (AMX) above", "torch, one expert", "none"]),
    "avx2-only": (CpuCapability(AVX2_FLAGS, build("native", False, False, loops=True), "native"),
                  "cpu-avx2", ["gemm.c's AVX2 loops below 256 rows", "torch, one expert", "none"]),
    "baseline": (CpuCapability(AVX2_FLAGS, build("x86-64", False, False, loops=False), "x86-64"),
                 "cpu-generic", ["bf16 weights on F.linear (oneDNN cannot pack them)", "torch, one expert", "none"]),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_each_cpu_kind_gets_its_paths_and_says_why(kind):
    capability, name, expected = CASES[kind]
    backend = CpuBackend(capability)
    lines = backend.describe()
    assert backend.name == name and lines[0].startswith(f"backend {name}: CPU flags:")
    by_topic = {line.split(":")[0]: line for line in lines[2:]}
    for topic, fragment in zip(["linear", "MoE experts", "decode stack"], expected):
        assert fragment in by_topic[topic], (kind, by_topic[topic])
    # by default invariance where it is free: gemm.c's GEMMs without AMX (its cost on AMX is measured in the README)
    assert backend.batch_invariant == (kind == "avx512")
    assert by_topic["batch invariance"].startswith("batch invariance: " + {"amx": "off: --deterministic",
                                                                            "avx512": "on"}.get(kind, "none"))
    if capability.kernels is None:
        assert "no native kernels: SLIPSTREAM_NATIVE=0" in lines[0]
    # torch's reorder for oneDNN's packed bf16 weights raises without AVX-512 BW/VL/DQ (or AVX-NE-CONVERT)
    assert isinstance(backend.bf16, Upcast if kind in ("avx2-only", "baseline") else OneDnnBf16)
    assert (backend.bf16_loops is not None) == (kind in ("avx2", "avx2-only"))  # AVX2 builds: bf16 weights on them


@pytest.mark.parametrize("kind", ["amx", "avx512"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_chooses_the_invariant_policy_or_the_fastest(kind, deterministic):
    backend = CpuBackend(CASES[kind][0], deterministic)
    lines = {line.split(":")[0]: line for line in backend.describe()}
    assert backend.batch_invariant == backend.policy.invariant == deterministic
    assert lines["batch invariance"].startswith("batch invariance: " + ("on" if deterministic else "off"))
    if kind == "amx":  # tiles from one row for bf16, else the AVX-512 loops below AMX_MIN_ROWS
        assert backend.policy.kernel("bf16", 1, 576) == ("amx" if deterministic else "avx512")
    else:  # the float32 upcast for large batches, unless invariance keeps the loops
        assert backend.policy.kernel("bf16", 512, 576) == ("avx512" if deterministic else None)
        assert ("for every row count" in lines["linear"]) == deterministic


def test_amd_bf16_dot_products_keep_every_row_count_on_gemm_c_and_nothing_upcast():
    """AMD's AVX-512 BF16 (Zen 4) issues bf16 dot products at the float32 FMA's rate: gemm.c's dot products
    (codes widened for them) from DOTS_MIN_ROWS rows of each format, the loops below, never oneDNN or a float32
    upcast, and invariance (which would keep the loops) off by default; an Intel CPU with the same flags,
    or an AMD one without avx512_bf16, keeps the measured Intel policy."""
    amd = CpuCapability(frozenset(AVX512_FLAGS), build("native", True, False), "native", vendor="AuthenticAMD")
    backend = CpuBackend(amd)
    assert amd.bf16_dots_win and not backend.batch_invariant and backend.every_query_native
    policy = backend.policy
    for fmt in ("bf16", "int8", "int4"):
        assert policy.kernel(fmt, DOTS_MIN_ROWS[fmt] - 1, 576) == "avx512"
        assert policy.kernel(fmt, DOTS_MIN_ROWS[fmt], 576) == policy.kernel(fmt, 4096, 576) == "dots"
    assert policy.decode_stack_max_tokens() is None
    assert not backend.native[None].upcast and not backend.experts.upcast and backend.experts.kernel is None
    assert CpuBackend(amd, deterministic=True).experts.kernel == "avx512"
    assert "gemm.c's bf16 dot products" in next(line for line in backend.describe() if line.startswith("linear:"))
    for other in (CpuCapability(frozenset(AVX512_FLAGS), amd.kernels, "native", vendor="GenuineIntel"),
                  CpuCapability(frozenset(NO_BF16), amd.kernels, "native", vendor="AuthenticAMD")):
        assert not other.bf16_dots_win and CpuBackend(other).policy.kernel("bf16", 128, 576) == "avx512"
    assert CpuBackend(amd, deterministic=True).policy.kernel("bf16", 4096, 576) == "avx512"


@pytest.mark.parametrize("kind", ["avx2", "torch-on-amx"])
def test_deterministic_true_is_refused_where_no_kernel_is_invariant(kind, monkeypatch):
    from slipstream.backends import select

    monkeypatch.setattr(select.CpuCapability, "detect", lambda: CASES[kind][0])
    assert not select.select_backend(torch.device("cpu"), None).batch_invariant
    with pytest.raises(ValueError, match=f"deterministic=True needs batch-invariant kernels.*{CASES[kind][1]}"):
        select.select_backend(torch.device("cpu"), True)
    with pytest.raises(ValueError, match="deterministic=True needs batch-invariant kernels.*reference"):
        select.select_backend(torch.device("meta"), True)


@pytest.mark.parametrize("kind", list(CASES))
def test_the_decode_stack_exists_only_where_gemm_c_has_a_path(tiny_llama, kind):
    from slipstream.engine.model_loader import load_model

    capability = CASES[kind][0]
    model = load_model(tiny_llama, torch.float32, ReferenceBackend(torch.device("cpu"))).model
    assert (CpuBackend(capability).decode_stack(model) is not None) == bool(capability.kernels
                                                                           and capability.kernels.gemm_bf16_available())


def test_devices_select_their_backend():
    cpu = select_backend(torch.device("cpu"))
    assert isinstance(cpu, CpuBackend)
    assert cpu.capability.flags == usable_flags(cpu_flags(), os.environ.get("ONEDNN_MAX_CPU_ISA", ""))
    assert isinstance(select_backend(torch.device("cuda")), CudaBackend)  # chosen without touching a GPU
    assert type(select_backend(torch.device("meta"))) is ReferenceBackend


def test_onednn_isa_cap_below_amx_makes_an_amx_cpu_choose_as_one_without(monkeypatch):
    assert usable_flags(AMX_FLAGS, "avx512_core_bf16") == AVX512_FLAGS
    assert usable_flags(AMX_FLAGS, "AVX512_CORE_AMX") == usable_flags(AMX_FLAGS, "DEFAULT") == AMX_FLAGS
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    capability = CpuCapability.detect()
    assert not capability.amx and not capability.amx_kernels
    assert CpuBackend(capability).name != "cpu-amx"


def test_info_prints_the_backend_of_this_machine():
    out = subprocess.run([sys.executable, "-m", "slipstream.cli", "info"], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    backend = CpuBackend(CpuCapability.detect())
    assert backend.describe() == [line for line in lines if not line.startswith(("torch ", "tensor parallel: "))]


@pytest.mark.parametrize("flags,kernels,dtype", [
    (AMX_FLAGS, build("native", True, True), torch.bfloat16),
    (AVX512_FLAGS, None, torch.bfloat16),                       # torch's own bf16 kernels use the dot products
    (NO_BF16, build("native", True, False), torch.bfloat16),    # gemm.c widens bf16 weights in registers
    (NO_BF16, build("x86-64-v3", False, False), torch.float32),
    (NO_BF16, None, torch.float32),
], ids=["amx", "avx512-bf16-torch", "avx512-no-bf16", "avx2-no-bf16", "torch-no-bf16"])
def test_auto_dtype_is_bf16_where_the_cpu_or_gemm_c_computes_it(flags, kernels, dtype):
    from slipstream.platform import resolve_dtype

    backend = CpuBackend(CpuCapability(frozenset(flags), kernels, "native", "" if kernels else "SLIPSTREAM_NATIVE=0"))
    assert resolve_dtype("auto", backend) == backend.default_dtype == dtype
    assert resolve_dtype("float32", backend) == torch.float32
    dtype_line = next(line for line in backend.describe() if line.startswith("dtype auto: "))
    assert dtype_line.startswith("dtype auto: " + str(dtype).removeprefix("torch."))
