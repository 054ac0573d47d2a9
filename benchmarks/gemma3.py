"""Gemma 3 270M: single-stream decode and 512-token prefill, slipstream vs transformers.

Both load the same GGUF, in the same process, dtype and thread count. Prefill: a request of
512 prompt tokens (real English text) and one output token, timed end to end (prefix
caching off, so every repeat computes the whole prompt). Decode: one request with a short
prompt; rate = extra tokens / extra time between generating 1 and 1 + N tokens, which
removes the prefill from the figure. Each figure is the median of --repeats runs after a
warm-up. Last, how much KV memory local layers could give back if blocks that no query
will see again (older than the 512-token window) were freed, by context length.

    python benchmarks/gemma3.py [--dtype bfloat16] [--decode-tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch

from slipstream import LLM, SamplingParams

PREFILL_TOKENS = 512


def prompt_tokens(tokenizer, n: int) -> list[int]:
    """`n` tokens of real English text: stdlib docstrings."""
    ids = tokenizer(argparse.__doc__ + json.__doc__ + subprocess.__doc__).input_ids
    assert len(ids) >= n, len(ids)
    return ids[:n]


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def slipstream_times(llm: LLM, prefill: list[int], short: list[int], decode: int, repeats: int):
    def run(prompt, n):
        return lambda: llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                    use_tqdm=False)
    return (median_time(run(prefill, 1), repeats),
            median_time(run(short, 1), repeats), median_time(run(short, 1 + decode), repeats))


def transformers_times(model, prefill: list[int], short: list[int], decode: int, repeats: int):
    def run(prompt, n):
        ids = torch.tensor([prompt])

        def generate():
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
        return generate
    return (median_time(run(prefill, 1), repeats),
            median_time(run(short, 1), repeats), median_time(run(short, 1 + decode), repeats))


def window_savings(llm: LLM) -> None:
    """KV bytes of blocks that every local layer has slid past, as a share of the sequence's KV.

    The next query sits at position L (the context length) and sees keys j > L - window, so a
    block whose last position is <= L - window is dead for local layers, and stays dead.
    """
    attn = llm.engine.runner.model.attention_layers()
    windows = {a.sliding_window for a in attn} - {None}
    assert len(windows) == 1, windows
    window = windows.pop()
    block = llm.engine.config.block_size
    local = sum(a.sliding_window is not None for a in attn)
    print(f"\nsliding-window KV: {local} of {len(attn)} layers local, window {window}, block {block} tokens")
    for length in (512, 1024, 2048, 4096, 8192, 32768):
        dead_blocks = max(0, (length - window + 1) // block)
        total_blocks = -(-length // block)
        saved = local * dead_blocks / (len(attn) * total_blocks)
        mib = dead_blocks * block * llm.stats()["kv_bytes_per_token"] * local / len(attn) / 2**20
        print(f"  context {length:6d}: {saved:6.1%} of the sequence's KV reclaimable ({mib:7.1f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    llm = LLM("gemma3-270m", dtype=args.dtype, enable_prefix_caching=False, max_num_batched_tokens=PREFILL_TOKENS)
    prefill = prompt_tokens(llm.get_tokenizer(), PREFILL_TOKENS)
    short = prefill[:16]
    print(f"Gemma 3 270M ({os.path.basename(llm.engine.model_path)}), {args.dtype}, "
          f"{torch.get_num_threads()} threads; prefill {PREFILL_TOKENS} tokens, decode {args.decode_tokens} tokens "
          f"after a {len(short)}-token prompt, median of {args.repeats}")
    ours = slipstream_times(llm, prefill, short, args.decode_tokens, args.repeats)

    import transformers

    transformers.logging.set_verbosity_error()  # its "weights packed" hint is moot: gemma3 GGUFs are dequantized
    path = llm.engine.model_path
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype).eval()
    assert all(p.dtype == dtype for p in model.parameters()), "transformers kept weights quantized; not comparable"
    theirs = transformers_times(model, prefill, short, args.decode_tokens, args.repeats)

    rows = {}
    for name, (t_prefill, t_one, t_many) in (("slipstream", ours), ("transformers", theirs)):
        rows[name] = (PREFILL_TOKENS / t_prefill, args.decode_tokens / (t_many - t_one))
        print(f"{name:13s} prefill {rows[name][0]:8.1f} tok/s   decode {rows[name][1]:6.1f} tok/s")
    (p_ours, d_ours), (p_theirs, d_theirs) = rows["slipstream"], rows["transformers"]
    print(f"{'ratio':13s} prefill {p_ours / p_theirs:8.2f}x      decode {d_ours / d_theirs:6.2f}x  (slipstream / transformers)")
    window_savings(llm)


if __name__ == "__main__":
    main()
