"""Memory of loading a GGUF file as stored against widened to bf16: the model's weight bytes and the
process's peak RSS while it loads, next to the file's tensor bytes.

Each load runs in a fresh process (peak RSS only grows): the peak is read from getrusage after the
model is built and loaded, less the RSS the process had before loading (torch and slipstream
imported); a 1 MiB KV cache keeps the cache out of it. The weights' own peak is measured apart, with
skip_tokenizer_init=True: a GGUF file's tokenizer is converted from the file by transformers, whose
transient memory (Gemma 3's 262k-token vocabulary: ~730 MiB) would otherwise be the whole peak.

    python benchmarks/gguf_load.py [--models smollm2-135m gemma3-270m]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

MiB = 2**20
LOAD = """
import json, resource, sys
from slipstream import LLM
from slipstream.loader.gguf import GGUFFile
from slipstream.loader.registry import resolve_model_path
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
llm = LLM(sys.argv[1], kv_cache_memory=2**20, **json.loads(sys.argv[2]))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = llm.engine.runner.model
weights = sum({t.data_ptr(): t.nbytes for t in [*model.parameters(), *model.buffers()]}.values())
print(json.dumps({"file": GGUFFile(resolve_model_path(sys.argv[1])).tensor_bytes(), "weights": weights,
                  "peak": peak - before}))
"""


def measure(model: str, options: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", LOAD, model, json.dumps(options)], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    args = parser.parse_args()
    print("| model | weights | file tensors | weight bytes | / file | peak RSS, weights only | / file "
          "| peak RSS with the tokenizer | / file |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for label, options in (("as stored", {"quantization": "gguf"}), ("widened bf16", {"dtype": "bfloat16"})):
            bare, m = measure(model, {**options, "skip_tokenizer_init": True}), measure(model, options)
            print(f"| {model} | {label} | {m['file'] / MiB:.0f} MiB | {m['weights'] / MiB:.0f} MiB | "
                  f"{m['weights'] / m['file']:.2f}x | {bare['peak'] / MiB:.0f} MiB | {bare['peak'] / m['file']:.2f}x | "
                  f"{m['peak'] / MiB:.0f} MiB | {m['peak'] / m['file']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
