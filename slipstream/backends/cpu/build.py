"""Native CPU kernels: small C files compiled on first use by the system C compiler, called via ctypes.

Why C through ctypes rather than a torch extension: a C file that includes no torch headers
compiles in about a second, so a fresh machine builds its kernels at first use, for its own
CPU (`-march=native`), with nothing added to the install. Tensors cross the boundary as raw
pointers; the caller checks dtypes, devices and contiguity. OpenMP in the kernels binds to
the `libgomp.so.1` that torch has already loaded, so kernels and torch share one thread pool.

Every kernel has a plain-torch twin that stays the reference its tests compare against.
When no compiler works, or `SLIPSTREAM_NATIVE=0`, `load` returns None and callers take the
torch path.
"""
from __future__ import annotations

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

import torch

logger = logging.getLogger("slipstream")

SOURCE_DIR = Path(__file__).parent / "kernels"
COMPILER = os.environ.get("CC", "cc")
# fast math by parts: not -ffinite-math-only (kernels rely on -inf), and not -ffast-math, whose
# startup code sets flush-to-zero for the whole process when the library loads
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
         "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]


# read once: kernels are looked up on every layer call, and tests switch this attribute
ENABLED = os.environ.get("SLIPSTREAM_NATIVE", "1") != "0"


def enabled() -> bool:
    return ENABLED


def load(name: str) -> ctypes.CDLL | None:
    """The compiled `kernels/<name>.c`, or None when native kernels are off or cannot be built."""
    return _load(name) if enabled() else None


def function(name: str, symbol: str, *argtypes, restype=None):
    """`symbol` from kernels/<name>.c with its C signature set (ctypes then takes plain ints
    for pointers), or None when the kernel is unavailable."""
    return _function(name, symbol, argtypes, restype) if enabled() else None


@functools.cache
def _function(name: str, symbol: str, argtypes: tuple, restype):
    lib = _load(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


@functools.cache
def _load(name: str) -> ctypes.CDLL | None:
    source = SOURCE_DIR / f"{name}.c"
    try:
        target = _cache_dir() / f"{name}-{_fingerprint(source)}.so"
        if not target.exists():
            _compile(source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("native kernel %s not built (%s); using the torch path", name, str(detail).strip()[:500])
        return None


def _fingerprint(source: Path) -> str:
    # -march=native code is only valid on the CPU it was built for
    cpu = platform.machine() + _cpu_model()
    return hashlib.sha256(_text_with_includes(source) + " ".join([COMPILER, *FLAGS, cpu]).encode()).hexdigest()[:16]


def _text_with_includes(source: Path) -> bytes:
    """The source and, recursively, every local file it #includes (a kernel may include others)."""
    text = source.read_bytes()
    return text + b"".join(_text_with_includes(SOURCE_DIR / name.decode()) for name in re.findall(rb'#include "([^"]+)"', text))


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "".join(next((line for line in lines if line.startswith(key)), "") for key in ("model name", "flags"))


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


def _compile(source: Path, target: Path) -> None:
    # build beside the target and rename: concurrent processes never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([COMPILER, *FLAGS, str(source), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# C argument types, for `function`
PTR, I32, I64, F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


def threads() -> int:
    return torch.get_num_threads()
