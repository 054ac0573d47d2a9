"""Block accounting under random add / step / abort sequences (hypothesis).

After every engine step: free + used = total, no ref count below 0, a block is in the free
queue exactly when its ref count is 0 and its ref count is the number of running sequences
holding it; once every request has finished or been aborted, every block is free (cached
blocks count as free).
"""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.config import EngineConfig
from slipstream.engine.engine import LLMEngine
from slipstream.sampling_params import SamplingParams

BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4  # tiny llama, fp32, block_size 4


def check_invariants(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    owners = {}
    for seq in engine.scheduler.running:
        assert len(set(seq.block_table)) == len(seq.block_table)
        for b in seq.block_table:
            owners[b] = owners.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count >= 0
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)
        assert block.ref_count == owners.get(block.block_id, 0)
    for h, block_id in bm.cached.items():
        assert bm.blocks[block_id].hash == h
    for seq in engine.scheduler.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0


def run_shared_prefix_workload(engine: LLMEngine) -> None:
    """Ten requests over five shared-prefix prompts, checking the invariants after every step."""
    prompts = [[3 + i % 40 for i in range(n)] for n in (20, 37, 45, 30, 52)]
    for i, p in enumerate(prompts * 2):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        check_invariants(engine)


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(0, 20)),
), min_size=1, max_size=30)


@pytest.fixture(scope="module", params=[True, False], ids=["prefix-caching", "no-prefix-caching"])
def engine(tiny_llama, request):
    config = EngineConfig.from_kwargs(model=tiny_llama, dtype="float32", block_size=4, kv_cache_memory=24 * BLOCK_BYTES,
                                      max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=request.param)
    return LLMEngine(config)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_random_workload_keeps_invariants(engine, ops):
    ids = itertools.count()
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, family = op
            prompt = [3 + (family * 7 + i) % 50 for i in range(length)]  # shared prefixes per family
            added.append(f"r{next(ids)}")
            engine.add_request(added[-1], prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
                check_invariants(engine)
        elif added:
            engine.abort_request(added[op[1] % len(added)])
            check_invariants(engine)
    while engine.has_unfinished_requests():
        engine.step()
        check_invariants(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.stats()["num_used_blocks"] == 0
