"""`slipstream bench serve` against our server, and the offline benchmarks on a tiny model."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from slipstream.bench.serve import RequestResult, summarize
from slipstream.bench.workload import length_range, random_requests, shared_prefix_requests
from tests.conftest import TINY_VOCAB
from tests.server.conftest import API_KEY, REPO, metric

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
SERIES = ("ttft", "tpot", "itl", "e2el")


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "slipstream.cli", *args], capture_output=True, text=True,
                            timeout=timeout, env=ENV, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_bench_serve_saves_metrics_and_plot(tiny_server, tmp_path):
    out, png = tmp_path / "result.json", tmp_path / "plot.png"
    result = cli("bench", "serve", "--base-url", tiny_server.url, "--api-key", API_KEY, "--num-prompts", "6",
                 "--input-len", "16", "--output-len", "8", "--vocab-size", str(TINY_VOCAB), "--request-rate", "50",
                 "--max-concurrency", "4", "--ignore-eos", "--save-result", str(out), "--plot", str(png))
    assert "Serving Benchmark Result" in result.stdout
    data = json.loads(out.read_text())
    assert (data["completed"], data["failed"]) == (6, 0)
    assert (data["total_input_tokens"], data["total_output_tokens"]) == (6 * 16, 6 * 8)
    assert data["model"] == "tiny"
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "duration"):
        assert data[key] > 0
    assert data["output_throughput"] == pytest.approx(48 / data["duration"])
    assert data["total_token_throughput"] == pytest.approx((96 + 48) / data["duration"])
    for name in SERIES:
        values = [data[f"{stat}_{name}_ms"] for stat in ("mean", "median", "p90", "p99")]
        assert all(v >= 0 for v in values), name
        assert data[f"median_{name}_ms"] <= data[f"p90_{name}_ms"] <= data[f"p99_{name}_ms"]
    assert data["mean_e2el_ms"] >= data["mean_ttft_ms"] > 0
    assert len(data["ttfts"]) == 6 and not any(data["errors"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_shared_prefix_hits_the_prefix_cache(tiny_server):
    with tiny_server.client() as client:
        before = metric(client.get("/metrics").text, "slipstream:prefix_cache_hits_total")
        cli("bench", "serve", "--base-url", tiny_server.url, "--api-key", API_KEY, "--dataset-name", "shared-prefix",
            "--prefix-len", "64", "--num-prompts", "4", "--input-len", "8", "--output-len", "2",
            "--vocab-size", str(TINY_VOCAB), "--max-concurrency", "1")
        after = metric(client.get("/metrics").text, "slipstream:prefix_cache_hits_total")
    assert after - before >= 3 * 64 - 16  # every prompt after the first reuses the full blocks of the prefix


def test_tpot_and_percentiles_follow_vllm_definitions():
    results = [RequestResult(True, 10, 5, ttft=0.1, itl=[0.1, 0.1, 0.2, 0.1], latency=0.6),
               RequestResult(True, 20, 1, ttft=0.3, latency=0.3),  # one token: no TPOT
               RequestResult(False, 10, 0, error="boom")]
    m = summarize(results, duration=2.0)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 6)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 3.0 and m["total_token_throughput"] == 18.0
    assert m["mean_tpot_ms"] == pytest.approx((0.6 - 0.1) / 4 * 1000)
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["mean_itl_ms"] == pytest.approx(125) and m["p99_itl_ms"] == pytest.approx(197, abs=0.1)
    assert m["mean_e2el_ms"] == pytest.approx(450)


def test_workloads_are_seeded_and_sized():
    a = random_requests(5, 100, (3, 7), (2, 4), seed=1)
    assert a == random_requests(5, 100, (3, 7), (2, 4), seed=1)
    assert all(3 <= len(r.prompt) <= 7 and 2 <= r.output_len <= 4 and max(r.prompt) < 100 for r in a)
    shared = shared_prefix_requests(4, 100, prefix_len=10, num_prefixes=2, input_len=(5, 5), output_len=(1, 1))
    assert shared[0].prompt[:10] == shared[2].prompt[:10] != shared[1].prompt[:10]
    assert all(len(r.prompt) == 15 for r in shared)
    assert length_range(100, 0.5) == (50, 150)
    with pytest.raises(ValueError, match="range_ratio"):
        length_range(100, 1.5)


def test_bench_throughput_and_latency_offline(tiny_model):
    engine = ["--model", tiny_model, "--dtype", "float32"]
    out = cli("bench", "throughput", *engine, "--num-prompts", "4", "--min-input-len", "8", "--max-input-len", "32",
              "--min-output-len", "4", "--max-output-len", "8").stdout
    assert "output tokens/s" in out and "total tokens/s" in out
    out = cli("bench", "latency", *engine, "--input-len", "32", "--output-len", "4", "--batch-size", "2",
              "--num-iters", "2").stdout
    assert "TTFT, prompt of 32 tokens" in out and "TPOT, batch of 2" in out
