"""Which device to run on and which compute dtype: the one asked for, or the backend's (`default_dtype`)."""
from __future__ import annotations

import torch

from slipstream.backends.base import Backend
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


def resolve_dtype(name: str, backend: Backend) -> torch.dtype:
    return DTYPES[name] if name != "auto" else backend.default_dtype
