"""SpeculativeConfig: `speculative_config` of LLM(...) and `--speculative-config`, vLLM's names, validated.

Owns the parsing and checking of the user's dict; must never know the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # beyond this a verification step is a prefill chunk, and acceptance never reaches it


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram only
    prompt_lookup_max: int = 0  # ngram only
    model: str | None = None  # draft_model: the checkpoint that proposes (the target's tokenizer)
    quantization: str | None = None  # draft_model: its weights' format, as LLM(quantization=...); None as loaded

    @classmethod
    def parse(cls, value: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config={value!r} must be a dict such as "
                             "{'method': 'ngram', 'num_speculative_tokens': 4}")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; allowed: {allowed}")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method={method!r} is not supported; allowed: {list(METHODS)}")
        k = _positive(value, "num_speculative_tokens")
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens={k} is above {MAX_SPECULATIVE_TOKENS}")
        own = {"ngram": ("prompt_lookup_min", "prompt_lookup_max"), "draft_model": ("model", "quantization")}
        for other, keys in own.items():
            misplaced = sorted(set(keys) & set(value)) if other != method else []
            if misplaced:
                raise ValueError(f"speculative_config: {misplaced} belong(s) to method {other!r}, not {method!r}")
        if method == "draft_model":
            return cls(method, k, model=_model(value), quantization=value.get("quantization"))
        # vLLM's defaults: either bound alone sets both; neither gives 5
        lo, hi = (_positive(value, name) if name in value else None for name in ("prompt_lookup_min", "prompt_lookup_max"))
        lo = lo or hi or 5
        hi = hi or lo
        if hi < lo:
            raise ValueError(f"speculative_config: prompt_lookup_max={hi} is below prompt_lookup_min={lo}")
        return cls(method, k, lo, hi)


def _model(value: dict) -> str:
    model = value.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError(f"speculative_config: method 'draft_model' needs 'model', a checkpoint path or "
                         f"registered name; got {model!r}")
    return model


def _positive(value: dict, name: str) -> int:
    n = value.get(name)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"speculative_config: {name}={n!r} must be a positive integer")
    return n
