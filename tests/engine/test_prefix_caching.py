"""Automatic prefix caching: sharing, eviction order, collisions, salts, aborts, multi-turn reuse."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.config import EngineConfig
from slipstream.engine.block_manager import BlockManager
from slipstream.engine.engine import LLMEngine
from slipstream.engine.sequence import Sequence
from slipstream.outputs import RequestMetrics
from slipstream.sampling_params import SamplingParams
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BS = 16


def make_engine(path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=path, dtype="float32", **kwargs))


def run(engine: LLMEngine, prompts, params=GREEDY, salt=None) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"q{id(prompts)}-{i}", p, params, cache_salt=salt)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"q{id(prompts)}-{i}"] for i in range(len(prompts))]


def seq_of(engine: LLMEngine, request_id: str) -> Sequence:
    return engine.requests[request_id].seqs[0]


@pytest.fixture(scope="module")
def prefix():
    return random_prompts(1, 2 * BS, 2 * BS, seed=3)[0]  # exactly two full blocks


def test_second_request_shares_exactly_the_prefix_blocks(tiny_llama, prefix):
    engine = make_engine(tiny_llama)
    a = prefix + [5, 6, 7, 8, 9]
    b = prefix + [10, 11, 12]
    engine.add_request("a", a, GREEDY)
    engine.step()  # a's prompt is computed and its two full blocks registered
    engine.add_request("b", b, GREEDY)
    engine.step()
    sa, sb = seq_of(engine, "a"), seq_of(engine, "b")
    assert sb.block_table[:2] == sa.block_table[:2]
    assert sb.block_table[2] != sa.block_table[2]
    assert [engine.block_manager.blocks[i].ref_count for i in sb.block_table[:2]] == [2, 2]
    assert sb.num_cached_tokens == 2 * BS
    while engine.has_unfinished_requests():
        engine.step()
    assert run(make_engine(tiny_llama), [b]) == run(make_engine(tiny_llama, enable_prefix_caching=False), [b])


def test_partial_blocks_are_not_shared_and_last_token_is_computed(tiny_llama, prefix):
    engine = make_engine(tiny_llama)
    run(engine, [prefix])
    engine.add_request("same", prefix, GREEDY)  # identical 2-block prompt: only block 0 may be reused
    engine.step()
    assert seq_of(engine, "same").num_cached_tokens == BS
    engine.add_request("partial", prefix[:BS + 5], GREEDY)  # the partial second block is never shared
    engine.step()
    assert seq_of(engine, "partial").num_cached_tokens == BS


def _seq(tokens, salt=None) -> Sequence:
    return Sequence("x", tokens, GREEDY, RequestMetrics(0.0), cache_salt=salt)


def _fill(bm: BlockManager, seq: Sequence) -> None:
    bm.allocate(seq, bm.find_cached_prefix(seq), seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_eviction_takes_least_recently_freed_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    old, new = _seq([1, 2, 3, 4, 9]), _seq([5, 6, 7, 8, 9])  # 3 blocks each, 2 of them full
    _fill(bm, old)
    _fill(bm, new)
    bm.free(old)   # old's blocks are freed first ...
    bm.free(new)   # ... so they are evicted first
    _fill(bm, _seq([11, 12, 13, 14, 15]))  # needs 3 blocks: exactly old's
    assert bm.find_cached_prefix(_seq([1, 2, 3, 4, 9])) == []
    assert len(bm.find_cached_prefix(_seq([5, 6, 7, 8, 9]))) == 2


def test_a_stale_head_is_computed_again_into_fresh_blocks_and_the_rest_shared():
    bm = BlockManager(num_blocks=8, block_size=2, stale_head=lambda hits: 1)
    first = _seq([1, 2, 3, 4, 5, 6, 7])
    _fill(bm, first)  # nothing cached yet: blocks 0-3
    again = _seq([1, 2, 3, 4, 5, 6, 7])
    hits = bm.find_cached_prefix(again)
    assert hits == [None, first.block_table[1], first.block_table[2]]
    assert bm.can_allocate(again, hits, 1) and bm.num_free_blocks == 4
    assert bm.allocate(again, hits, 1) == 4  # room for the head and the token after the hit
    head = again.block_table[0]
    assert head not in first.block_table and again.block_table[1:3] == first.block_table[1:3]
    assert len(again.block_table) == 4 and bm.num_free_blocks == 2
    assert (again.num_computed_tokens, again.num_schedulable_tokens) == (0, 2)
    again.advance(1)
    assert (again.num_computed_tokens, again.num_schedulable_tokens) == (1, 1)
    again.advance(1)  # the head is done: the cached tokens after it count too
    assert (again.num_computed_tokens, again.num_schedulable_tokens, again.cached_gap) == (6, 1, None)
    bm.cache_full_blocks(again)
    assert bm.blocks[head].hash is None  # the cached head stays the one later hits find
    assert bm.find_cached_prefix(_seq([1, 2, 3, 4, 5, 6, 7])) == hits
    bm.stale_head = lambda hits: len(hits)  # a hit that is all head gains nothing
    assert bm.find_cached_prefix(_seq([1, 2, 3, 4, 5, 6, 7])) == []
    bm.free(again)
    bm.free(first)
    assert bm.num_free_blocks == bm.num_blocks


def test_forced_hash_collision_never_returns_wrong_blocks(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.block_manager.hash_fn = lambda parent, tokens, salt: b"same-hash-for-everything"
    prompts = random_prompts(4, 40, 60, seed=11)
    got = run(engine, prompts)
    assert run(engine, prompts) == got  # second pass meets only colliding keys
    assert got == run(make_engine(tiny_llama, enable_prefix_caching=False), prompts)


def test_cache_salt_isolates_tenants():
    bm = BlockManager(num_blocks=8, block_size=2)
    _fill(bm, _seq([1, 2, 3, 4, 5], salt="tenant-a"))
    assert bm.find_cached_prefix(_seq([1, 2, 3, 4, 5], salt="tenant-b")) == []
    assert bm.find_cached_prefix(_seq([1, 2, 3, 4, 5])) == []
    assert len(bm.find_cached_prefix(_seq([1, 2, 3, 4, 5], salt="tenant-a"))) == 2


def test_abort_of_a_sharing_request_leaves_the_other_intact(tiny_llama, prefix):
    engine = make_engine(tiny_llama)
    expected = run(make_engine(tiny_llama, enable_prefix_caching=False), [prefix + [20, 21]])
    engine.add_request("a", prefix + [30, 31], GREEDY)
    engine.step()
    engine.add_request("b", prefix + [20, 21], GREEDY)
    engine.step()
    shared = seq_of(engine, "b").block_table[:2]
    engine.abort_request("a")
    assert [engine.block_manager.blocks[i].ref_count for i in shared] == [1, 1]
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    assert out.outputs[0].token_ids == expected[0]
    assert engine.stats()["num_used_blocks"] == 0


def test_multi_turn_reuses_decode_filled_blocks(tiny_llama):
    engine = make_engine(tiny_llama)
    first = random_prompts(1, 20, 20, seed=5)[0]
    answer = run(engine, [first], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    follow_up = first + answer + [40, 41, 42]  # 53 tokens: blocks 1-2 were filled during decode
    engine.add_request("turn2", follow_up, GREEDY)
    engine.step()
    assert seq_of(engine, "turn2").num_cached_tokens == 3 * BS


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40)), min_size=1, max_size=8))
def test_random_workloads_equal_caching_off(tiny_llama, cached_engine, uncached_engine, spec):
    bases = random_prompts(3, 40, 40, seed=9)
    prompts = [bases[family][:length] + [7] for family, length in spec]
    assert run(cached_engine, prompts) == run(uncached_engine, prompts)
    bm = cached_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40)), min_size=1, max_size=8), st.integers(1, 4))
def test_random_workloads_whose_hits_compute_their_head_again_equal_caching_off(cached_engine, uncached_engine,
                                                                                 spec, stale):
    """Every hit's first `stale` blocks computed again (as a TurboQuant cache asks once its sinks lost their
    16-bit copy), under chunking and preemption: the same tokens, and every block back."""
    bases = random_prompts(3, 40, 40, seed=9)
    prompts = [bases[family][:length] + [7] for family, length in spec]
    bm = cached_engine.block_manager
    bm.stale_head = lambda hits: stale
    try:
        assert run(cached_engine, prompts) == run(uncached_engine, prompts)
    finally:
        bm.stale_head = lambda hits: 0
    assert bm.num_free_blocks == bm.num_blocks


@pytest.fixture(scope="module")
def cached_engine(tiny_llama):
    return make_engine(tiny_llama, block_size=4, kv_cache_memory=40 * 2048, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def uncached_engine(tiny_llama):
    return make_engine(tiny_llama, enable_prefix_caching=False)
