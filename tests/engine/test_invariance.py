"""Float32 greedy output does not depend on batch, prefill chunk size, prefix hits or preemption."""
from __future__ import annotations

import logging

import pytest

from slipstream import LLM, SamplingParams
from tests.conftest import random_prompts

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # K+V, 2 layers, 2 KV heads, dim 16, fp32, 16 tokens


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, 5, 60, seed=7)


@pytest.fixture(scope="module")
def alone(tiny_llama, prompts):
    llm = LLM(tiny_llama, dtype="float32")
    return [_tokens(llm.generate([p], PARAMS, use_tqdm=False))[0] for p in prompts]


def test_batch_equals_alone(tiny_llama, prompts, alone):
    llm = LLM(tiny_llama, dtype="float32")
    assert _tokens(llm.generate(prompts, PARAMS, use_tqdm=False)) == alone


@pytest.mark.parametrize("budget", [1, 7, 16])
def test_chunked_prefill_equals_alone(tiny_llama, prompts, alone, budget):
    llm = LLM(tiny_llama, dtype="float32", max_num_batched_tokens=budget)
    assert _tokens(llm.generate(prompts, PARAMS, use_tqdm=False)) == alone


def test_preemption_equals_alone(tiny_llama, prompts, alone):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=8 * BLOCK_BYTES)
    assert llm.stats()["num_blocks"] == 8
    assert _tokens(llm.generate(prompts, PARAMS, use_tqdm=False)) == alone
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0  # the prompts share nothing: only resumed sequences hit
    assert stats["num_used_blocks"] == 0


def test_periodic_stats_line(tiny_llama, prompts, caplog):
    llm = LLM(tiny_llama, dtype="float32", log_stats_interval=0.0)
    logger = logging.getLogger("slipstream")
    with caplog.at_level("INFO", logger="slipstream"):
        logger.propagate = True  # let pytest's handler see the records
        try:
            llm.generate(prompts[:2], PARAMS, use_tqdm=False)
        finally:
            logger.propagate = False
    lines = [r.getMessage() for r in caplog.records if "KV usage" in r.getMessage()]
    assert lines and "prefix hit rate" in lines[0] and "fragmentation" in lines[0]


def test_prefix_cache_hits_equal_alone(tiny_llama, prompts, alone):
    llm = LLM(tiny_llama, dtype="float32")
    llm.generate(prompts, PARAMS, use_tqdm=False)  # warms the prefix cache
    assert _tokens(llm.generate(prompts, PARAMS, use_tqdm=False)) == alone
    assert llm.stats()["prefix_cache_hits"] > 0
