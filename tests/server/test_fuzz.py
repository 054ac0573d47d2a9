"""Property: no request body, however malformed, gets a 5xx or breaks the server.

Bodies are valid requests (so that many run all the way through generation and
streaming), valid requests with one field of a random type and value, objects whose known
fields all hold random JSON, or any JSON value at all. Generation is kept short
(max_tokens, min_tokens and n capped) so the fuzz stays fast.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.conftest import TINY_VOCAB

SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
ANY_JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                             max_size=4), max_leaves=12)
TOKEN = st.integers(0, TINY_VOCAB - 1)
SMALL = st.integers(1, 6)
VALID = {  # values the server must accept, so that requests get all the way through generation
    "prompt": st.lists(TOKEN, min_size=1, max_size=12) | st.lists(st.lists(TOKEN, min_size=1, max_size=6),
                                                                   min_size=1, max_size=3),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                "content": st.text(max_size=8)}), min_size=1, max_size=3),
    "max_tokens": SMALL, "max_completion_tokens": SMALL, "n": st.integers(1, 3), "min_tokens": st.integers(0, 1),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "stop": st.text(min_size=1, max_size=3),
    "stop_token_ids": st.lists(TOKEN, max_size=3), "seed": st.integers(0, 2**31), "logprobs": st.integers(0, 5),
    "echo": st.booleans(), "ignore_eos": st.booleans(), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "user": st.text(max_size=4),
    "cache_salt": st.text(max_size=4),
}
FIELD_NAMES = sorted(VALID) + ["top_logprobs", "logit_bias", "allowed_token_ids", "suffix", "add_generation_prompt",
                               "best_of"]


@st.composite
def bodies(draw, model: str, chat: bool = False):
    """A valid body, a valid body with one field of a random type and value, or anything at all."""
    kind = draw(st.sampled_from(["valid", "one wild field", "wild fields", "any JSON"]))
    if kind == "any JSON":
        return draw(ANY_JSON)
    if kind == "wild fields":
        return draw(st.fixed_dictionaries({}, optional={name: ANY_JSON for name in FIELD_NAMES}))
    body = draw(st.fixed_dictionaries({"prompt": VALID["prompt"], "messages": VALID["messages"]},
                                      optional={"model": st.just(model), **{k: v for k, v in VALID.items()
                                                                             if k not in ("prompt", "messages")}}))
    if chat and "logprobs" in body:
        body["logprobs"] = body["logprobs"] > 0  # chat's logprobs is a flag
    if kind == "one wild field":
        body[draw(st.sampled_from(FIELD_NAMES))] = draw(ANY_JSON)
    return body


def capped(body):
    """Keep generation short whatever the fuzzer drew (chat's default max_tokens is the whole context)."""
    if isinstance(body, dict):
        for name, limit in (("max_tokens", 6), ("max_completion_tokens", 6), ("n", 3), ("min_tokens", 6)):
            value = body.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit:
                body[name] = limit
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 4
    return body


@pytest.fixture(scope="module")
def client(tiny_server):
    with tiny_server.client(timeout=60) as c:
        yield c


def check(client, route: str, body) -> None:
    payload = json.dumps(capped(body))  # non-ASCII escaped: lone surrogates travel as a client could send them
    with client.stream("POST", route, content=payload, headers={"content-type": "application/json"}) as response:
        text = response.read().decode()
    event(f"status {response.status_code}")
    assert response.status_code < 500, (body, text)
    if response.status_code != 200:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"}, text
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert text.rstrip().endswith("data: [DONE]"), text
        assert '"error"' not in text, text
    else:
        assert json.loads(text)["choices"], text


SETTINGS = settings(max_examples=100, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@SETTINGS
@given(body=bodies("tiny"))
def test_fuzz_completions(client, body):
    check(client, "/v1/completions", body)


@SETTINGS
@given(body=bodies("tiny", chat=True))
def test_fuzz_chat_completions(client, body):
    check(client, "/v1/chat/completions", body)


def test_server_alive_after_fuzz(client):
    assert client.get("/health").status_code == 200
    response = client.post("/v1/completions", json={"prompt": [4, 5, 6], "max_tokens": 2})
    assert response.status_code == 200
