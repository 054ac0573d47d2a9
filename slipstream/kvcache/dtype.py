"""`kv_cache_dtype`: how K/V are stored, parsed from its user-facing name.

auto (the model dtype), bfloat16, float32, fp8 (float8_e4m3), and TurboQuant:
tq4, tq3.5, tq3, tq2.5, tq2 (keys and values both compressed; keys with TurboQuant_mse,
the measured better choice), or the same with `-qjl` (keys with TurboQuant_prod:
(b-1)-bit codes + 1-bit QJL residual). Values always use TurboQuant_mse.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DENSE = {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8": torch.float8_e4m3fn}
TQ_BITS = {"tq4": 4, "tq3.5": 3.5, "tq3": 3, "tq2.5": 2.5, "tq2": 2}
ALLOWED = ["auto", *DENSE, *TQ_BITS, *(f"{name}-qjl" for name in TQ_BITS)]


@dataclass(frozen=True)
class KVCacheDtype:
    name: str
    dense: torch.dtype | None = None  # storage dtype of a dense cache
    bits: float | None = None         # TurboQuant bits per coordinate
    key_mode: str = "mse"

    @property
    def is_turboquant(self) -> bool:
        return self.bits is not None


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> KVCacheDtype:
    if name == "auto":
        return KVCacheDtype(name, dense=model_dtype)
    if name in DENSE:
        return KVCacheDtype(name, dense=DENSE[name])
    base, qjl = (name[:-4], True) if name.endswith("-qjl") else (name, False)
    if base in TQ_BITS:
        return KVCacheDtype(name, bits=TQ_BITS[base], key_mode="prod" if qjl else "mse")
    raise ValueError(f"kv_cache_dtype={name!r} is not supported; allowed: {', '.join(ALLOWED)}")
