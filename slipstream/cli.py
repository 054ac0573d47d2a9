"""Command line: `slipstream generate | chat | serve | info | bench {serve,throughput,latency}` (vLLM's flag names)."""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time

from slipstream.config import QUANTIZATION_METHODS, EngineConfig
from slipstream.engine.engine import LLMEngine
from slipstream.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    parser.add_argument("--model", default=d.model, help="bundled alias, .gguf file or HF checkpoint directory")
    parser.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quantization", default=d.quantization, choices=QUANTIZATION_METHODS,
                        help="int8 / int4: weight-only; w8a8: int8 weights and activations; gguf: a GGUF file's "
                             "blocks as stored (opt-in: README, GGUF weights as stored)")
    parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                        help="auto, bfloat16, float32, fp8, tq4, tq3.5, tq3, tq2.5, tq2, tq-k{K}v{V} (TurboQuant; "
                             "-qjl suffix: QJL keys; -codes suffix: no 16-bit recent/sink tokens)")
    parser.add_argument("--kv-cache-dense-layers", type=int, default=d.kv_cache_dense_layers,
                        help="TurboQuant: keep the first and last N layers in 16 bits")
    parser.add_argument("--kv-cache-recent-tokens", type=int, default=d.kv_cache_recent_tokens,
                        help="TurboQuant: also keep the newest R tokens of each sequence in 16 bits "
                             "(default: the dtype's, 112 for tq4 / tq3.5, 144 for tq3, 128 for tq2.5, else 64)")
    parser.add_argument("--kv-cache-sink-tokens", type=int, default=d.kv_cache_sink_tokens,
                        help="TurboQuant: also keep the first S tokens (attention sinks) of each sequence in 16 bits "
                             "(default: the dtype's, 4)")
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory, help="bytes for the KV cache")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=d.deterministic,
                        help="batch-invariant outputs (default: where they cost nothing, i.e. CPUs without AMX)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                        help="CUDA: size the KV cache to this fraction of GPU memory after profiling (replaces --kv-cache-memory)")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=d.enforce_eager,
                        help="CUDA: --no-enforce-eager captures decode steps as CUDA graphs (off by default: untested on a GPU)")
    parser.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                        help="ranks that split every layer: this process and N-1 it starts, or torchrun's N")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="with --tensor-parallel-size N: MoE experts split by expert, E/N per rank")
    parser.add_argument("--skip-tokenizer-init", action="store_true",
                        help="load no tokenizer: prompts must be token ids, outputs carry no text")
    parser.add_argument("--speculative-config", type=_json_object, default=None,
                        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=args.model, dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_dense_layers=args.kv_cache_dense_layers, kv_cache_recent_tokens=args.kv_cache_recent_tokens,
        kv_cache_sink_tokens=args.kv_cache_sink_tokens, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, device=args.device, speculative_config=args.speculative_config,
        deterministic=args.deterministic, gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel, skip_tokenizer_init=args.skip_tokenizer_init)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} must be a JSON object")
    return value


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens,
                          seed=args.seed, stop=args.stop)


def stream(engine: LLMEngine, prompt, params: SamplingParams, out=sys.stdout) -> str:
    """Run one request, printing text as it is produced; returns the whole text."""
    start = time.monotonic()
    engine.add_request("cli", prompt, params)
    printed = 0
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            out.write(text[printed:])
            out.flush()
            printed = len(text)
            final = output
    out.write("\n")
    _print_stats(final, time.monotonic() - start)
    return final.outputs[0].text


