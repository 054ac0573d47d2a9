"""SamplingParams: how one request is decoded, with vLLM's names and meanings.

Every field is validated at construction, so a bad value is reported to the caller
with its name, the value received and what is allowed, before it reaches the engine.

No accepted value may break the sampler's float32 arithmetic. A value that underflows
there means its limit: a temperature below 1e-5 is greedy (vLLM's threshold), one beyond
float32's range samples uniformly, a top_p that rounds to 0 keeps the most likely token,
a min_p that rounds to 0 keeps every token. Where the limit is no sensible distribution the
range is narrower than the formula allows: repetition_penalty in [0.01, 100] (beyond it a
seen token's logit is scaled past any real logit, and near 0 or infinity it overflows).
Lists of token ids are kept without duplicates: they are sets, and at most a vocabulary long.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from slipstream.structured.params import StructuredOutputsParams

GREEDY_TEMPERATURE = 1e-5  # below it, sampling is greedy
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # sample only among these
    # output constrained to a JSON schema, regex, choice or grammar (a dict is read as its fields)
    structured_outputs: StructuredOutputsParams | dict | None = None
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = _unique(self.stop_token_ids or [])
        if isinstance(self.allowed_token_ids, list):
            self.allowed_token_ids = _unique(self.allowed_token_ids)
        if self.top_k in (None, -1):
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = _structured(self.structured_outputs)
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(_is_num(self.temperature) and self.temperature >= 0, "temperature", self.temperature, "a number >= 0")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k, "0 or -1 (disabled) or an integer >= 1")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2 <= value <= 2, name, value, "a number in [-2, 2]")
        low, high = REPETITION_PENALTY_RANGE
        _check(_is_num(self.repetition_penalty) and low <= self.repetition_penalty <= high,
               "repetition_penalty", self.repetition_penalty, f"a number in [{low:g}, {high:g}] (1 = no penalty)")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "an integer >= 1 or None")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"an integer <= max_tokens ({self.max_tokens})")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "an integer or None")
        _check(all(isinstance(s, str) and s for s in self.stop_list), "stop", self.stop, "a non-empty string or a list of them")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "a list of non-negative token ids")
        _check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            _is_int(t) and t >= 0 and _is_num(b) and -100 <= b <= 100 for t, b in self.logit_bias.items())),
            "logit_bias", self.logit_bias, "None or a dict of token id -> bias in [-100, 100]")
        _check(self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                                                  and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
               "allowed_token_ids", self.allowed_token_ids, "None or a non-empty list of token ids")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "None, a StructuredOutputsParams or a dict of its fields")
        # both restrict the vocabulary; a grammar step that allows none of the ids would have no token to sample
        _check(not (self.structured_outputs and self.allowed_token_ids), "allowed_token_ids", self.allowed_token_ids,
               "None when structured_outputs is set")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= 20), name, value, "None or an integer in [0, 20]")


def _structured(fields: dict) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except TypeError:
        raise ValueError(f"structured_outputs={fields!r} is invalid; its keys must be among "
                         "json, regex, choice, grammar, json_object") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _unique(values) -> list:
    """The values in their first order, each once (unhashable values are left for _validate to reject)."""
    try:
        return list(dict.fromkeys(values))
    except TypeError:
        return list(values)


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid; it must be {allowed}")
