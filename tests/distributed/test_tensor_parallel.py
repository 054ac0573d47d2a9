"""Tensor parallelism on CPU over real gloo process groups: TP=2 (one thread per rank) against
TP=1 on the same weights, float32, greedy, with chunked prefill, prefix caching and preemption
all happening; start-up refusals; and no worker outliving its engine."""
from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
import torch

from slipstream import LLM, SamplingParams, cli
from slipstream.loader.hf_config import read_hf_config
from slipstream.loader.tokenizer import load_tokenizer
from slipstream.models.registry import config_from_hf
from tests.conftest import build_tiny_checkpoint, random_prompts
from tests.models.test_gemma3 import build_tiny_gemma3
from tests.models.test_moe_families import build_moe_checkpoint

LOGPROB_TOL = 1e-4  # float32, the same kernels on split weights: observed max |diff| ~2e-6
BLOCK_SIZE = 4
NUM_BLOCKS = 40  # 160 tokens for 6 sequences of up to 50: some are preempted

BUILDERS = {
    # 383 does not divide by 2: the last rank's vocabulary rows are padded
    "llama_gqa_odd_vocab": lambda path: build_tiny_checkpoint(path, "llama", num_kv_heads=2, vocab_size=383),
    "llama_mqa": lambda path: build_tiny_checkpoint(path, "llama", num_kv_heads=1),  # the KV head copied
    # 3 GQA groups on 2 ranks: 2 and 1, as SmolLM2's
    "llama_uneven_groups": lambda path: build_tiny_checkpoint(path, "llama", num_kv_heads=3, num_attention_heads=6,
                                                              hidden_size=96),
    "qwen3": lambda path: build_tiny_checkpoint(path, "qwen3", num_kv_heads=2),
    "mixtral": lambda path: build_moe_checkpoint(path, "mixtral"),
    "qwen2_moe": lambda path: build_moe_checkpoint(path, "qwen2_moe"),  # with a shared expert
    "gemma3": lambda path: build_tiny_gemma3(path),  # one KV head, sliding windows
}


def _prompts(vocab: int) -> list[list[int]]:
    shared = random_prompts(1, 24, 24, seed=7, vocab=vocab)[0]  # a prefix two prompts share: cache hits
    rest = random_prompts(4, 10, 40, seed=3, vocab=vocab)
    return [shared + [5, 6, 7], shared + [8, 9], *rest]


def _run(path: str, tp: int, kv_heads_per_rank: int, head_bytes: int, prompts, num_blocks: int = NUM_BLOCKS,
         **kwargs) -> tuple[list, dict]:
    memory = num_blocks * BLOCK_SIZE * kv_heads_per_rank * head_bytes
    llm = LLM(path, dtype="float32", tensor_parallel_size=tp, block_size=BLOCK_SIZE, kv_cache_memory=memory,
              max_num_batched_tokens=16, max_num_seqs=6, **kwargs)  # 16: prompts run in chunks
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
        return llm.generate(prompts, params, use_tqdm=False), llm.stats()
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("family, expert_parallel", [(family, False) for family in BUILDERS] +
                         [("mixtral", True), ("qwen2_moe", True)])
def test_tp2_matches_tp1(family, expert_parallel, tmp_path):
    path = BUILDERS[family](str(tmp_path))
    config = config_from_hf(read_hf_config(path))
    # K and V, float32, every layer: rank 0 holds half the KV heads (rounded up), or a copy of the only one
    head_bytes = 2 * 4 * config.head_dim * config.num_hidden_layers
    kv = config.num_key_value_heads
    prompts = _prompts(config.vocab_size)
    single, single_stats = _run(path, 1, kv, head_bytes, prompts)
    split, split_stats = _run(path, 2, -(-kv // 2), head_bytes, prompts, enable_expert_parallel=expert_parallel)
    assert single_stats["num_blocks"] == split_stats["num_blocks"]
    assert single_stats["num_preemptions"] > 0 and single_stats["prefix_cache_hits"] > 0
    assert split_stats["num_preemptions"] == single_stats["num_preemptions"]
    assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in single]
    for a, b in zip(single, split):
        la, lb = (torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]) for o in (a, b))
        assert (la - lb).abs().max().item() < LOGPROB_TOL


def test_refuses_what_it_cannot_split(tmp_path):
    path = build_tiny_checkpoint(str(tmp_path), "llama", num_kv_heads=2)  # 4 query heads
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must be a multiple of num_key_value_heads=2"):
        LLM(path, dtype="float32", tensor_parallel_size=3)
    assert not multiprocessing.active_children()  # the workers it had started are gone
    with pytest.raises(ValueError, match="enable_expert_parallel=True splits experts over ranks"):
        LLM(path, enable_expert_parallel=True)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"tensor_parallel_size={bad!r} must be a positive integer"):
            LLM(path, tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="quantization='gguf' runs a GGUF file's blocks"):
        LLM(path, tensor_parallel_size=2, quantization="gguf")


