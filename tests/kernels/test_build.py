"""Building and selecting the native kernels: one build per ISA, chosen by SLIPSTREAM_KERNEL_ISA;
failures fall back to the torch path, never to an error."""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from slipstream.backends.cpu import abi, build

BASELINE = build.available_isas()[-1]  # x86-64 on x86 machines
needs_compiler = pytest.mark.skipif(shutil.which(build.COMPILER) is None, reason="no C compiler for native kernels")


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path) -> Path:
    """An empty kernel cache, and no library remembered from an earlier build."""
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))
    build.library.cache_clear()
    yield tmp_path / "slipstream-kernels"
    build.library.cache_clear()


def test_a_failing_compiler_means_no_kernels_and_a_warning(fresh_cache, monkeypatch, caplog):
    monkeypatch.setattr(build, "COMPILER", "false")
    with caplog.at_level(logging.WARNING, logger="slipstream"):
        assert build.library("norm", BASELINE) is None
        assert build.build(BASELINE) is None
    assert f"native kernel norm ({BASELINE}) not built" in caplog.text
    assert f"native kernels for {BASELINE} not built; using the torch paths" in caplog.text


def test_kernels_build_into_the_cache_dir_one_file_per_isa(isa, fresh_cache):
    lib = build.library("norm", isa)
    assert lib is not None and hasattr(lib, "rms_norm_bf16")
    assert [p.name.split("-")[0] for p in fresh_cache.iterdir()] == ["norm"]
    assert next(fresh_cache.iterdir()).name.startswith(f"norm-{isa}-")


def test_the_cache_key_holds_the_isa_and_only_the_native_build_holds_the_cpu(monkeypatch):
    source = build.SOURCE_DIR / "norm.c"
    keys = {isa: build._fingerprint(source, isa) for isa in build.ISAS}
    assert len(set(keys.values())) == len(build.ISAS)
    monkeypatch.setattr(build, "_cpuinfo", lambda key: "another cpu")
    assert build._fingerprint(source, "native") != keys["native"]
    assert build._fingerprint(source, "x86-64-v3") == keys["x86-64-v3"]


def test_an_unwritable_cache_dir_falls_back_to_the_temp_dir(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(blocker / "below"))
    assert build._cache_dir() == Path(tempfile.gettempdir()) / "slipstream-kernels"


def test_every_build_loads_every_declared_function_and_constant(isa):
    lib = abi.kernels()
    assert lib.isa == isa
    for name, declared in vars(abi.Kernels).items():
        if isinstance(declared, abi.Function):
            assert tuple(getattr(lib, name).argtypes or ()) == tuple(declared.argtypes), name
        elif isinstance(declared, abi.Constant):
            assert isinstance(getattr(lib, name), int), name


def test_builds_without_avx512_report_no_gemm_and_no_moe_expert(isa):
    """gemm.c and moe_expert.c have AVX-512 paths only, but for gemm_bf16's loops, which AVX2 builds have too: the
    other builds say so and callers keep torch."""
    if isa == "native":
        pytest.skip("whether the native build has AVX-512 depends on the CPU")
    lib = abi.kernels()
    assert lib.gemm_bf16_available() == 0 and lib.moe_expert_available() == 0
    assert lib.gemm_int8(None, None, None, None, 1, 16, 16, 1) == -1
    assert lib.gemm_bf16_loops_available() == (isa == "x86-64-v3")
    if isa == "x86-64":
        assert lib.gemm_bf16(None, None, None, 1, 16, 16, 1) == -1


def test_a_struct_mirror_of_the_wrong_size_is_refused(isa, monkeypatch):
    short_step = type("Step", (ctypes.Structure,), {"_fields_": abi.Step._fields_[:-2]})
    monkeypatch.delitem(abi.MIRRORS, abi.Step)
    monkeypatch.setitem(abi.MIRRORS, short_step, "decoder_layer")
    with pytest.raises(RuntimeError, match=r"abi.Step is \d+ bytes but \d+ in kernels/decoder_layer.c"):
        abi.Kernels(isa, build.build(isa))


def test_the_baseline_always_runs_and_v3_needs_its_cpu_flags(monkeypatch):
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(build, "_cpuinfo", lambda key: "flags\t: " + " ".join(build.V3_FLAGS))
    assert build.available_isas() == ("native", "x86-64-v3", "x86-64")
    monkeypatch.setattr(build, "_cpuinfo", lambda key: "flags\t: " + " ".join(set(build.V3_FLAGS) - {"avx2"}))
    assert build.available_isas() == ("native", "x86-64")
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    assert build.available_isas() == ("native",)


def test_an_unknown_or_unrunnable_isa_is_an_error_naming_the_choices(monkeypatch):
    monkeypatch.setattr(build, "ENABLED", True)  # with kernels off nothing is built, so nothing is checked
    with pytest.raises(ValueError, match=r"ISA 'avx9' \(SLIPSTREAM_KERNEL_ISA\) is not one of native, x86-64-v3"):
        abi.kernels("avx9")
    monkeypatch.setattr(build, "available_isas", lambda: ("native", "x86-64"))
    with pytest.raises(ValueError, match=r"'x86-64-v3' .* needs instructions this CPU lacks; it runs: native, x86-64"):
        build.build("x86-64-v3")


@needs_compiler
@pytest.mark.parametrize("env,expected", [({"SLIPSTREAM_KERNEL_ISA": BASELINE}, BASELINE), ({}, "native"),
                                          ({"SLIPSTREAM_NATIVE": "0", "SLIPSTREAM_KERNEL_ISA": BASELINE}, "None")])
def test_the_environment_selects_the_engine_build(env, expected):
    code = "from slipstream.backends.cpu import abi; lib = abi.kernels(); print(lib and lib.isa)"
    environ = {k: v for k, v in os.environ.items() if k not in ("SLIPSTREAM_KERNEL_ISA", "SLIPSTREAM_NATIVE")}
    done = subprocess.run([sys.executable, "-c", code], env={**environ, **env}, capture_output=True, text=True,
                          check=True)
    assert done.stdout.split()[-1] == expected


@needs_compiler
def test_the_install_step_builds_and_never_fails(fresh_cache, monkeypatch, capsys):
    monkeypatch.setattr(build, "ENABLED", True)
    monkeypatch.setattr(build, "sources", lambda: ["norm", "rotary"])  # two small ones stand for all
    assert build.main(["--isa", BASELINE]) == 0
    assert f"native kernels for {BASELINE}: built" in capsys.readouterr().out
    assert sorted(p.name.split("-")[0] for p in fresh_cache.iterdir()) == ["norm", "rotary"]
    build.library.cache_clear()
    monkeypatch.setattr(build, "COMPILER", "no-such-compiler")
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(fresh_cache.parent / "empty"))
    assert build.main(["--isa", BASELINE]) == 0
    assert f"native kernels for {BASELINE}: NOT built, the torch paths will run" in capsys.readouterr().out
