"""A real `slipstream serve` subprocess on loopback, started once per session or module.

The server is started with the package's own CLI, waited for on /health, and stopped with
SIGTERM at the end; it must then exit with status 0 (a clean shutdown).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

from slipstream.server.auth import API_KEY_ENV
from tests.conftest import build_tiny_checkpoint, save_tiny_tokenizer

API_KEY = "test-key"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_MAX_LEN = 4096  # long enough that an aborted stream could not have finished by itself


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    log_path: str
    api_key: str | None = None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, **{"timeout": 120, **kwargs})

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-5000:]

    def wait_ready(self, timeout: float = 300) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"server exited with {self.process.returncode} before it was ready:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.process.kill()
        pytest.fail(f"server not ready after {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        """SIGTERM; the server must shut down cleanly (exit status 0) within 30 s."""
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            pytest.fail(f"server did not stop within 30 s of SIGTERM:\n{self.log()}")
        assert code == 0, f"server exited with {code} after SIGTERM:\n{self.log()}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(model: str, log_path: str, *args: str, api_key: str | None = None) -> Server:
    """Start `slipstream serve` (float32), the API key in its environment; call wait_ready() before using it."""
    port = free_port()
    cmd = [sys.executable, "-m", "slipstream.cli", "serve", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--uvicorn-log-level", "warning", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return Server(process, f"http://127.0.0.1:{port}", log_path, api_key)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random llama without tokenizer files: token-id prompts only, empty texts."""
    path = str(tmp_path_factory.mktemp("tiny_server_model"))
    return build_tiny_checkpoint(path, "llama", num_kv_heads=2, max_position_embeddings=TINY_MAX_LEN)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> str:
    """A random llama with a small byte-level tokenizer and a ChatML template: text prompts and chat."""
    path = str(tmp_path_factory.mktemp("tiny_chat_model"))
    build_tiny_checkpoint(path, "llama", num_kv_heads=2, max_position_embeddings=TINY_MAX_LEN)
    return save_tiny_tokenizer(path)


@pytest.fixture(scope="session")
def tiny_chat_server(tiny_chat_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("tiny_chat_server") / "server.log")
    server = launch_server(tiny_chat_model, log, "--served-model-name", "tiny-chat").wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_server(tiny_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("tiny_server") / "server.log")
    server = launch_server(tiny_model, log, "--served-model-name", "tiny", api_key=API_KEY).wait_ready()
    yield server
    server.stop()


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in a Prometheus exposition (0 if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        sample, _, label_text = head.partition("{")
        if sample != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            return float(value)
    return 0.0
