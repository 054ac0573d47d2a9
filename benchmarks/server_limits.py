"""A huge request does not slow a small one: the small request's latency alone and beside each kind.

Starts `slipstream serve` on loopback, then for each kind of huge request (a 50 MB body, a
prompt or a stop list just under the body limit: each refused by its own check, 413 or 400)
sends it three times, each beside a small completion (64 tokens), and prints the small
request's median latency over its idle median, measured in the same run. The tests check
the statuses and the memory; this prints the time.

    python benchmarks/server_limits.py [--model smollm2-135m]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

from slipstream.server.limits import ServerLimits

LIMIT = ServerLimits().max_request_body_bytes
HUGE = {
    "prompt": {"prompt": "ab " * (LIMIT // 3 - 20), "max_tokens": 8},
    "stop": {"prompt": "hi", "max_tokens": 64, "stop": ["a"] * (LIMIT // 5 - 20), "ignore_eos": True},
}


def huge_status(url: str, kind: str) -> int:
    if kind != "body":
        return httpx.post(f"{url}/v1/completions", content=json.dumps(HUGE[kind]),
                          headers={"content-type": "application/json"}, timeout=120).status_code
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:  # declares 50 MB, sends 1 kB
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n{\"prompt\": \"%s" % (50 * 2**20, b"a" * 1000))
        return int(s.recv(65536).split()[1])


def small_latency(url: str) -> float:
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 64, "ignore_eos": True},
                   timeout=120)
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


def beside(url: str, kind: str) -> tuple[float, int]:
    statuses = []
    huge = threading.Thread(target=lambda: statuses.append(huge_status(url, kind)))
    huge.start()
    latency = small_latency(url)
    huge.join()
    return latency, statuses[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "slipstream.cli", "serve", "--model", args.model,
                               "--port", str(args.port), "--uvicorn-log-level", "warning"],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.DEVNULL)
    try:
        while server.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        small_latency(url)  # warm-up
        idle = statistics.median(small_latency(url) for _ in range(3))
        print(f"{args.model}: a small request (64 tokens) alone: {idle:.3f} s (median of 3)")
        print("| huge request | status | small request beside it / alone (median of 3) |\n|---|---|---|")
        for kind in ("body", "prompt", "stop"):
            runs = [beside(url, kind) for _ in range(3)]
            print(f"| {kind} | {runs[0][1]} | {statistics.median(t for t, _ in runs) / idle:.2f}x |", flush=True)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
