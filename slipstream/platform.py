"""Which device to run on and which compute dtype it does natively."""
from __future__ import annotations

import torch

from slipstream.backends.cpu.build import cpu_flags
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


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # AVX512-BF16 or AMX: native bf16 arithmetic, so decode reads half the bytes of fp32
    return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & cpu_flags() else torch.float32
