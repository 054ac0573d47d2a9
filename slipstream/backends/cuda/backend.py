"""CudaBackend: the reference paths on a CUDA device, until GPU kernels replace them one by one."""
from __future__ import annotations

from slipstream.backends.reference import ReferenceBackend


class CudaBackend(ReferenceBackend):
    name = "cuda"
