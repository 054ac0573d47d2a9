"""Tiny, huge and denormal values of every numeric request field: a 400 naming the field, or a sensible completion.

"Sensible" is what the value means at its limit, checked against a request that states
the limit: a temperature that rounds to 0 in float32 decodes greedily, a top_p that rounds
to 0 keeps the most likely token (greedy again), a min_p, penalty or bias that rounds to 0
changes nothing; a temperature beyond float32 draws near-uniformly; a top_k beyond the
vocabulary keeps every token; a huge seed is still a seed. Such a value was once sampled
as NaN, which decodes token 0 at every step. An accepted value with no rule here fails.
"""
from __future__ import annotations

import json

import pytest

from tests.server.conftest import TINY_MAX_LEN

TINY = ["5e-324", "1e-310", "1e-300", "1e-45", "1e-38", "-1e-300"]  # denormal in float64, float32, or 0 there
HUGE = ["1e300", "1.7976931348623157e308", "-1e300", "1e400", str(10**20), str(-10**20), str(2**64), "0.0"]
BASE = {"prompt": list(range(3, 12)), "max_tokens": 12, "ignore_eos": True, "temperature": 1.0, "seed": 11,
        "logprobs": 0}
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "logit_bias"]
INT_FIELDS = ["top_k", "seed", "n", "max_tokens", "min_tokens", "logprobs"]


@pytest.fixture(scope="module")
def client(tiny_server):
    with tiny_server.client() as c:
        yield c


def post(client, fields: dict, raw: tuple[str, str] | None = None):
    """A completion with BASE + fields; `raw` = (field, JSON text) is spliced in verbatim (1e400, 5e-324)."""
    body = {**BASE, **fields}
    if raw is None:
        return client.post("/v1/completions", json=body)
    field, value = raw
    body.pop(field, None)
    text = json.dumps(body)[:-1] + f', "{field}": ' + (f'{{"5": {value}}}' if field == "logit_bias" else value) + "}"
    return client.post("/v1/completions", content=text, headers={"content-type": "application/json"})


def tokens(response) -> list[list[int]]:
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    return [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] for c in choices]


_references: dict[str, list[list[int]]] = {}  # the server is seeded and the same for every test here


def reference_tokens(client, fields: dict) -> list[list[int]]:
    key = json.dumps(fields, sort_keys=True)
    if key not in _references:
        _references[key] = tokens(post(client, fields))
    return _references[key]


def limit_of(field: str, value: float) -> dict | str:
    """What an accepted value means: the fields of an equivalent request, or a property the output must have."""
    if field == "temperature":
        return {"temperature": 0} if value < 1e-5 else "near-uniform"
    if field == "top_p" and value < 1e-5:
        return {"temperature": 0}
    if field in ("min_p", "presence_penalty", "frequency_penalty", "logit_bias") and abs(value) < 1e-5:
        return {field: None}
    if field == "top_k" and value > TINY_MAX_LEN:
        return {"top_k": None}
    if field == "seed":
        return "reproducible"
    return "no rule"


def check(client, field: str, text: str) -> None:
    response = post(client, {}, raw=(field, text))
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["param"] in (field, "prompt") and field in error["message"], error
        return
    value = float(text)
    rule = limit_of(field, value)
    assert rule != "no rule", f"{field}={text} was accepted; what should it mean? {response.text[:300]}"
    [got] = tokens(response)
    assert len(got) == BASE["max_tokens"]
    if rule == "near-uniform":
        assert len(set(got)) > BASE["max_tokens"] // 2, got  # 12 draws from 384 tokens
    elif rule == "reproducible":
        assert tokens(post(client, {}, raw=(field, text))) == [got]
    else:
        reference = {k: v for k, v in rule.items() if v is not None}  # None: the field left out
        assert [got] == reference_tokens(client, reference), (field, text, reference)


@pytest.mark.parametrize("field", FLOAT_FIELDS + INT_FIELDS)
def test_edge_values_are_400_or_sensible(client, field):
    for text in TINY + HUGE:
        check(client, field, text)


def test_greedy_reference_is_not_degenerate(client):
    """The references above mean something: greedy on this prompt is not one token repeated, nor token 0."""
    [greedy] = tokens(post(client, {"temperature": 0}))
    assert len(set(greedy)) > 2 and 0 not in greedy
