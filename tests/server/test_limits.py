"""Bounded work per request: body size (413), prompt length, prompts, stop strings (400 naming the limit).

A huge request is refused before the work it would cost is done: a small request sent at the
same time completes, and the server's memory stays near its idle size. How long the small
request takes beside it is a time, measured by benchmarks/server_limits.py.
"""
from __future__ import annotations

import json
import socket
import threading
from urllib.parse import urlsplit

import openai
import pytest

from slipstream.server.limits import ServerLimits
from tests.server.conftest import TINY_MAX_LEN, launch_server

LIMITS = ServerLimits()
BODY_LIMIT = LIMITS.max_request_body_bytes
HEADERS = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def client(tiny_chat_server):
    with tiny_chat_server.client() as c:
        yield c


def assert_400(response, param: str, *contains: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for text in contains:
        assert text in error["message"], error
    return error["message"]


def raw_request(url: str, head: str, body_part: bytes, timeout: float = 30) -> bytes:
    """Send a request's head and the start of its body, then read the response (to the server's close)
    without sending more. A server that read the whole declared body before answering would never answer.
    """
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as s:
        s.sendall(head.encode() + body_part)
        response = b""
        while chunk := s.recv(65536):
            response += chunk
        return response


def declared_body(url: str, size: int) -> bytes:
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {size}\r\n\r\n")
    return raw_request(url, head, b'{"prompt": "' + b"a" * 1000)


def chunked_body(url: str, size: int) -> bytes:
    """A chunked body of `size` bytes without its final empty chunk: it never ends."""
    head = ("POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            "transfer-encoding: chunked\r\n\r\n")
    chunk = b"a" * 65536
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(size // len(chunk)))
    return raw_request(url, head, body)


# --- body size ---------------------------------------------------------------------------
def test_declared_huge_body_is_413_before_it_is_sent(tiny_chat_server):
    response = declared_body(tiny_chat_server.url, 50 * 2**20)
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert b"--max-request-body-bytes" in response and str(BODY_LIMIT).encode() in response


def test_chunked_body_over_the_limit_is_413_once_the_limit_is_passed(tiny_chat_server):
    response = chunked_body(tiny_chat_server.url, BODY_LIMIT + 65536)
    assert response.startswith(b"HTTP/1.1 413"), response[:200]


def test_body_just_over_the_limit_is_413_through_the_openai_client(tiny_chat_server):
    client = openai.OpenAI(base_url=f"{tiny_chat_server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny-chat", prompt="a" * BODY_LIMIT, max_tokens=1)
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"


def test_body_under_the_limit_is_served(client):
    response = client.post("/v1/completions", json={"prompt": "a" * 1000, "max_tokens": 2})
    assert response.status_code == 200, response.text


# --- prompt length, before tokenizing ------------------------------------------------------
def test_prompt_too_long_in_characters_is_400_naming_max_model_len(client):
    message = assert_400(client.post("/v1/completions", json={"prompt": "ab " * 300_000, "max_tokens": 2}),
                         "prompt", "900000 characters", f"max_model_len is {TINY_MAX_LEN}")
    assert "at most" in message


def test_prompt_too_long_in_tokens_is_400(client):
    # under the character bound (every character a token of its own), over max_model_len in tokens
    response = client.post("/v1/completions", json={"prompt": "\x01" * (TINY_MAX_LEN + 10), "max_tokens": 2})
    assert_400(response, "prompt", f"max_model_len is {TINY_MAX_LEN}")


def test_chat_too_long_is_400(client):
    messages = [{"role": "user", "content": "ab " * 300_000}]
    assert_400(client.post("/v1/chat/completions", json={"messages": messages}), "messages", "characters")
    many = [{"role": "user", "content": ""}] * TINY_MAX_LEN
    assert_400(client.post("/v1/chat/completions", json={"messages": many}), "messages", "messages cannot fit")


def test_tokenize_too_long_is_400(client):
    assert_400(client.post("/tokenize", json={"prompt": "ab " * 300_000}), "prompt", "characters")


# --- prompts and stop strings -----------------------------------------------------------
@pytest.mark.parametrize("prompt", [["hi"] * (LIMITS.max_prompts_per_request + 1),
                                    [[5, 6]] * (LIMITS.max_prompts_per_request + 1)], ids=["texts", "token-ids"])
def test_too_many_prompts_is_400_naming_the_limit(client, prompt):
    assert_400(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}), "prompt",
               f"at most {LIMITS.max_prompts_per_request}", "--max-prompts-per-request")


def test_too_many_stop_strings_is_400_naming_the_limit(client):
    body = {"prompt": "hi", "max_tokens": 1, "stop": ["ab"] * 100_000}
    assert_400(client.post("/v1/completions", json=body), "stop", "100000 stop strings", "--max-stop-strings")
    chat = {"messages": [{"role": "user", "content": "hi"}], "stop": ["ab"] * (LIMITS.max_stop_strings + 1)}
    assert_400(client.post("/v1/chat/completions", json=chat), "stop", "--max-stop-strings")


def test_too_long_stop_string_is_400_naming_the_limit(client):
    body = {"prompt": "hi", "max_tokens": 1, "stop": "x" * (LIMITS.max_stop_string_length + 1)}
    assert_400(client.post("/v1/completions", json=body), "stop", f"at most {LIMITS.max_stop_string_length}",
               "--max-stop-string-length")


def test_limits_at_their_values_are_served(client):
    body = {"prompt": ["hi"] * 2, "max_tokens": 1, "stop": ["z" * LIMITS.max_stop_string_length]
            + ["ab"] * (LIMITS.max_stop_strings - 1)}
    assert client.post("/v1/completions", json=body).status_code == 200


@pytest.mark.slow
def test_limits_are_set_by_their_flags(tiny_chat_model, tmp_path):
    server = launch_server(tiny_chat_model, str(tmp_path / "server.log"), "--max-request-body-bytes", "2000",
                           "--max-prompts-per-request", "2", "--max-stop-strings", "1",
                           "--max-stop-string-length", "3").wait_ready()
    try:
        with server.client() as c:
            assert c.post("/v1/completions", json={"prompt": "a" * 3000}).status_code == 413
            assert_400(c.post("/v1/completions", json={"prompt": ["a"] * 3}), "prompt", "at most 2")
            assert_400(c.post("/v1/completions", json={"prompt": "a", "stop": ["b", "c"]}), "stop", "at most 1")
            assert_400(c.post("/v1/completions", json={"prompt": "a", "stop": "long"}), "stop", "at most 3")
            assert c.post("/v1/completions", json={"prompt": ["a"] * 2, "stop": "abc"}).status_code == 200
    finally:
        server.stop()


def test_invalid_limit_is_a_clear_error():
    with pytest.raises(ValueError, match="max_stop_strings=0 must be a positive integer"):
        ServerLimits(max_stop_strings=0)


# --- a huge request does not slow the others -----------------------------------------------
HUGE = {  # each just under the body limit, so that its own check is what refuses it
    "prompt": json.dumps({"prompt": "ab " * (BODY_LIMIT // 3 - 20), "max_tokens": 8}).encode(),
    "stop": json.dumps({"prompt": "hi", "max_tokens": 64, "stop": ["a"] * (BODY_LIMIT // 5 - 20),
                       "ignore_eos": True}).encode(),
}


def send_huge(server, kind: str) -> int:
    """Status of one huge request: 413 for a 50 MB body, 400 for a huge prompt or stop list."""
    if kind == "body":
        return int(declared_body(server.url, 50 * 2**20).split()[1])
    assert len(HUGE[kind]) <= BODY_LIMIT
    with server.client() as c:
        return c.post("/v1/completions", content=HUGE[kind], headers=HEADERS).status_code


def small_request(client) -> int:
    """Output tokens of a small request the size of a real one's work (64 tokens)."""
    out = client.completions.create(model="tiny-chat", prompt="hello", max_tokens=64, extra_body={"ignore_eos": True})
    return out.usage.completion_tokens


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
@pytest.mark.parametrize("kind,status", [("body", 413), ("prompt", 400), ("stop", 400)])
def test_huge_request_is_refused_while_a_concurrent_small_one_completes(tiny_chat_server, kind, status):
    """The small request's latency beside each huge one is benchmarks/server_limits.py's (a time)."""
    client = openai.OpenAI(base_url=f"{tiny_chat_server.url}/v1", api_key="unused", max_retries=0)
    small_request(client)  # warm
    idle_rss = rss_bytes(tiny_chat_server.process.pid)
    completed, statuses = [], []
    for _ in range(3):
        huge = threading.Thread(target=lambda: statuses.append(send_huge(tiny_chat_server, kind)))
        huge.start()
        completed.append(small_request(client))
        huge.join()
    assert statuses == [status] * 3
    assert completed == [64] * 3
    assert rss_bytes(tiny_chat_server.process.pid) < 1.2 * idle_rss
