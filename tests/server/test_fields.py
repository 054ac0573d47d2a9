"""No silent ignores: an undeclared field is a 400 naming it, unless it is on the documented ignored list."""
from __future__ import annotations

import pytest

from slipstream.server.fields import IGNORED
from tests.server.test_errors import assert_error


@pytest.fixture(scope="module")
def client(tiny_server):
    with tiny_server.client() as c:
        yield c


def completion(client, **fields):
    return client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, **fields})


@pytest.mark.parametrize("field,value", [("best_of", 2), ("guided_decoding_backend", "outlines"),
                                         ("functions", [{"name": "f"}]), ("priority", 1)])
def test_unsupported_fields_are_named(client, field, value):
    assert_error(completion(client, **{field: value}), 400, param=field, contains=f"{field}: this field is not")


def test_nested_fields_are_checked(client):
    messages = [{"role": "user", "content": "hi", "audio": {"id": "x"}}]
    response = client.post("/v1/chat/completions", json={"messages": messages})
    assert_error(response, 400, param="messages", contains="messages.0.audio")
    response = completion(client, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert_error(response, 400, param="stream_options", contains="stream_options.continuous_usage_stats")


def test_ignored_fields_and_nulls_are_accepted(client):
    assert completion(client, **{name: "x" for name in IGNORED}).status_code == 200
    assert completion(client, best_of=None, functions=None).status_code == 200


def test_vllm_output_options_are_honoured(client):
    assert completion(client, skip_special_tokens=False, include_stop_str_in_output=True).status_code == 200
