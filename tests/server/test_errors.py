"""Every error class: status code, OpenAI's error JSON, the field named; API key enforcement."""
from __future__ import annotations

import json

import httpx
import pytest

from slipstream.server.auth import API_KEY_ENV, resolve_api_key
from tests.server.conftest import API_KEY, TINY_MAX_LEN, metric

ROUTES = [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/no/such/route")]


def assert_error(response: httpx.Response, status: int, param: str | None = "__any__", contains: str = "") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param != "__any__":
        assert error["param"] == param, error
    assert contains in error["message"], error
    return error


@pytest.fixture(scope="module")
def client(tiny_server):
    with tiny_server.client() as c:
        yield c


def completion(client, **fields) -> httpx.Response:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, **fields}
    # json.dumps escapes non-ASCII, so a lone surrogate travels as "\ud800", as a client could send it
    return client.post("/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})


# --- API key -----------------------------------------------------------------------------
def test_health_needs_no_key(tiny_server):
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200
    head = httpx.head(f"{tiny_server.url}/health")  # load balancers probe with HEAD
    assert head.status_code == 200 and head.content == b""


@pytest.mark.parametrize("method,path", ROUTES)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}],
                         ids=["missing", "wrong", "no-bearer"])
def test_every_route_but_health_needs_the_key(tiny_server, method, path, headers):
    response = httpx.request(method, tiny_server.url + path, headers=headers, json={"prompt": [1], "tokens": [1]})
    error = assert_error(response, 401, contains="API key")
    assert error["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"].startswith('Bearer realm="slipstream"')


def test_right_key_is_accepted(client):
    assert client.get("/v1/models").status_code == 200


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "beaRer"])
def test_bearer_is_case_insensitive(tiny_server, scheme):
    response = httpx.get(f"{tiny_server.url}/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
    assert response.status_code == 200, response.text


def test_key_from_the_environment_is_not_on_the_command_line(tiny_server):
    with open(f"/proc/{tiny_server.process.pid}/cmdline", "rb") as f:
        assert API_KEY.encode() not in f.read()  # conftest passes it as SLIPSTREAM_API_KEY


def test_key_resolution(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(None) == "from-env" and resolve_api_key("from-flag") == "from-flag"
    monkeypatch.setenv(API_KEY_ENV, " ")
    with pytest.raises(ValueError, match=f"{API_KEY_ENV} is set but empty"):
        resolve_api_key(None)
    monkeypatch.delenv(API_KEY_ENV)
    assert resolve_api_key(None) is None


# --- routes and methods ------------------------------------------------------------------
def test_unknown_route_is_404(client):
    assert_error(client.post("/v1/nothing", json={}), 404, contains="/v1/nothing")


def test_wrong_method_is_405(client):
    response = client.get("/v1/completions")
    assert_error(response, 405, contains="GET")
    assert response.headers["allow"] == "POST"


# --- invalid parameters --------------------------------------------------------------------
INVALID = [  # field, value, the param the error must name
    ("temperature", -0.5, "temperature"),
    ("temperature", "hot", "temperature"),
    ("top_p", 0, "top_p"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -7, "top_k"),
    ("min_p", 2, "min_p"),
    ("presence_penalty", 2.5, "presence_penalty"),
    ("frequency_penalty", -3, "frequency_penalty"),
    ("repetition_penalty", 0, "repetition_penalty"),
    ("n", 0, "n"),
    ("n", 129, "n"),
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", 1.5, "max_tokens"),
    ("min_tokens", -1, "min_tokens"),
    ("logprobs", 21, "logprobs"),
    ("stop", "", "stop"),
    ("stop", [1, 2], "stop"),
    ("stop_token_ids", [-1], "stop_token_ids"),
    ("stop_token_ids", [10**6], "stop_token_ids"),
    ("seed", "x", "seed"),
    ("stream", "sometimes", "stream"),
    ("stream_options", 3, "stream_options"),
    ("echo", [], "echo"),
    ("logit_bias", {"5": 101}, "logit_bias"),
    ("logit_bias", {"five": 1}, "logit_bias"),
    ("logit_bias", {"1000000": 1}, "logit_bias"),
    ("logit_bias", {"5": "up"}, "logit_bias"),
    ("allowed_token_ids", [], "allowed_token_ids"),
    ("allowed_token_ids", [3, 10**6], "allowed_token_ids"),
    ("suffix", "tail", "suffix"),
    ("cache_salt", 7, "cache_salt"),
    ("model", 7, "model"),
    ("prompt", "a\ud800", "prompt"),
    ("prompt", [1, "two"], "prompt"),
    ("prompt", [], "prompt"),
    ("prompt", [[]], "prompt"),
    ("prompt", [-1], "prompt"),
    ("prompt", [10**6], "prompt"),
    ("prompt", None, "prompt"),
]


@pytest.mark.parametrize("field,value,param", INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_invalid_parameter_is_400_naming_the_field(client, field, value, param):
    assert_error(completion(client, **{field: value}), 400, param=param, contains=param)


def test_min_tokens_above_max_tokens(client):
    assert_error(completion(client, min_tokens=5, max_tokens=2), 400, param="min_tokens", contains="max_tokens (2)")


def test_prompt_longer_than_the_model_is_400_naming_the_limit(client):
    error = assert_error(completion(client, prompt=[3] * TINY_MAX_LEN), 400, param="prompt")
    assert f"{TINY_MAX_LEN} tokens" in error["message"] and f"max_model_len is {TINY_MAX_LEN}" in error["message"]


def test_prompt_plus_max_tokens_over_the_limit_is_400(client):
    error = assert_error(completion(client, prompt=[3] * 100, max_tokens=TINY_MAX_LEN), 400)
    for number in ("100", str(TINY_MAX_LEN), f"max_model_len ({TINY_MAX_LEN})"):
        assert number in error["message"]


def test_unknown_model_is_400(client):
    error = assert_error(completion(client, model="gpt-17"), 400, param="model", contains="'gpt-17'")
    assert error["code"] == "model_not_found" and "'tiny'" in error["message"]


@pytest.mark.parametrize("body", ["{not json", "[1, 2]", "", "null", '"prompt"'])
def test_malformed_body_is_400(client, body):
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(response, 400)


def test_missing_prompt_is_400(client):
    assert_error(client.post("/v1/completions", json={"max_tokens": 2}), 400, param="prompt", contains="prompt")


def test_text_prompt_without_tokenizer_is_400(client):
    assert_error(completion(client, prompt="hello"), 400, contains="token ids")


def test_chat_without_chat_template_is_400(client):
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert_error(client.post("/v1/chat/completions", json=body), 400, param="messages", contains="chat template")


@pytest.mark.parametrize("fields,param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_tokens"),
])
def test_invalid_chat_parameter_is_400(client, fields, param):
    assert_error(client.post("/v1/chat/completions", json=fields), 400, param=param)


def test_tokenize_without_tokenizer_is_400(client):
    assert_error(client.post("/tokenize", json={"prompt": "hi"}), 400, contains="tokenizer")
    assert_error(client.post("/detokenize", json={"tokens": "x"}), 400, param="tokens")


def test_stream_with_invalid_parameter_is_400_not_a_broken_stream(client):
    assert_error(completion(client, stream=True, temperature=-1), 400, param="temperature")


def test_errors_leave_nothing_in_the_engine(client):
    text = client.get("/metrics").text
    assert metric(text, "slipstream:num_requests_running") == 0
    assert metric(text, "slipstream:num_requests_waiting") == 0
