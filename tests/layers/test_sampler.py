"""Sampling with per-request parameters in one batch (tiny random llama, float32)."""
from __future__ import annotations

import math

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.layers.logits_processors import penalties
from slipstream.layers.sampler import SamplingMetadata, argmax, exponential_noise
from tests.conftest import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, 4, 30, seed=21)


def _ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_seeded_sampling_does_not_depend_on_the_batch(llm, prompts):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _ids(llm.generate([prompts[0]], seeded, use_tqdm=False))[0]
    others = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.3, top_k=5, max_tokens=30, ignore_eos=True)]
    batch = llm.generate([prompts[1], prompts[0], prompts[2], prompts[3]],
                         [others[0], seeded, others[1], others[2]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    unseeded = [_ids(llm.generate([prompts[0]], SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
                                  use_tqdm=False))[0] for _ in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1  # no seed: different draws


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.5, min_p=1.0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.5, top_p=1e-300, max_tokens=16, ignore_eos=True),  # 0 in float32
    SamplingParams(temperature=1e-300, max_tokens=16, ignore_eos=True),  # below 1e-5: greedy
    SamplingParams(temperature=9e-6, max_tokens=16, ignore_eos=True),
], ids=["top_k=1", "tiny-top_p", "min_p=1", "top_p-underflows", "temperature-underflows", "temperature<1e-5"])
def test_degenerate_filters_equal_greedy(llm, prompts, params):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == _ids(llm.generate(prompts, greedy, use_tqdm=False))


@pytest.mark.parametrize("temperature", [1e300, 1.7e308])  # inf in float32
def test_huge_temperature_samples_every_token_and_never_a_masked_one(llm, prompts, temperature):
    allowed = list(range(10, 60))
    params = SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True, seed=3, allowed_token_ids=allowed)
    for tokens in _ids(llm.generate(prompts, params, use_tqdm=False)):
        assert set(tokens) <= set(allowed) and len(set(tokens)) > 8  # 16 near-uniform draws from 50


def test_top_k_keeps_samples_within_the_k_most_likely(llm, prompts):
    params = SamplingParams(temperature=2.0, top_k=3, max_tokens=12, ignore_eos=True, seed=5, logprobs=3)
    for out in llm.generate(prompts, params, use_tqdm=False):
        for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
            assert entry[token].rank <= 3


@pytest.mark.parametrize("top_k", [10**6, 2**70])  # above the vocabulary, and above any 64-bit integer
def test_top_k_above_the_vocabulary_keeps_every_token(llm, prompts, top_k):
    draw = dict(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)
    unfiltered = _ids(llm.generate(prompts, SamplingParams(**draw), use_tqdm=False))
    assert _ids(llm.generate(prompts, SamplingParams(top_k=top_k, **draw), use_tqdm=False)) == unfiltered


def test_logprobs_are_consistent(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    for out in llm.generate(prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids)
        for token, entry in zip(completion.token_ids, completion.logprobs):
            assert entry[token].rank == 1  # greedy picks the most likely token
            top = sorted(entry.values(), key=lambda l: l.rank)
            assert [l.rank for l in top] == [1, 2, 3, 4, 5]
            assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
            assert sum(math.exp(l.logprob) for l in top) <= 1 + 1e-5
        assert math.isclose(completion.cumulative_logprob,
                            sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)), rel_tol=1e-6)


def test_stop_token_ids_min_tokens_and_max_tokens(llm, prompts):
    free = _ids(llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                             use_tqdm=False))[0]
    stop_at = free[2]
    first = free.index(stop_at)
    out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2,
                                                    stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= first + 2 and stop_at not in out.token_ids[:first + 2]
    out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"


def test_penalties_match_their_definition():
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    logits = torch.tensor([[1.0, 2.0, -2.0, 4.0, 5.0], [1.0, 2.0, -2.0, 4.0, 5.0]])
    penalties(logits, SamplingMetadata([params, SamplingParams()], [[1, 2, 3, 3, 1], [1, 2, 3]], [2, 1], [None, None]))
    # token 1: seen, output once: 2/2 - 0.25 - 0.5; token 2: seen in prompt only: -2*2;
    # token 3: output twice: 4/2 - 0.5 - 0.5; tokens 0 and 4: untouched; the second row has no penalties
    assert torch.allclose(logits, torch.tensor([[1.0, 0.25, -4.0, 1.0, 5.0], [1.0, 2.0, -2.0, 4.0, 5.0]]))


def test_n_returns_several_independent_samples(llm, prompts):
    out = llm.generate([prompts[0]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_exponential_race_draws_each_token_with_its_probability():
    """argmax(p / noise) picks token i with probability p[i] only where the noise is Exp(1): plain uniform noise
    moves these frequencies by ~24 standard errors."""
    p, draws = torch.tensor([0.5, 0.3, 0.15, 0.05]), 20000
    noise = exponential_noise(len(p), [torch.Generator().manual_seed(i) for i in range(draws)])
    frequency = torch.bincount((p / noise).argmax(-1), minlength=len(p)) / draws
    assert ((frequency - p).abs() / (p * (1 - p) / draws).sqrt()).max() < 5, frequency


def test_argmax_picks_what_torch_picks_on_ties_and_nan():
    rows = torch.randn(6, 1000)
    rows[1, [7, 500]] = 10.0  # a tie: the first wins
    rows[2, 300] = float("nan")  # NaN counts as the largest
    rows[3] = float("-inf")
    rows[4, 999] = float("inf")
    assert torch.equal(argmax(rows), rows.argmax(-1))
    assert argmax(rows).tolist()[1:3] == [7, 300]


def test_logit_bias_and_allowed_token_ids_steer_greedy_decoding(llm, prompts):
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    free = _ids(llm.generate(prompts[:2], SamplingParams(**greedy), use_tqdm=False))
    forced = SamplingParams(logit_bias={7: 100.0}, **greedy)
    banned = SamplingParams(logit_bias={t: -100.0 for t in free[0]}, **greedy)
    allowed = SamplingParams(allowed_token_ids=[5, 9, 11], **greedy)
    outs = _ids(llm.generate([prompts[0], prompts[0], prompts[0], prompts[1]],
                             [forced, banned, allowed, SamplingParams(**greedy)], use_tqdm=False))
    assert outs[0] == [7] * 8
    assert not set(outs[1]) & set(free[0])
    assert set(outs[2]) <= {5, 9, 11} and len(set(outs[2])) > 1
    assert outs[3] == free[1]  # the other rows' parameters leave this one alone


def test_allowed_token_ids_keep_sampling_inside_the_set(llm, prompts):
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=30, ignore_eos=True, allowed_token_ids=[4, 8, 15, 16])
    assert set(_ids(llm.generate([prompts[1]], params, use_tqdm=False))[0]) <= {4, 8, 15, 16}
