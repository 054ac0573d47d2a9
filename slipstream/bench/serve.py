"""`slipstream bench serve`: load an OpenAI-compatible server and measure it as vLLM's benchmark does.

Requests (token-id prompts from workload.py) go to /v1/completions with stream=true,
arriving as a Poisson process at --request-rate (inf: all at once), at most
--max-concurrency in flight. Per request we record, on the client's clock:

- TTFT: from sending the request to the first chunk that carries a choice;
- ITL: the gaps between successive such chunks;
- E2E latency: from sending to the last byte;
- TPOT = (E2E - TTFT) / (output tokens - 1), for requests with more than one output token;

and report mean, median (p50), p90 and p99 of each, in milliseconds, plus request, output
token and total token throughput over the benchmark's duration. Output token counts come
from the server's streamed usage (or, if it sends none, the number of chunks). This
module must never need the server's tokenizer.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from slipstream.bench.workload import SampleRequest, length_range, random_requests, shared_prefix_requests

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    parser.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset-name", default="random", choices=["random", "shared-prefix"])
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128, help="prompt (suffix, for shared-prefix) tokens")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    parser.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens in each shared prefix")
    parser.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: number of distinct prefixes")
    parser.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids are drawn from [0, this)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf = all at once")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly the requested output lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-result", default=None, metavar="JSON", help="write metrics and per-request data")
    parser.add_argument("--plot", default=None, metavar="PNG", help="plot latency distributions")


def build_workload(args: argparse.Namespace) -> list[SampleRequest]:
    input_len = length_range(args.input_len, args.range_ratio)
    output_len = length_range(args.output_len, args.range_ratio)
    if args.dataset_name == "shared-prefix":
        return shared_prefix_requests(args.num_prompts, args.vocab_size, args.prefix_len, args.num_prefixes,
                                      input_len, output_len, args.seed)
    return random_requests(args.num_prompts, args.vocab_size, input_len, output_len, args.seed)


def main(args: argparse.Namespace) -> dict:
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate={args.request_rate} must be > 0 (inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency={args.max_concurrency} must be >= 1")
    requests = build_workload(args)
    results, duration, model = asyncio.run(run(args, requests))
    metrics = summarize(results, duration)
    print_report(metrics, args)
    if args.save_result:
        config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
        config.update(model=model, request_rate=str(args.request_rate))
        detail = {"input_lens": [r.prompt_len for r in results], "output_lens": [r.output_len for r in results],
                  "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
                  "e2els": [r.latency for r in results], "errors": [r.error for r in results]}
        with open(args.save_result, "w") as f:
            json.dump({**config, **metrics, **detail}, f, indent=2)
    if args.plot:
        plot(results, metrics, args.plot)
    return metrics


async def run(args: argparse.Namespace, requests: list[SampleRequest]) -> tuple[list[RequestResult], float, str]:
    httpx = _require("httpx")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers, timeout=None,
                                 limits=limits) as client:
        model = args.model or await _first_model(client)
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed)

        async def one(request: SampleRequest) -> RequestResult:
            if limit is None:
                return await send(client, model, request, args)
            async with limit:
                return await send(client, model, request, args)

        start = time.perf_counter()
        tasks = []
        for i, request in enumerate(requests):
            if i and math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start, model


async def _first_model(client) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def send(client, model: str, request: SampleRequest, args: argparse.Namespace) -> RequestResult:
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.output_len, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    result = RequestResult(prompt_len=len(request.prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now, chunk = time.perf_counter(), json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk["error"]))
                    return result
                if chunk.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
        result.latency = time.perf_counter() - start
        if not result.output_len and result.ttft:  # no streamed usage: count chunks (one token each, usually)
            result.output_len = 1 + len(result.itl)
        result.success = True
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not the end of the benchmark
        result.error = f"{type(e).__name__}: {e}"
    return result


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    metrics = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name, values in series.items():
        ms = np.array(values or [0.0]) * 1000
        metrics[f"mean_{name}_ms"] = float(ms.mean())
        metrics[f"median_{name}_ms"] = float(np.median(ms))
        for q in PERCENTILES:
            metrics[f"p{q}_{name}_ms"] = float(np.percentile(ms, q))
    return metrics


def print_report(m: dict, args: argparse.Namespace) -> None:
    def row(label, value, fmt="{:.2f}"):
        print(f"{label:<40}{fmt.format(value):>12}")

    print("{s:=^52}".format(s=" Serving Benchmark Result "))
    row("Successful requests:", m["completed"], "{}")
    row("Failed requests:", m["failed"], "{}")
    row("Request rate (req/s):", args.request_rate, "{}")
    row("Max concurrency:", args.max_concurrency or "none", "{}")
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "{}")
    row("Total generated tokens:", m["total_output_tokens"], "{}")
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name, title in titles.items():
        print("{s:-^52}".format(s=f" {title} "))
        row(f"Mean {name.upper()} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", m[f"median_{name}_ms"])
        for q in PERCENTILES[1:]:
            row(f"P{q} {name.upper()} (ms):", m[f"p{q}_{name}_ms"])
    print("=" * 52)
    sys.stdout.flush()


def plot(results: list[RequestResult], metrics: dict, path: str) -> None:
    """Empirical CDFs of TTFT, TPOT, ITL and E2E latency (ms)."""
    matplotlib = _require("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    series = {
        "TTFT": [r.ttft for r in ok],
        "TPOT": [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
        "ITL": [gap for r in ok for gap in r.itl],
        "E2E latency": [r.latency for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series.items()):
        ms = np.sort(np.array(values) * 1000)
        if len(ms):
            ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post")
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{metrics['completed']} requests, {metrics['request_throughput']:.2f} req/s, "
                 f"{metrics['output_throughput']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _require(package: str):
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ValueError(f"slipstream bench serve needs {package}: pip install {package}") from None
