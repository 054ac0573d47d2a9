"""Offline throughput: slipstream vs transformers `generate` on the same model, dtype and workload.

Workload (the engine-core issue's): N requests, prompt lengths uniform in 32..512 random
token ids, output lengths uniform in 32..256, ignore_eos. transformers runs padded
batches of 16 (left padding) and generates each batch up to its longest requested
output; only requested tokens are counted for both engines.

    python benchmarks/throughput.py [--num-prompts 32] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from slipstream import LLM, SamplingParams


def workload(num_prompts: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(32, 513, (num_prompts,), generator=g).tolist()
    output_lens = torch.randint(32, 257, (num_prompts,), generator=g).tolist()
    prompts = [torch.randint(100, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    return prompts, output_lens


def run_slipstream(llm: LLM, prompts, output_lens) -> float:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == output_lens
    return elapsed


def run_transformers(model, prompts, output_lens, batch_size: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i:i + batch_size], output_lens[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def load_reference(path: str, dtype: torch.dtype):
    """transformers on the same weights: an HF directory, or the same GGUF file."""
    import transformers

    kwargs = {"dtype": dtype}
    if path.endswith(".gguf"):
        path, kwargs["gguf_file"] = os.path.dirname(path), os.path.basename(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype)
    prompts, output_lens = workload(args.num_prompts, llm.engine.model_config.vocab_size)
    total_in, total_out = sum(map(len, prompts)), sum(output_lens)
    print(f"workload: {len(prompts)} requests, {total_in} prompt tokens, {total_out} output tokens, "
          f"dtype {args.dtype}, {torch.get_num_threads()} threads")
    run_slipstream(llm, prompts[:2], [4, 4])  # warm-up
    ours = run_slipstream(llm, prompts, output_lens)
    print(f"slipstream:   {total_out / ours:8.1f} output tok/s  {(total_in + total_out) / ours:8.1f} total tok/s  ({ours:.1f} s)")
    if args.skip_transformers:
        return
    model = load_reference(llm.engine.model_path, getattr(torch, args.dtype))
    theirs = run_transformers(model, prompts, output_lens, args.hf_batch_size)
    print(f"transformers: {total_out / theirs:8.1f} output tok/s  {(total_in + total_out) / theirs:8.1f} total tok/s  ({theirs:.1f} s)")
    print(f"ratio slipstream / transformers: {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
