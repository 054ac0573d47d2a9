"""What each kv_cache_dtype name is worth on text that nothing in the project calibrates on.

Three held-out domains, each read at run time from files a Debian system ships and cut to
--tokens tokens (the model's context: SmolLM2's 8k by default, Gemma 3's 32k with `--model
gemma3-270m --tokens 32000`): prose (the license texts in /usr/share/common-licenses), code (C
headers in /usr/include) and dialogue (the lsof FAQ's questions and answers as user/assistant
turns in the model's chat template, or Gemma's turn markers where the file has none). For each
name: bytes per token with the 16-bit staging of one sequence at that context, perplexity over
all tokens and over the last 1,024, and mean KL, each against the bf16 cache (float32 model, the
text fed in 64-token chunks so that attention reads the compressed cache). KL is over every
position for SmolLM2 and over the last 1,024 for Gemma 3, whose 262k-token vocabulary makes a
32k text's distributions 34 GB.

--calibration sets what the TurboQuant caches calibrate on: `docstrings`, the engine's own
start-up prompt (kvcache/calibration.py); `none`, no statistics at all (key mean 0, key scale 1,
no outlier channels chosen); `domain`, the 1,024 tokens of the same document that follow the
evaluated ones, which bounds what statistics gathered online from each sequence could reach.

    python benchmarks/kv_defaults.py [--model smollm2-135m|gemma3-270m] [--tokens 8000]
        [--domains prose code dialogue] [--rows NAME ...] [--calibration docstrings|none|domain]
"""
from __future__ import annotations

import argparse
import glob
import gzip
import math
import re
import time

import torch

from kv_quality import SHAPES, next_token_scores
from slipstream import LLM
from slipstream.engine import engine
from slipstream.kvcache.cache import KVCache
from slipstream.kvcache.dtype import parse_kv_cache_dtype
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache

CALIBRATION = 1024
ROWS = ["tq4", "tq3.5", "tq3", "tq-k3v3", "tq2.5", "tq-k3v2", "tq4-codes", "tq3-codes"]  # docs/kv-cache-dtypes.md
CHUNK, TAIL = 64, 1024
GEMMA_TURNS = ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
               "{{ m['content'] }}<end_of_turn>\n{% endfor %}")
# per model: (KV heads, head dim) and sliding window of each layer, and the positions whose distributions KL
# compares (None: all)
MODELS = {"smollm2-135m": (SHAPES, None, None), "gemma3-270m": ([(1, 256)] * 18, ([512] * 5 + [None]) * 3, TAIL)}


def prose() -> str:
    names = ["GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-3", "Artistic", "GPL-2", "LGPL-2.1", "MPL-1.1", "GFDL-1.3",
             "CC0-1.0"]  # the first five (9k tokens) are SmolLM2's 8k text; the rest make Gemma 3's 32k
    return "\n\n".join(open(f"/usr/share/common-licenses/{name}").read() for name in names)


def code() -> str:
    names = ["stdio.h", "stdlib.h", "string.h", "unistd.h", "fcntl.h", "signal.h", "time.h", "locale.h", "math.h",
             "pthread.h", "wchar.h", "netdb.h", "regex.h", "argp.h"]  # as prose: the first eight are the 8k text
    return "\n\n".join(open(f"/usr/include/{name}").read() for name in names if glob.glob(f"/usr/include/{name}"))


def dialogue(tokenizer) -> str:
    """The lsof FAQ's numbered questions as user turns, each answer as the assistant's."""
    faq = gzip.open("/usr/share/doc/lsof/00FAQ.gz", "rt", errors="replace").read()
    body = faq[faq.index("_" * 70, faq.index("Table of Contents")):]
    parts = re.split(r"^\d+(?:\.\d+)+\s+(.+\?)\s*$", body, flags=re.M)[1:]
    turns = []
    for question, answer in zip(parts[0::2], parts[1::2]):
        answer = re.sub(r"\s+", " ", answer).strip()
        turns += [{"role": "user", "content": question.strip()}, {"role": "assistant", "content": answer}]
    # the bundled Gemma 3 file carries no chat template: its documented turns
    template = None if tokenizer.chat_template else GEMMA_TURNS
    return tokenizer.apply_chat_template(turns, chat_template=template, tokenize=False)


def texts(domains: list[str], tokens: int, tokenizer) -> dict[str, list[int]]:
    """Each domain's token ids: the `tokens` evaluated, then the CALIBRATION that follow them."""
    sources = {"prose": prose, "code": code, "dialogue": lambda: dialogue(tokenizer)}
    out = {}
    for domain in domains:
        ids = tokenizer(sources[domain]()).input_ids
        if len(ids) < tokens + CALIBRATION:
            raise SystemExit(f"the {domain} text has {len(ids)} tokens, fewer than --tokens {tokens} + {CALIBRATION}")
        out[domain] = ids[:tokens + CALIBRATION]
    return out


