"""select_backend: an engine's one backend, chosen at start-up from what its device offers."""
from __future__ import annotations

import torch

from slipstream.backends.base import Backend
from slipstream.backends.cpu.backend import CpuBackend
from slipstream.backends.cpu.capability import CpuCapability
from slipstream.backends.cuda.backend import CudaBackend
from slipstream.backends.reference import ReferenceBackend


def select_backend(device: torch.device, deterministic: bool | None = None) -> Backend:
    """deterministic: batch-invariant kernels required (True), not wanted (False), or where free (None)."""
    if device.type == "cpu":
        backend = CpuBackend(CpuCapability.detect(), deterministic)
    else:
        backend = CudaBackend(device) if device.type == "cuda" else ReferenceBackend(device)
    if deterministic and not backend.batch_invariant:
        raise ValueError(f"deterministic=True needs batch-invariant kernels, which backend {backend.name} does not "
                         "have (they are the native CPU kernels of cpu-amx and cpu-avx512)")
    return backend
