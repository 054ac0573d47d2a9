"""Speculative decoding in the engine: float32 greedy outputs equal the non-speculative run.

Two proposers feed the real verifier: the n-gram proposer, and an oracle that proposes the
reference continuation with deliberate errors (a random model rarely repeats itself, so
n-gram proposals are mostly rejected; the oracle makes long accepted runs, rejections at
every offset and stops inside accepted drafts happen). The block-accounting invariants are
checked after every step, and no sequence ever keeps a block its tokens do not reach.
"""
from __future__ import annotations

import pytest

from slipstream import LLM, SamplingParams
from slipstream.speculative import speculator
from slipstream.speculative.ngram import StatelessProposer
from tests.conftest import TINY_VOCAB, random_prompts
from tests.engine.test_block_accounting import check_invariants

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4  # K+V, 2 layers, 2 KV heads, dim 16, fp32, block_size 4


class Oracle(StatelessProposer):
    """Proposes the continuation of the first reference the sequence follows, one draft in three
    with one token wrong; nothing where it follows none."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]]):
        self.references = [p + o for p, o in zip(prompts, outputs)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        n = len(token_ids)
        full = next((f for f in self.references if f[:n] == token_ids), [])
        drafts = full[n:n + k]
        if drafts and n % 3 == 0:
            wrong = n % len(drafts)
            drafts[wrong] = (drafts[wrong] + 1) % TINY_VOCAB
        return drafts


def generate(llm: LLM, prompts, params) -> list[list[int]]:
    """(tokens, finish reason) per prompt, stepping the engine and checking its blocks after every step."""
    engine = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        check_invariants(engine)
        bm = engine.block_manager
        assert all(len(s.block_table) <= bm.blocks_for(s.num_tokens) for s in engine.scheduler.running)
    assert engine.block_manager.num_used_blocks == 0
    return [(done[f"r{i}"].outputs[0].token_ids, done[f"r{i}"].outputs[0].finish_reason) for i in range(len(prompts))]


def cached_prefixes(bm) -> list[list[int]]:
    """For every block in the prefix cache, the tokens from its sequence's start to its end."""
    prefixes = []
    for block in bm.blocks:
        if block.hash is not None:
            chain = [block]
            while chain[-1].parent_id is not None:
                chain.append(bm.blocks[chain[-1].parent_id])
            prefixes.append([t for b in reversed(chain) for t in b.token_ids])
    return prefixes


FREE = ((10**6, (0.0,) * 4),)  # verification costs nothing: every step verifies every draft, at any batch


@pytest.fixture(autouse=True)
def always_speculate(monkeypatch):
    """Drafts every step: the cost rule would turn off most of a random model's."""
    monkeypatch.setattr(speculator, "VERIFY_COST", FREE)


@pytest.fixture(scope="module")
def prompts():
    # some repeat themselves, so n-gram proposals also come from the prompts
    return random_prompts(5, 3, 40, seed=11) + [[5, 6, 7, 8] * 6, [9, 10] * 13 + [11]]


def _reference(path, prompts, params, **kwargs) -> list[tuple[list[int], str]]:
    return generate(LLM(path, dtype="float32", **kwargs), prompts, params)


def _speculative(path, prompts, oracle: bool, reference=None, **kwargs) -> LLM:
    llm = LLM(path, dtype="float32", speculative_config=NGRAM, **kwargs)
    if oracle:
        llm.engine.speculator.proposer = Oracle(prompts, [tokens for tokens, _ in reference])
    return llm


SMALL = {"block_size": 4, "kv_cache_memory": 200 * BLOCK_BYTES}  # checking every block each step stays cheap
SETTINGS = {
    "mixed-batch": SMALL,
    "chunked-prefill": {**SMALL, "max_num_batched_tokens": 7},
    "preemption": {**SMALL, "kv_cache_memory": 24 * BLOCK_BYTES, "max_num_batched_tokens": 64},
    "tq3-cache": {**SMALL, "kv_cache_dtype": "tq3-codes"},
    "tq3-recent-window": {**SMALL, "kv_cache_dtype": "tq3", "kv_cache_recent_tokens": 8, "kv_cache_sink_tokens": 3},
}


