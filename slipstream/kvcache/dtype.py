"""`kv_cache_dtype`: how K/V are stored, parsed from its user-facing name.

auto (the model dtype), bfloat16, float32, fp8 (float8_e4m3), and TurboQuant:
- tq4, tq3.5, tq3, tq2.5, tq2: that many bits per coordinate on average over keys and values, as
  the measured best split of those bytes (PRESETS: tq3 is 4-bit keys and 2-bit values; README,
  KV-cache dtypes), never more bytes than both sides at that width;
- tq-k{K}v{V} (for example tq-k3v3): keys at K bits and values at V, each from the same list;
- a `-qjl` suffix: keys with TurboQuant_prod ((b-1)-bit codes + 1-bit QJL residual) instead of
  TurboQuant_mse, the measured better choice; values always use TurboQuant_mse;
- a `-codes` suffix: the codes alone. Without it a TurboQuant name also keeps the newest RECENT_TOKENS (112 for
  tq4 and tq3.5, 144 for tq3, 128 for tq2.5, else 64) and the first SINK_TOKENS tokens of each sequence in 16
  bits (its measured best configuration; kvcache/cache.py lengthens the recent part to a sliding window that the
  model's layers keep whole, as Gemma 3's 512); `kv_cache_recent_tokens` / `kv_cache_sink_tokens` override either.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

DENSE = {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8": torch.float8_e4m3fn}
TQ_BITS = {"tq4": 4, "tq3.5": 3.5, "tq3": 3, "tq2.5": 2.5, "tq2": 2}
# (key bits, value bits) of each name: keys carry most of the loss, so where the bytes allow they get more
PRESETS = {"tq4": (4, 4), "tq3.5": (4, 3), "tq3": (4, 2), "tq2.5": (2.5, 2.5), "tq2": (2, 2)}
# Newest tokens kept in 16 bits per name (tq-k{K}v{V}: the default), and first ones: per name the most that keeps
# it within its ratio to bf16's bytes at 8k (3.5x, 4x, 4.5x, 5x), the sinks' block included (kvcache/recent_window.py:
# 112 is 9 staging blocks). 2-bit codes' 1-byte norms (kvcache/turboquant.py) paid for tq3's 144 and tq2.5's 128
# (from 112 and 64): code at 8k +1.41% -> +1.14% (tq3), +3.17% -> +2.00% (tq2.5; docs/kv-cache-dtypes.md).
RECENT_TOKENS = {"tq4": 112, "tq3.5": 112, "tq3": 144, "tq2.5": 128}
DEFAULT_RECENT_TOKENS, SINK_TOKENS = 64, 4
ALLOWED = ["auto", *DENSE, *TQ_BITS, f"tq-k{{K}}v{{V}} (K, V in {', '.join(f'{b:g}' for b in TQ_BITS.values())})",
           "each tq name + '-qjl' and/or '-codes'"]
_SPLIT = re.compile(r"tq-k([0-9.]+)v([0-9.]+)")


@dataclass(frozen=True)
class KVCacheDtype:
    name: str
    dense: torch.dtype | None = None  # storage dtype of a dense cache
    key_bits: float | None = None      # TurboQuant bits per coordinate
    value_bits: float | None = None
    key_mode: str = "mse"
    recent_tokens: int = 0             # the name's defaults for kv_cache_recent_tokens / _sink_tokens
    sink_tokens: int = 0

    @property
    def is_turboquant(self) -> bool:
        return self.key_bits is not None


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> KVCacheDtype:
    if name == "auto":
        return KVCacheDtype(name, dense=model_dtype)
    if name in DENSE:
        return KVCacheDtype(name, dense=DENSE[name])
    base, codes = _strip(name, "-codes")
    base, qjl = _strip(base, "-qjl")
    bits = _bits(base)
    if bits is None:
        raise ValueError(f"kv_cache_dtype={name!r} is not supported; allowed: {', '.join(ALLOWED)}")
    window = (0, 0) if codes else (RECENT_TOKENS.get(base, DEFAULT_RECENT_TOKENS), SINK_TOKENS)
    return KVCacheDtype(name, key_bits=bits[0], value_bits=bits[1], key_mode="prod" if qjl else "mse",
                        recent_tokens=window[0], sink_tokens=window[1])


def _strip(name: str, suffix: str) -> tuple[str, bool]:
    return (name[:-len(suffix)], True) if name.endswith(suffix) else (name, False)


def _bits(base: str) -> tuple[float, float] | None:
    if base in PRESETS:
        return PRESETS[base]
    split = _SPLIT.fullmatch(base)
    if split is None or not all(f"tq{b}" in TQ_BITS for b in split.groups()):
        return None
    return TQ_BITS[f"tq{split[1]}"], TQ_BITS[f"tq{split[2]}"]