def test_refuses_olmoe(tmp_path):
    path = build_moe_checkpoint(str(tmp_path), "olmoe")
    with pytest.raises(ValueError, match="does not support qk_norm over the whole projection"):
        LLM(path, dtype="float32", tensor_parallel_size=2)
    assert not multiprocessing.active_children()


def test_ngram_speculation_verifies_across_ranks(tiny_llama):
    """Verification rows (several queries per sequence) go through the split model as any other."""
    prompt = list(range(3, 384))  # every token the model can write is in the prompt: always a draft
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    expected = LLM(tiny_llama, dtype="float32").generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(tiny_llama, dtype="float32", tensor_parallel_size=2, speculative_config=spec)
    try:
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == expected
        assert llm.stats()["spec_decode_num_draft_tokens"] > 0
    finally:
        llm.engine.shutdown()


def test_shutdown_leaves_no_worker(tiny_llama):
    threads = torch.get_num_threads()
    llm = LLM(tiny_llama, dtype="float32", tensor_parallel_size=2)
    workers = llm.engine.parallel.workers
    assert [w.is_alive() for w in workers] == [True]
    assert torch.get_num_threads() == max(1, threads // 2)  # rank 0's share of the cores
    llm.engine.shutdown()
    assert [w.exitcode for w in workers] == [0]
    assert torch.get_num_threads() == threads  # the process has its threads back


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_smollm2_tp2_matches_tp1(smollm2_gguf, quantization):
    """SmolLM2's 9 query and 3 KV heads split 6 + 3 and 2 + 1, with chunks, cache hits and preemptions;
    as stored, its blocks split by rows (q/k/v, gate/up, the vocabulary) and along K in whole blocks
    (o and down: 288 and 768 columns, 9 and 24 blocks of 32)."""
    tokenizer = load_tokenizer(smollm2_gguf)
    shared = "You are a careful assistant. Answer briefly and cite the rule you used. Question: "
    texts = [shared + "what is 2 + 2?", shared + "which planet is largest?", "def fibonacci(n):\n    ",
             "The capital of France is", "Once upon a time, in a quiet village by the sea,", "import numpy as np\n"]
    prompts = [tokenizer(t).input_ids for t in texts]
    head_bytes = 2 * 4 * 64 * 30  # K and V, float32, 30 layers of 64-wide heads
    blocks = 20  # 80 tokens for prompts of 6-22 tokens and 12 more each
    single, single_stats = _run(smollm2_gguf, 1, 3, head_bytes, prompts, blocks, quantization=quantization)
    split, split_stats = _run(smollm2_gguf, 2, 2, head_bytes, prompts, blocks, quantization=quantization)
    assert single_stats["num_blocks"] == split_stats["num_blocks"]
    assert single_stats["num_preemptions"] > 0 and single_stats["prefix_cache_hits"] > 0
    assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in single]
    for a, b in zip(single, split):
        la, lb = (torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]) for o in (a, b))
        assert (la - lb).abs().max().item() < LOGPROB_TOL


def test_turboquant_cache_holds_each_ranks_heads(tiny_llama):
    """tq4 per head: each rank encodes and reads its own heads' codes, with no exchange."""
    prompts = _prompts(384)[:3]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = LLM(tiny_llama, dtype="float32", kv_cache_dtype="tq4")
    single = reference.generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_llama, dtype="float32", kv_cache_dtype="tq4", tensor_parallel_size=2)
    try:
        assert llm.engine.kv_cache.bytes_per_token * 2 == reference.engine.kv_cache.bytes_per_token
        split = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in single]


def test_a_hung_worker_ends_the_step_within_the_timeout(tiny_llama, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_TP_TIMEOUT", "1")  # shorter than a spawned rank's start-up, which waits longer
    llm = LLM(tiny_llama, dtype="float32", tensor_parallel_size=2)
    worker = llm.engine.parallel.workers[0]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        with pytest.raises(RuntimeError, match="hung for more than 1 s"):
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4), use_tqdm=False)
        assert not worker.is_alive()  # the engine stopped it
    finally:
        llm.engine.shutdown()


def test_info_shows_the_parallel_layout(capsys):
    cli.main(["info", "--tensor-parallel-size", "2"])
    out = capsys.readouterr().out
    assert "tensor parallel: 2 ranks (this process + spawned workers; " in out