@pytest.mark.parametrize("oracle", [True, False], ids=["oracle", "ngram"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_greedy_tokens_equal_the_non_speculative_run(tiny_llama, prompts, setting, oracle):
    kwargs = SETTINGS[setting]
    reference = _reference(tiny_llama, prompts, GREEDY, **kwargs)
    llm = _speculative(tiny_llama, prompts, oracle, reference, **kwargs)
    assert generate(llm, prompts, GREEDY) == reference
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > (40 if oracle else 0)
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]  # rejections too
    if setting == "preemption":
        assert stats["num_preemptions"] > 0


def test_prefix_cache_hits_register_only_accepted_tokens(tiny_llama, prompts):
    reference = _reference(tiny_llama, prompts, GREEDY, **SMALL)
    llm = _speculative(tiny_llama, prompts, True, reference, **SMALL)
    generate(llm, prompts, GREEDY)
    for tokens in cached_prefixes(llm.engine.block_manager):  # each holds a reference sequence's tokens
        assert any((p + o)[:len(tokens)] == tokens for p, (o, _) in zip(prompts, reference))
    hits_before = llm.stats()["prefix_cache_hits"]
    follow_ups = [p + o for p, (o, _) in zip(prompts, reference)]  # a second turn reuses decode-filled blocks
    expected = _reference(tiny_llama, follow_ups, GREEDY, **SMALL)
    llm.engine.speculator.proposer = Oracle(follow_ups, [tokens for tokens, _ in expected])
    assert generate(llm, follow_ups, GREEDY) == expected
    assert llm.stats()["prefix_cache_hits"] > hits_before


def test_stops_apply_to_accepted_tokens_as_without_speculation(tiny_llama, prompts):
    """max_tokens, stop_token_ids, EOS, min_tokens and penalties: the first token that stops a
    sequence ends it, and the drafts accepted after it are dropped."""
    free = [tokens for tokens, _ in _reference(tiny_llama, prompts, GREEDY, **SMALL)]
    params = [SamplingParams(temperature=0, max_tokens=3 + i) for i in range(len(prompts))]
    params[0] = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[free[0][7]])
    params[1] = SamplingParams(temperature=0, max_tokens=30, min_tokens=12, stop_token_ids=[free[1][4]])
    params[2] = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3,
                               presence_penalty=0.5)
    reference = _reference(tiny_llama, prompts, params, **SMALL)
    llm = LLM(tiny_llama, dtype="float32", speculative_config=NGRAM, **SMALL)
    # the free run's drafts run past every stop; where a sequence leaves it, its own reference goes on
    llm.engine.speculator.proposer = Oracle(prompts * 2, free + [tokens for tokens, _ in reference])
    assert generate(llm, prompts, params) == reference
    assert reference[0][1] == "stop" and reference[1][1] in ("stop", "length") and len(reference[1][0]) >= 12
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 20


def test_logprobs_of_accepted_tokens_equal_the_non_speculative_run(tiny_llama, prompts):
    """Each token's logprob and its top alternatives come from the position that verified it,
    as the plain decode step would have computed them (float32: equal within 1e-4)."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    plain = LLM(tiny_llama, dtype="float32", **SMALL).generate(prompts, params, use_tqdm=False)
    reference = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in plain]
    llm = _speculative(tiny_llama, prompts, True, reference, **SMALL)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 40
    for ours, ref in zip(outs, plain):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        for mine, theirs in zip(ours.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            assert mine.keys() == theirs.keys()
            for token, entry in mine.items():
                assert abs(entry.logprob - theirs[token].logprob) < 1e-4 and entry.rank == theirs[token].rank
        assert ours.outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-3)


def test_verifying_rows_run_as_decode_rows(tiny_llama, prompts):
    """A sequence's last token and its drafts reach the model as single-token rows over the same
    block table, one context longer each: the step is all decodes (the fused stack's kind)."""
    reference = _reference(tiny_llama, prompts, GREEDY, **SMALL)
    llm = _speculative(tiny_llama, prompts, True, reference, **SMALL)
    batch, steps = llm.engine.runner.input_batch, []
    prepare = batch.prepare

    def recorded(rows):
        input_ids, positions, meta = prepare(rows)
        steps.append((meta.num_decodes, list(meta.context_lens), meta.block_table.tolist(), positions.tolist()))
        return input_ids, positions, meta

    batch.prepare = recorded
    assert generate(llm, prompts, GREEDY) == reference
    verifying = [s for s in steps if len(s[1]) > len({tuple(t) for t in s[2]})]  # rows sharing a table
    all_decode = [s for s in verifying if s[0] == len(s[1])]  # the others also carry a prefill chunk
    assert len(verifying) >= 5 and all_decode
    for _, lens, _, positions in all_decode:
        assert positions == [n - 1 for n in lens]
