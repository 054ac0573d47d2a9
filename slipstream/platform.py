"""Which device to run on and which compute dtype it does natively."""
from __future__ import annotations

import functools

import torch

from slipstream.config import DTYPES


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device={name!r} is not a valid torch device; use 'auto', 'cpu' or 'cuda'") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} requested but CUDA is not available")
    return device


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """AMX tiles: the CPUs on which torch's bf16 GEMMs beat fp32.

    AVX512-BF16 alone is not enough: on a Zen 5 core (AVX512-BF16, no AMX) torch 2.13's
    oneDNN bf16 GEMMs measured 0.6-1.0x the speed of fp32 for this engine's shapes.
    """
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
