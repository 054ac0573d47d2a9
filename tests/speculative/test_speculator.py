"""When the engine speculates and what it reports: per-request acceptance in RequestOutput.metrics,
totals in llm.stats(); drafts pause after low recent acceptance, a step verifies the drafts of
the sequences that raise its expected tokens per step, only where that gains, never past
VERIFY_COST's batch sizes, and never under a grammar."""
from __future__ import annotations

import time

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.speculative import speculator
from slipstream.speculative.ngram import StatelessProposer
from tests.speculative.test_speculative_engine import FREE, NGRAM, SMALL, Oracle

PARAMS = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9, 10, 11]


class Always(StatelessProposer):
    """Proposes k copies of one token (a wrong one where the model does not produce it)."""

    def __init__(self, token: int):
        self.token = token

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        return [self.token] * k


def _run(tiny_llama, proposer, prompts=(PROMPT,), params=PARAMS):
    llm = LLM(tiny_llama, dtype="float32", speculative_config=NGRAM, **SMALL)
    llm.engine.speculator.proposer = proposer
    return llm, llm.generate(list(prompts), params, use_tqdm=False)


def test_acceptance_per_request_and_in_stats(tiny_llama):
    reference = LLM(tiny_llama, dtype="float32", **SMALL).generate([PROMPT], PARAMS, use_tqdm=False)[0]
    llm, (out,) = _run(tiny_llama, Oracle([PROMPT], [reference.outputs[0].token_ids]))
    m, stats = out.metrics, llm.stats()
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert m.num_drafts == stats["spec_decode_num_drafts"] > 0
    assert m.num_accepted_tokens == stats["spec_decode_num_accepted_tokens"] > 0
    assert m.acceptance_rate == m.num_accepted_tokens / m.num_draft_tokens == stats["spec_decode_acceptance_rate"]
    assert 1 < m.mean_accepted_length == 1 + m.num_accepted_tokens / m.num_drafts
    # every output token came from a prefill, a plain decode or a verification
    assert m.num_drafts + m.num_accepted_tokens < len(out.outputs[0].token_ids)
    assert reference.metrics.num_drafts == 0 and reference.metrics.acceptance_rate is None


