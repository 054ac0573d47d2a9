"""slipstream vs transformers vs llama.cpp on one model, one run, same threads.

Figures (tokens/s, median of --repeats):
- decode, 1 stream: a 32-token prompt, then --decode-tokens greedy tokens; time after the
  first token only. Roofline: measured read bandwidth / bytes of weights read per step.
- prefill, 512 tokens: one prompt, time to its first token.
- decode at batch 8 and 32: as above with B prompts decoding together.
- offline throughput: the engine-core workload (benchmarks/throughput.py), output tok/s.

transformers runs a hand-written greedy loop over its own KV cache (bf16 like us);
llama.cpp (`pip install -e '.[peers]'`, see the README) runs the same GGUF file in its
own weight format (Q4_1 for SmolLM2), through its low-level batch API, one sequence id
per stream; offline throughput runs its requests one after another, as llama-cpp-python
serves them. Each --quantization adds a slipstream column with that weight format (`gguf`, on by
default: the file's blocks as stored, the engine's default for a quantized GGUF; the plain slipstream
column asks for bf16 and so widens them);
--deterministic adds, for each, a column with batch invariance set the other way from the
backend's default (`det`: deterministic=True, `nondet`: False) and prints its cost as ratios.

    python benchmarks/compare.py [--model smollm2-135m] [--threads 2] [--quantization gguf int4 w8a8] [--deterministic]
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import numpy as np
import torch

from slipstream import LLM, SamplingParams
from slipstream.layers.linear import Linear
from throughput import load_reference, run_slipstream, run_transformers, workload

PROMPT_LEN = 32
PREFILL_LEN = 512
BATCHES = (8, 32)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


# --- slipstream ------------------------------------------------------------------------
class Slipstream:
    name = "slipstream"

    def __init__(self, llm: LLM):
        self.llm = llm

    def prefill(self, prompt: list[int]) -> float:
        out = self.llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
        return len(prompt) / out.metrics.ttft

    def decode(self, prompts: list[list[int]], steps: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return len(prompts) / statistics.mean(o.metrics.tpot for o in outs)


# --- transformers ----------------------------------------------------------------------
class Transformers:
    name = "transformers"

    def __init__(self, model):
        self.model = model

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        self.model(torch.tensor([prompt]), logits_to_keep=1)
        return len(prompt) / (time.perf_counter() - start)

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], steps: int) -> float:
        out = self.model(torch.tensor(prompts), use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(steps):
            out = self.model(token, cache=out.cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        return len(prompts) * steps / (time.perf_counter() - start)


# --- llama.cpp -------------------------------------------------------------------------
class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path: str, threads: int, max_seqs: int, max_tokens: int):
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=PREFILL_LEN, verbose=False)
        # the high-level Llama serves one sequence; batched decode needs a context of our own
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified = max_seqs * max_tokens, max_seqs, True
        params.n_batch = params.n_ubatch = PREFILL_LEN
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.llm.model, params)
        self.n_vocab = self.llm.n_vocab()
        self.batch = llama_cpp.llama_batch_init(max(PREFILL_LEN, max_seqs * max_tokens), 0, max_seqs)

    def _clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence id, wants logits)."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = token, pos, 1, seq, logits
        b.n_tokens = len(entries)
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, row: int) -> int:
        logits = self.lib.llama_get_logits_ith(self.ctx, row)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def prefill(self, prompt: list[int]) -> float:
        self._clear()
        start = time.perf_counter()
        self._decode([(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)])
        self._argmax(-1)
        return len(prompt) / (time.perf_counter() - start)

    def decode(self, prompts: list[list[int]], steps: int) -> float:
        self._clear()
        for seq, prompt in enumerate(prompts):
            self._decode([(t, p, seq, p == len(prompt) - 1) for p, t in enumerate(prompt)])
        tokens = [self._argmax(-1)] * len(prompts)
        start = time.perf_counter()
        for step in range(steps):
            pos = len(prompts[0]) + step
            self._decode([(t, pos, seq, True) for seq, t in enumerate(tokens)])
            tokens = [self._argmax(i) for i in range(len(prompts))]
        return len(prompts) * steps / (time.perf_counter() - start)

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> float:
        """The offline workload one request at a time, as llama-cpp-python serves it."""
        start = time.perf_counter()
        for prompt, n in zip(prompts, output_lens):
            self._clear()
            self._decode([(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)])
            token = self._argmax(-1)
            for pos in range(len(prompt), len(prompt) + n - 1):
                self._decode([(token, pos, 0, True)])
                token = self._argmax(-1)
        return sum(output_lens) / (time.perf_counter() - start)


# --- roofline --------------------------------------------------------------------------
def read_bandwidth() -> float:
    """Bytes/s for summing a 1 GiB tensor (best of 5), with the benchmark's threads."""
    x = torch.ones(256 * 1024**2)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every linear layer in its stored format.

    Embedding rows (one per token) and norms are negligible; a tied LM head is a Linear
    over the embedding table, so the table is counted once, as the head.
    """
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    return sum(t.numel() * t.element_size() for m in layers for t in _read_by(m))


def _read_by(layer: Linear) -> list[torch.Tensor]:
    """What a decode step's GEMM reads of a layer: the native kernels' packed copy where the
    layer has one, else PyTorch's layout (int4's plain nibbles serve prefill only)."""
    fmt = layer.method.name
    if fmt == "int4":
        native = hasattr(layer, "packed_zero")
        return [layer.packed, layer.packed_scale, layer.packed_zero] if native else [layer.qweight, layer.scales_and_zeros]
    if fmt == "int8":
        return [layer.packed, layer.scale_f32] if hasattr(layer, "scale_f32") else [layer.qweight, layer.scale]
    if fmt == "w8a8":
        return [layer.qweight, layer.scale]
    if fmt == "gguf":  # the file's blocks, or Q4 repacked: whichever the layer holds
        return list(layer.buffers(recurse=False))
    return [layer.weight]


# --- main ------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", nargs="*", default=["gguf"], choices=["int8", "int4", "w8a8", "gguf"],
                        help="also measure slipstream with these weight formats")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=32, help="offline throughput workload size")
    parser.add_argument("--skip", nargs="*", default=[], choices=["transformers", "llama.cpp", "throughput"])
    parser.add_argument("--deterministic", action="store_true",
                        help="also measure each slipstream column with batch invariance the other way")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    ours = [_slipstream(args.model, q) for q in [None, *args.quantization]]
    pairs = []  # (deterministic, not) columns of one weight format
    if args.deterministic:
        for default in list(ours):
            other = _slipstream(args.model, default.quantization, not default.llm.engine.backend.batch_invariant)
            ours.append(other)
            pairs.append((other, default) if other.deterministic else (default, other))
    path, vocab = ours[0].llm.engine.model_path, ours[0].llm.engine.model_config.vocab_size
    peers = []
    if "transformers" not in args.skip:
        peers.append(Transformers(load_reference(path, torch.bfloat16)))
    if "llama.cpp" not in args.skip:
        peers += _llama_cpp(path, args)

    print(f"model {args.model}, bf16, {args.threads} threads, median of {args.repeats} (peers interleaved)")
    rows = measure(ours + peers, args, vocab)
    if "throughput" not in args.skip:
        rows["offline throughput"] = throughput(ours + peers, args, vocab)
    report(rows, ours, peers)
    bandwidth = read_bandwidth()  # after the timed rows: its 1 GiB, freshly mapped, slowed the decode that followed
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    if pairs:
        report(rows, [a for a, _ in pairs], [b for _, b in pairs], zip_pairs=True)
    for peer in ours:
        weights = weight_bytes_per_step(peer.llm.engine.runner.model)
        roofline = bandwidth / weights
        print(f"{peer.name}: single-stream roofline {bandwidth / 1e9:.1f} GB/s / {weights / 1e6:.0f} MB of weights "
              f"per step = {roofline:.0f} tok/s; reached {rows['decode, 1 stream'][peer.name] / roofline:.0%}")


def _slipstream(model: str, quantization: str | None, deterministic: bool | None = None) -> Slipstream:
    peer = Slipstream(LLM(model, dtype="bfloat16", quantization=quantization, max_num_seqs=max(BATCHES),
                          enable_prefix_caching=False, deterministic=deterministic))
    peer.quantization, peer.deterministic = quantization, peer.llm.engine.backend.batch_invariant
    setting = "" if deterministic is None else " det" if deterministic else " nondet"
    peer.name = "slipstream" + (f" {quantization}" if quantization else "") + setting
    return peer


def _llama_cpp(path: str, args) -> list[LlamaCpp]:
    try:
        return [LlamaCpp(path, args.threads, max(BATCHES), PROMPT_LEN + args.decode_tokens + 1)]
    except ImportError:
        print("llama-cpp-python is not installed: llama.cpp column skipped (see README, Performance)")
        return []


def measure(peers, args, vocab: int) -> dict[str, dict[str, float]]:
    workloads = {
        "decode, 1 stream": lambda peer, i: peer.decode(random_prompts(1, PROMPT_LEN, vocab, i), args.decode_tokens),
        "prefill, 512 tokens": lambda peer, i: peer.prefill(random_prompts(1, PREFILL_LEN, vocab, 100 + i)[0]),
        **{f"decode, batch {b}": (lambda peer, i, b=b: peer.decode(random_prompts(b, PROMPT_LEN, vocab, 200 + i),
                                                                   args.decode_tokens)) for b in BATCHES},
    }
    for peer in peers:
        peer.decode(random_prompts(1, PROMPT_LEN, vocab, 99), 4)  # warm-up
    rows = {}
    for row, run in workloads.items():
        samples = {peer.name: [] for peer in peers}
        for i in range(args.repeats):
            for peer in peers:
                samples[peer.name].append(run(peer, i))
        rows[row] = {name: statistics.median(values) for name, values in samples.items()}
        print(f"{row}: " + ", ".join(f"{n} {v:.1f}" for n, v in rows[row].items()), file=sys.stderr, flush=True)
    return rows


def throughput(peers, args, vocab: int) -> dict[str, float]:
    prompts, output_lens = workload(args.num_prompts, vocab)
    total = sum(output_lens)
    results = {}
    for peer in peers:
        if isinstance(peer, Slipstream):
            results[peer.name] = total / run_slipstream(peer.llm, prompts, output_lens)
        elif isinstance(peer, Transformers):
            results[peer.name] = total / run_transformers(peer.model, prompts, output_lens, batch_size=16)
        elif isinstance(peer, LlamaCpp):
            results[peer.name] = peer.generate(prompts, output_lens)
    return results


def report(rows: dict[str, dict[str, float]], ours: list, peers: list, zip_pairs: bool = False) -> None:
    """The figures of every column, then each of ours over each peer (zip_pairs: ours[i] over peers[i] only)."""
    names = [p.name for p in ours + peers]
    ratios = [(a.name, b.name) for a, b in (zip(ours, peers) if zip_pairs else itertools.product(ours, peers))]
    if not zip_pairs:
        print(f"{'tok/s':22s}" + "".join(f"{n:>20s}" for n in names))
        for row, figures in rows.items():
            print(f"{row:22s}" + "".join(f"{figures[n]:20.1f}" for n in names))
    if not ratios:
        return
    width = max(len(a) + len(b) for a, b in ratios) + 5
    print(f"\n{'ratio':22s}" + "".join(f"{a + ' / ' + b:>{width}s}" for a, b in ratios))
    for row, figures in rows.items():
        print(f"{row:22s}" + "".join(f"{figures[a] / figures[b]:{width - 1}.2f}x" for a, b in ratios))


if __name__ == "__main__":
    main()