def calibrate_on(how: str, ids: list[int], tokenizer) -> None:
    """Point every engine built from now on at the --calibration choice (see the module docstring)."""
    if how == "domain":
        engine.calibration_text = lambda: tokenizer.decode(ids)
    elif how == "none":
        TurboQuantLayerCache._fix = _no_statistics


def _no_statistics(cache: TurboQuantLayerCache, query_power, k: torch.Tensor, v: torch.Tensor) -> None:
    cache.key_mean, cache.key_scale = torch.zeros_like(k[0]), torch.ones_like(k[0])
    cache.key_quantizer.calibrate(torch.ones_like(k[:1]))
    cache.value_quantizer.calibrate(torch.ones_like(v[:1]))
    cache.calibrated = True


def evaluate(model: str, kv_dtype: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    shapes, _, kl_positions = MODELS[model]
    per_token = sum(2 * heads * dim * 4 for heads, dim in shapes)  # a float32 cache's, the largest asked for
    llm = LLM(model, dtype="float32", kv_cache_dtype=kv_dtype, max_num_seqs=1, max_num_batched_tokens=CHUNK,
              enable_prefix_caching=False, max_model_len=len(ids) + 8,
              kv_cache_memory=(len(ids) + 64) * per_token + 2**22, skip_tokenizer_init=True)
    return next_token_scores(llm, ids, kl_positions or len(ids) - 1)


def bytes_per_token(model: str, kv_dtype: str, context: int) -> float:
    """All layers' K/V bytes per token of one `context`-token sequence, its 16-bit staging included."""
    shapes, sliding, _ = MODELS[model]
    cache = KVCache(shapes, parse_kv_cache_dtype(kv_dtype, torch.bfloat16), torch.bfloat16, 2**34, 16,
                    torch.device("meta"), sliding_windows=sliding)
    return cache.bytes_per_token + cache.window_memory / context


def scores(nll: torch.Tensor, logprobs: torch.Tensor, reference: torch.Tensor) -> tuple[float, float, float]:
    """Perplexity over all tokens and over the last TAIL, mean KL against the reference's kept rows."""
    kl = (reference.exp() * (reference - logprobs)).sum(-1).mean().item()
    return math.exp(nll.mean().item()), math.exp(nll[-TAIL:].mean().item()), kl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--domains", nargs="*", default=["prose", "code", "dialogue"])
    parser.add_argument("--rows", nargs="*", default=ROWS)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--calibration", choices=["docstrings", "none", "domain"], default="docstrings")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = LLM(args.model, kv_cache_memory=2**22).get_tokenizer()
    results: dict[tuple[str, str], tuple[float, float, float]] = {}
    for domain, ids in texts(args.domains, args.tokens, tokenizer).items():
        ids, following = ids[:args.tokens], ids[args.tokens:]
        calibrate_on(args.calibration, following, tokenizer)
        nll, reference = evaluate(args.model, "bfloat16", ids)
        results[domain, "bfloat16"] = scores(nll, reference, reference)
        print(f"{domain:9s} {'bfloat16':16s} ppl {results[domain, 'bfloat16'][0]:8.3f}  "
              f"last {TAIL} {results[domain, 'bfloat16'][1]:8.3f}", flush=True)
        for row in args.rows:
            start = time.monotonic()
            results[domain, row] = scores(*evaluate(args.model, row, ids), reference)
            ppl, tail, kl = results[domain, row]
            print(f"{domain:9s} {row:16s} ppl {ppl:8.3f}  last {TAIL} {tail:8.3f}  KL {kl:.4f}  "
                  f"({time.monotonic() - start:.0f} s)", flush=True)
        del nll, reference
    print_table(results, args)


def print_table(results, args) -> None:
    bf16 = bytes_per_token(args.model, "bfloat16", args.tokens)
    print(f"\n| kv_cache_dtype | bytes/token at {args.tokens} (staging incl.) | vs bf16 | "
          + " | ".join(f"{d}: ppl / last {TAIL} / KL vs bf16 cache" for d in args.domains) + " |")
    print("|---|---|---|" + "---|" * len(args.domains))
    for row in ["bfloat16", *args.rows]:
        nbytes = bytes_per_token(args.model, row, args.tokens)
        cells = []
        for domain in args.domains:
            ppl, tail, kl = results[domain, row]
            base, base_tail, _ = results[domain, "bfloat16"]
            cells.append(f"{100 * (ppl / base - 1):+.2f}% / {100 * (tail / base_tail - 1):+.2f}% / {kl:.4f}"
                         if row != "bfloat16" else f"{ppl:.3f} / {tail:.3f} / 0")
        print(f"| {row} | {nbytes:.0f} | {bf16 / nbytes:.2f}x | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