def test_low_acceptance_pauses_drafts_for_a_while(tiny_llama):
    reference = LLM(tiny_llama, dtype="float32", **SMALL).generate([PROMPT], PARAMS, use_tqdm=False)[0]
    wrong = next(t for t in range(3, 384) if t not in reference.outputs[0].token_ids)
    _, (rejected,) = _run(tiny_llama, Always(wrong))
    assert rejected.metrics.num_accepted_tokens == 0
    # rejected verifications halve the mean (k=4: 4 -> 2 -> 1 -> 0.5) until a verification no longer
    # pays even alone: PAUSE_TOKENS tokens without, then as many more
    per_pause = next(n for n in range(1, 9) if 1 + 4 / 2**n <= speculator.verify_cost(1, 4))
    assert per_pause <= rejected.metrics.num_drafts <= per_pause * (1 + 60 // speculator.PAUSE_TOKENS)
    assert rejected.outputs[0].token_ids == reference.outputs[0].token_ids


def test_large_batches_do_not_speculate(tiny_llama, monkeypatch):
    monkeypatch.setattr(speculator, "VERIFY_COST", ((2, (0.0,) * 4),))
    llm, _ = _run(tiny_llama, Always(5), prompts=[PROMPT, PROMPT[:4], PROMPT[:5]],
                     params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert llm.stats()["spec_decode_num_drafts"] == 0
    monkeypatch.setattr(speculator, "VERIFY_COST", ((3, (0.0,) * 4),))
    llm.engine.speculator.proposer = Always(5)
    llm.generate([PROMPT, PROMPT[:4], PROMPT[:5]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    assert llm.stats()["spec_decode_num_drafts"] > 0


def _three_fresh_sequences(tiny_llama) -> tuple:
    engine = LLM(tiny_llama, dtype="float32", speculative_config=NGRAM, **SMALL).engine
    seqs = []
    for i, prompt in enumerate([PROMPT, PROMPT[:4], PROMPT[:5]]):
        engine.add_request(str(i), prompt, PARAMS)
        seqs.append(engine.scheduler.waiting[-1])
    engine.step()  # prefills
    engine.speculator.proposer = Always(5)
    return engine.speculator, seqs


def test_a_step_speculates_only_where_it_expects_to_gain(tiny_llama, monkeypatch):
    """Three rows at 2.5 decode steps once a row has a draft: 3 * 2.5 = 7.5 tokens needed; fresh sequences
    promise 1 + 4 each (15), two rows with drafts and one without 11, one row with drafts 7."""
    monkeypatch.setattr(speculator, "VERIFY_COST", ((3, (2.5,) * 4),))
    spec, seqs = _three_fresh_sequences(tiny_llama)
    assert len(spec.propose(seqs)) == 3
    seqs[2].spec_paused_until = 10**6
    assert len(spec.propose(seqs)) == 2
    seqs[1].spec_paused_until = 10**6
    assert spec.propose(seqs) == {}


def test_a_step_verifies_only_the_sequences_that_raise_its_rate(tiny_llama, monkeypatch):
    """Each draft costs a sixth of a decode step: 3 + 4 expected tokens for 1 + 4/6 steps (4.2 a step) beats
    3 plain, and adding two rows that expect half a token each for 8 drafts more (8 for 3 steps) does not."""
    monkeypatch.setattr(speculator, "VERIFY_COST", ((3, (1.5, 2.0, 2.5, 3.0)),))
    spec, seqs = _three_fresh_sequences(tiny_llama)
    seqs[1].spec_accepted = seqs[2].spec_accepted = 0.5
    assert list(spec.propose(seqs)) == [seqs[0]]
    seqs[1].spec_accepted = seqs[2].spec_accepted = 3.0
    assert len(spec.propose(seqs)) == 3


def test_a_probe_proposes_for_one_sequence(tiny_llama, monkeypatch):
    """After PROBE_STEPS steps without drafts a step speculates anyway, with its most promising sequence
    alone (a draft model's probe prefills one prompt on the draft, not all of them)."""
    monkeypatch.setattr(speculator, "VERIFY_COST", ((3, (9.0,) * 4),))  # never pays
    spec, seqs = _three_fresh_sequences(tiny_llama)
    seqs[0].spec_accepted, seqs[1].spec_accepted, seqs[2].spec_accepted = 1.0, 3.0, 0.5
    asked = []
    propose = spec.proposer.propose
    monkeypatch.setattr(spec.proposer, "propose", lambda seqs, ks: (asked.append(list(seqs)), propose(seqs, ks))[1])
    spec._idle.clear()  # the prefill step counted as one without drafts
    for _ in range(speculator.PROBE_STEPS):
        assert spec.propose(seqs) == {}
    assert asked == [] and list(spec.propose(seqs)) == [seqs[1]] == asked[0]


def test_verify_cost_interpolates_in_rows_and_drafts(monkeypatch):
    monkeypatch.setattr(speculator, "VERIFY_COST", ((1, (1.1, 1.2, 1.3, 1.4)), (3, (1.3, 1.6, 1.9, 2.2))))
    assert speculator.verify_cost(1, 2) == pytest.approx(1.2)
    assert speculator.verify_cost(3, 3) == pytest.approx(1.3)  # one draft per row
    assert speculator.verify_cost(2, 4) == pytest.approx((1.2 + 1.6) / 2)  # two per row, between 1 and 3 rows
    assert speculator.verify_cost(1, 6) == pytest.approx(1.6)  # past the last column along its slope
    assert speculator.verify_cost(3, 0) == 1.0 and speculator.verify_cost(4, 1) is None


def test_grammar_requests_do_not_speculate(tiny_with_tokenizer, monkeypatch):
    monkeypatch.setattr(speculator, "VERIFY_COST", FREE)
    llm = LLM(tiny_with_tokenizer, dtype="float32", speculative_config=NGRAM)
    llm.engine.speculator.proposer = Always(5)
    choice = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"choice": ["yes", "no"]})
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    constrained, plain = llm.generate([[5, 6, 7], [8, 9, 10]], [choice, free], use_tqdm=False)
    assert constrained.outputs[0].text in ("yes", "no") and constrained.metrics.num_drafts == 0
    assert plain.metrics.num_drafts > 0


class Slow(Oracle):
    """The reference continuation (one draft in three wrong), at 200 ms a proposal."""

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        time.sleep(0.2)
        return super().lookup(token_ids, k)


@pytest.fixture
def one_thread():
    """Steps on one thread: beside another busy process, two OpenMP threads on two cores wait for each other at
    every barrier, and the tiny model's 1 ms step took 100 ms (which priced 200 ms proposals at 2 steps)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_proposal_that_costs_more_than_it_saves_is_measured_and_turned_off(tiny_llama, one_thread):
    """The tiny model's step takes about a millisecond: 200 ms proposals cannot pay, whatever
    their acceptance, and the engine measures that (the proposer guessed them free)."""
    reference = LLM(tiny_llama, dtype="float32", **SMALL).generate([PROMPT], PARAMS, use_tqdm=False)[0]
    oracle = ([PROMPT], [reference.outputs[0].token_ids])
    _, (fast,) = _run(tiny_llama, Oracle(*oracle))
    llm, (slow,) = _run(tiny_llama, Slow(*oracle))
    assert fast.metrics.num_drafts > 8 and fast.metrics.acceptance_rate > 0.5
    assert slow.outputs[0].token_ids == reference.outputs[0].token_ids
    assert speculator.COST_SAMPLES // 2 <= slow.metrics.num_drafts <= speculator.COST_SAMPLES // 2 + 1
    assert llm.engine.speculator._proposal_cost(1) > 4