def _print_stats(output, elapsed: float) -> None:
    m = output.metrics
    n = len(output.outputs[0].token_ids)
    tpot = f"{1000 * m.tpot:.1f} ms" if m.tpot is not None else "n/a"
    print(f"[prompt {len(output.prompt_token_ids)} tokens, output {n} tokens, TTFT {1000 * m.ttft:.0f} ms, "
          f"TPOT {tpot}, {n / elapsed:.1f} tok/s]", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> None:
    engine = LLMEngine(engine_config(args))
    prompt = engine.processor.render_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    stream(engine, prompt, sampling_params(args))


def cmd_chat(args: argparse.Namespace) -> None:
    engine = LLMEngine(engine_config(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Chat with the model; an empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            user = input("> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        reply = stream(engine, engine.processor.render_chat(messages), sampling_params(args))
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(args: argparse.Namespace) -> None:
    from slipstream.server.app import build_app
    from slipstream.server.auth import resolve_api_key
    from slipstream.server.drain import check_shutdown_timeout, serve
    from slipstream.server.limits import ServerLimits

    api_key = resolve_api_key(args.api_key)  # before the model loads: bad flags fail fast
    check_shutdown_timeout(args.shutdown_timeout)
    limits = ServerLimits(max_request_body_bytes=args.max_request_body_bytes,
                          max_prompts_per_request=args.max_prompts_per_request,
                          max_stop_strings=args.max_stop_strings, max_stop_string_length=args.max_stop_string_length)
    config = dataclasses.replace(engine_config(args), log_stats_interval=10.0)
    app = build_app(LLMEngine(config), args.served_model_name or args.model, api_key=api_key, limits=limits)
    # Nothing loaded so far is ever freed: keep it out of the cyclic collector's scans, whose
    # pauses stall every thread (a refused 1 MiB body of 200k nested lists: 0.42-0.68 s -> 0.19-0.42 s).
    gc.freeze()
    serve(app, args.host, args.port, args.uvicorn_log_level, args.shutdown_timeout)


def cmd_info(args: argparse.Namespace) -> None:
    """The backend this machine gets and why, without loading a model."""
    import torch

    from slipstream.backends.select import select_backend
    from slipstream.distributed.launcher import describe_layout
    from slipstream.platform import resolve_device

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    device = resolve_device(args.device)
    for line in [*select_backend(device, args.deterministic).describe(), describe_layout(args.tensor_parallel_size, device)]:
        print(line)


def cmd_bench_serve(args: argparse.Namespace) -> None:
    from slipstream.bench import serve

    serve.main(args)


def cmd_bench_throughput(args: argparse.Namespace) -> None:
    from slipstream.bench import throughput

    throughput.main(args, engine_config(args))


def cmd_bench_latency(args: argparse.Namespace) -> None:
    from slipstream.bench import latency

    latency.main(args, engine_config(args))


def add_serve_parser(sub) -> None:
    from slipstream.server.limits import ServerLimits

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (all routes but /health); default: "
                            "$SLIPSTREAM_API_KEY, which, unlike the command line, is not visible in `ps`")
    limits = ServerLimits()
    serve.add_argument("--max-request-body-bytes", type=int, default=limits.max_request_body_bytes,
                       help="larger request bodies get a 413 before they are read")
    serve.add_argument("--max-prompts-per-request", type=int, default=limits.max_prompts_per_request)
    serve.add_argument("--max-stop-strings", type=int, default=limits.max_stop_strings)
    serve.add_argument("--max-stop-string-length", type=int, default=limits.max_stop_string_length,
                       help="characters")
    serve.add_argument("--shutdown-timeout", type=float, default=5.0,
                       help="seconds that running requests get to finish after SIGTERM/SIGINT; those left then "
                            "end with an error event (new requests get a 503 meanwhile)")
    serve.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    serve.set_defaults(func=cmd_serve)


def add_bench_parser(sub) -> None:
    from slipstream.bench import latency, serve, throughput

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bench_serve = bench.add_parser("serve", help="load an OpenAI-compatible server; TTFT/TPOT/ITL/E2E, throughput")
    serve.add_args(bench_serve)
    bench_serve.set_defaults(func=cmd_bench_serve)
    for name, module, func, help_ in (("throughput", throughput, cmd_bench_throughput, "offline throughput"),
                                      ("latency", latency, cmd_bench_latency, "offline TTFT and TPOT")):
        p = bench.add_parser(name, help=help_)
        add_engine_args(p)
        module.add_args(p)
        p.set_defaults(func=func)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description="A small LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    chat = sub.add_parser("chat", help="interactive chat that keeps the conversation")
    chat.add_argument("--system", default=None, help="system prompt")
    for p in (gen, chat):
        add_engine_args(p)
        add_sampling_args(p)
    gen.set_defaults(func=cmd_generate)
    chat.set_defaults(func=cmd_chat)
    info = sub.add_parser("info", help="which backend and kernels serve this machine, and why")
    info.add_argument("--device", default=EngineConfig().device)
    info.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None)
    info.add_argument("--tensor-parallel-size", type=int, default=1)
    info.set_defaults(func=cmd_info)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
