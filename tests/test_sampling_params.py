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
