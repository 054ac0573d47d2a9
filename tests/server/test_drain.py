"""Graceful drain: on SIGTERM / SIGINT a `slipstream serve` process finishes what runs and exits 0.

Streams in flight when the signal comes either finish (short ones, well within the drain
timeout) or end with an error event (long ones: thousands of tokens, far more than the
timeout allows); both end with `data: [DONE]`. Requests sent during the drain get a 503.
"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import launch_server, metric

pytestmark = pytest.mark.slow

SHUTDOWN_TIMEOUT = 5
SHORT = {"prompt": list(range(3, 20)), "max_tokens": 24, "ignore_eos": True, "stream": True,
         "stream_options": {"include_usage": True}}
LONG = {**SHORT, "max_tokens": 4000}


class StreamReader(threading.Thread):
    """Reads one SSE stream to its end; `started` is set at its first event."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.started = threading.Event()
        self.events: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=60) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line:
                        self.events.append(line.removeprefix("data: "))
                        self.started.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
            self.started.set()

    def chunks(self) -> list[dict]:
        return [json.loads(e) for e in self.events[:-1]]


def assert_complete(reader: StreamReader, max_tokens: int) -> None:
    assert reader.error is None and reader.events[-1] == "[DONE]", reader.events[-3:]
    chunks = reader.chunks()
    assert not any("error" in c for c in chunks), chunks[-2:]
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def assert_ended_with_error(reader: StreamReader) -> None:
    assert reader.error is None and reader.events[-1] == "[DONE]", (reader.error, reader.events[-3:])
    *body, last = reader.chunks()
    assert last["error"]["type"] == "service_unavailable" and "shutdown timeout" in last["error"]["message"], last
    assert body and all("error" not in c for c in body)  # it was streaming until then


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_streams_and_exits_0(tiny_model, tmp_path, sig):
    server = launch_server(tiny_model, str(tmp_path / "server.log"), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT))
    server.wait_ready()
    try:
        short = [StreamReader(server.url, SHORT) for _ in range(4)]
        long = [StreamReader(server.url, LONG) for _ in range(4)]
        for reader in short + long:
            reader.start()
        for reader in short + long:
            assert reader.started.wait(60) and reader.error is None, reader.error
        with httpx.Client(base_url=server.url, timeout=60) as held:  # an idle keep-alive connection
            assert held.get("/health").status_code == 200
            server.process.send_signal(sig)
            for reader in short:
                reader.join(60)
            # still listening, but refusing: on a new connection and on the held one
            refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5], "max_tokens": 1})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            assert held.get("/health").status_code == 503
        for reader in long:
            reader.join(60)
        for reader in short:
            assert_complete(reader, SHORT["max_tokens"])
        for reader in long:
            assert_ended_with_error(reader)
        assert server.process.wait(30) == 0, server.log()
    finally:
        if server.process.poll() is None:
            server.process.kill()


def test_non_streamed_request_cut_by_the_drain_is_a_503(tiny_model, tmp_path):
    server = launch_server(tiny_model, str(tmp_path / "server.log"), "--shutdown-timeout", "1").wait_ready()
    try:
        result: list[httpx.Response] = []
        body = {**LONG, "stream": False, "stream_options": None}
        request = threading.Thread(target=lambda: result.append(
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)))
        request.start()
        with httpx.Client(base_url=server.url) as c:  # wait until it runs
            while metric(c.get("/metrics").text, "slipstream:num_requests_running") < 1:
                time.sleep(0.05)
        server.process.send_signal(signal.SIGTERM)
        request.join(60)
        [response] = result
        assert response.status_code == 503 and "shutdown timeout (1 s)" in response.json()["error"]["message"]
        assert server.process.wait(30) == 0, server.log()
    finally:
        if server.process.poll() is None:
            server.process.kill()
