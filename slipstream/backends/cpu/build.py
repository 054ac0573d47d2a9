"""Building the native CPU kernels: each kernels/<name>.c compiled by the system C compiler into
its own shared library, once per instruction set (ISA) and cached on disk.

Why C through ctypes rather than a torch extension: a C file that includes no torch headers
compiles in seconds, so a machine builds its kernels for its own CPU with nothing added to the
install (`make install` builds them ahead with `python -m slipstream.backends.cpu`; otherwise
they are built at first use). Tensors cross the boundary as raw pointers; the caller checks
dtypes, devices and contiguity. OpenMP in the kernels binds to the `libgomp.so.1` that torch
has already loaded, so kernels and torch share one thread pool.

ISAS are the builds: `native` (-march=native, what the engine uses by default), `x86-64-v3`
(AVX2/FMA) and `x86-64` (baseline: the plain-C paths); `SLIPSTREAM_KERNEL_ISA` picks the
engine's, `available_isas()` says which this CPU can execute, and the tests run every one.
When no compiler works, or `SLIPSTREAM_NATIVE=0`, there are no kernels and callers take the
torch path. This module owns compiling and loading; it never knows a kernel's signature
(abi.py) or when a kernel is worth calling (the callers).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  loaded before any kernel, so that their libgomp.so.1 is torch's

logger = logging.getLogger("slipstream")

SOURCE_DIR = Path(__file__).parent / "kernels"
COMPILER = os.environ.get("CC", "cc")
# fast math by parts: not -ffinite-math-only (kernels rely on -inf), and not -ffast-math, whose
# startup code sets flush-to-zero for the whole process when the library loads
FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
         "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
ISAS = {
    "native": "-march=native",        # every instruction of this CPU (AVX-512, VNNI, ...)
    "x86-64-v3": "-march=x86-64-v3",  # AVX2, FMA, BMI2, F16C, MOVBE: the kernels' AVX2 paths
    "x86-64": "-march=x86-64",        # SSE2 only: the kernels' plain-C paths
}
# what x86-64-v3 adds to the baseline, as /proc/cpuinfo names it (abm: LZCNT, pni: SSE3)
V3_FLAGS = ("cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3",
            "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")

# read once: kernels are looked up on every layer call, and tests switch these attributes
ENABLED = os.environ.get("SLIPSTREAM_NATIVE", "1") != "0"
ISA = os.environ.get("SLIPSTREAM_KERNEL_ISA", "native")


def sources() -> list[str]:
    """The kernels, one library each: every kernels/*.c (a file may #include others)."""
    return sorted(path.stem for path in SOURCE_DIR.glob("*.c"))


def available_isas() -> tuple[str, ...]:
    """The builds this CPU can execute, the native one first."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("native",)
    return ("native", *(("x86-64-v3",) if cpu_flags().issuperset(V3_FLAGS) else ()), "x86-64")


def check_isa(isa: str) -> None:
    if isa not in ISAS:
        raise ValueError(f"kernel ISA {isa!r} (SLIPSTREAM_KERNEL_ISA) is not one of {', '.join(ISAS)}")
    if isa not in available_isas():
        raise ValueError(f"kernel ISA {isa!r} (SLIPSTREAM_KERNEL_ISA) needs instructions this CPU lacks; "
                         f"it runs: {', '.join(available_isas())}")


def build(isa: str) -> dict[str, ctypes.CDLL] | None:
    """Every kernel library for `isa`, compiled where not cached (in parallel), or None when any
    cannot be built (each failure is logged)."""
    check_isa(isa)
    names = sources()
    missing = [name for name in names if not _target(name, isa).exists()]
    if missing:
        logger.info("compiling the %s kernels (once, cached): %s", isa, ", ".join(missing))
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        libraries = dict(zip(names, pool.map(lambda name: library(name, isa), names)))
    if None in libraries.values():
        logger.warning("native kernels for %s not built; using the torch paths", isa)
        return None
    return libraries


@functools.cache
def library(name: str, isa: str) -> ctypes.CDLL | None:
    """kernels/<name>.c built for `isa`, or None (logged) when it cannot be built."""
    try:
        target = _target(name, isa)
        if not target.exists():
            _compile(SOURCE_DIR / f"{name}.c", isa, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("native kernel %s (%s) not built (%s)", name, isa, str(detail).strip()[:500])
        return None


def _target(name: str, isa: str) -> Path:
    return _cache_dir() / f"{name}-{isa}-{_fingerprint(SOURCE_DIR / f'{name}.c', isa)}.so"


def _fingerprint(source: Path, isa: str) -> str:
    # -march=native code is only valid on the CPU it was built for; the other builds run on any CPU of their ISA
    cpu = platform.machine() + (_cpuinfo("model name") + _cpuinfo("flags") if isa == "native" else "")
    flags = " ".join([COMPILER, *FLAGS, ISAS[isa], cpu])
    return hashlib.sha256(_text_with_includes(source) + flags.encode()).hexdigest()[:16]


def _text_with_includes(source: Path) -> bytes:
    """The source and, recursively, every local file it #includes (a kernel may include others)."""
    text = source.read_bytes()
    return text + b"".join(_text_with_includes(SOURCE_DIR / name.decode()) for name in re.findall(rb'#include "([^"]+)"', text))


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags, as /proc/cpuinfo names them (none where it cannot be read)."""
    return frozenset(_cpuinfo("flags").partition(":")[2].split())


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"; "" where it cannot be read)."""
    return _cpuinfo("vendor_id").partition(":")[2].strip()


@functools.cache
def _cpuinfo(key: str) -> str:
    """The first /proc/cpuinfo line starting with `key`, or "" where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() if key == "model name" else ""
    return next((line for line in lines if line.startswith(key)), "")


def _cache_dir() -> Path:
    home = os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")
    for root in (os.environ.get("SLIPSTREAM_CACHE") or Path(home) / "slipstream", tempfile.gettempdir()):
        path = Path(root) / "slipstream-kernels"
        try:
            path.mkdir(parents=True, exist_ok=True)
            return path
        except OSError:  # a read-only home: build under the temp dir instead
            continue
    raise OSError("no writable directory for compiled kernels")


def _compile(source: Path, isa: str, target: Path) -> None:
    # build beside the target and rename: concurrent processes never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [COMPILER, *FLAGS, ISAS[isa], str(source), "-o", tmp, "-lm"]
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: list[str] | None = None) -> int:
    """Compile the kernels ahead of first use (make install). Never fails: without a compiler the
    torch paths run, and this says so."""
    parser = argparse.ArgumentParser(prog="python -m slipstream.backends.cpu", description=main.__doc__)
    parser.add_argument("--isa", action="append", choices=list(ISAS),
                        help="a build to compile (repeatable); default: every one this CPU runs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not ENABLED:
        print("native kernels are off (SLIPSTREAM_NATIVE=0): nothing to build")
        return 0
    for isa in args.isa or available_isas():
        if isa not in available_isas():
            print(f"native kernels for {isa}: skipped, this CPU cannot run them")
            continue
        state = "built" if build(isa) is not None else "NOT built, the torch paths will run"
        print(f"native kernels for {isa}: {state} ({_cache_dir()})")
    return 0
