"""A client that goes away aborts its request at once, and its KV blocks are freed (read from /metrics).

Requests ask for thousands of tokens with ignore_eos, far more than they could produce in
the time the test waits, so a request that finishes here was aborted, not completed.
"""
from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from tests.server.conftest import metric

LONG = {"prompt": list(range(3, 40)), "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
RUNNING, WAITING = "slipstream:num_requests_running", "slipstream:num_requests_waiting"
KV, ABORTED = "slipstream:kv_cache_usage_perc", "slipstream:request_success_total"
GENERATED = "slipstream:generation_tokens_total"


@pytest.fixture
def client(tiny_server):
    with tiny_server.client() as c:
        yield c


def scrape(client) -> str:
    return client.get("/metrics").text


def wait_idle(client, timeout: float = 5.0) -> tuple[str, float]:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        text = scrape(client)
        if metric(text, RUNNING) == 0 and metric(text, WAITING) == 0:
            return text, time.monotonic() - start
        time.sleep(0.05)
    pytest.fail(f"requests still running {timeout} s after their clients left:\n{text}")


def test_disconnected_streams_are_aborted_and_freed(tiny_server, client):
    before, _ = wait_idle(client)
    idle_kv = metric(before, KV)
    streams = []  # keep each line iterator alive: closing one closes its connection
    with contextlib.ExitStack() as stack:
        for _ in range(4):
            c = stack.enter_context(tiny_server.client())
            response = stack.enter_context(c.stream("POST", "/v1/completions", json={**LONG, "stream": True}))
            assert response.status_code == 200
            streams.append(response.iter_lines())
            assert next(streams[-1]).startswith("data: ")  # it is generating
        during = scrape(client)
        assert metric(during, RUNNING) == 4 and metric(during, KV) > idle_kv
    after, seconds = wait_idle(client)  # closing the clients dropped the connections
    assert seconds < 2
    assert metric(after, ABORTED, finished_reason="abort") - metric(before, ABORTED, finished_reason="abort") == 4
    assert metric(after, GENERATED) - metric(before, GENERATED) < 4 * 4000 / 4
    assert metric(after, KV) == idle_kv


def test_disconnected_non_streaming_request_is_aborted(tiny_server, client):
    before, _ = wait_idle(client)
    with tiny_server.client() as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json={**LONG, "n": 2}, timeout=1.0)
    after, seconds = wait_idle(client)
    assert seconds < 2
    assert metric(after, ABORTED, finished_reason="abort") - metric(before, ABORTED, finished_reason="abort") == 1
    assert metric(after, KV) == metric(before, KV)


def test_server_still_serves_after_aborts(client):
    response = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
