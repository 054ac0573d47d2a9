"""select_backend: an engine's one backend, chosen at start-up from what its device offers."""
from __future__ import annotations

import torch

from slipstream.backends.base import Backend
from slipstream.backends.cpu.backend import CpuBackend
from slipstream.backends.cpu.capability import CpuCapability
from slipstream.backends.cuda.backend import CudaBackend
from slipstream.backends.reference import ReferenceBackend


def select_backend(device: torch.device) -> Backend:
    if device.type == "cpu":
        return CpuBackend(CpuCapability.detect())
    if device.type == "cuda":
        return CudaBackend(device)
    return ReferenceBackend(device)
