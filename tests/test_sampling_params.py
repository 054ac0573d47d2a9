"""SamplingParams rejects every invalid value with a message naming the field and what is allowed."""
from __future__ import annotations

import pytest

from slipstream import SamplingParams

INVALID = [
    ("temperature", -0.1), ("temperature", "hot"), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("top_k", 1.5), ("min_p", -0.1), ("min_p", 1.1), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0.0), ("max_tokens", 0), ("max_tokens", -5), ("min_tokens", -1), ("n", 0),
    ("seed", 1.5), ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]), ("logprobs", 21),
    ("logprobs", -1), ("prompt_logprobs", 100), ("temperature", float("nan")),
    ("logit_bias", {5: 101}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}), ("logit_bias", [5]),
    ("allowed_token_ids", []), ("allowed_token_ids", [1, -2]), ("allowed_token_ids", 7),
    ("temperature", float("inf")), ("top_p", -1e-300), ("repetition_penalty", 1e-308),
    ("repetition_penalty", 0.009), ("repetition_penalty", 101), ("repetition_penalty", float("inf")),
    ("presence_penalty", float("-inf")),
]


@pytest.mark.parametrize("field,value", INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_values_raise_clear_errors(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert field in str(e.value) and "must be" in str(e.value)


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens=9 .* <= max_tokens \\(4\\)"):
        SamplingParams(min_tokens=9, max_tokens=4)


def test_defaults_and_normalisation():
    p = SamplingParams(top_k=-1, stop="###")
    assert p.top_k == 0 and p.stop_list == ["###"] and p.stop_token_ids == []
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("temperature,greedy", [(0, True), (5e-324, True), (1e-300, True), (9.99e-6, True),
                                                (1e-5, False), (0.7, False), (1e300, False)])
def test_temperature_below_1e_5_is_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_token_id_lists_are_sets():
    p = SamplingParams(stop_token_ids=[5, 3, 5, 5], allowed_token_ids=[7, 7, 1])
    assert p.stop_token_ids == [5, 3] and p.allowed_token_ids == [7, 1]
