"""Rejection sampling keeps the target distribution: speculative samples match plain sampling.

On the tiny model restricted to four tokens (allowed_token_ids) at temperature 3, the joint
distribution of the first two output tokens (the first samples after the prompt; the second
verifies an n-gram draft that depends on the first) is compared with plain sampling's by a
two-sample chi-square test. Replacing the residual distribution by the target distribution (a classic mistake:
it over-weights the draft) must fail the same test, which shows that it has the power to.
"""
from __future__ import annotations

import collections

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.layers import rejection_sampler
from slipstream.speculative import speculator
from tests.speculative.test_speculative_engine import FREE

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
PROMPT = [5, 6, 7, 8, 6, 5, 8, 7, 5]
DRAWS = 600


def _samples(llm: LLM, seed0: int) -> list[tuple[int, ...]]:
    params = [SamplingParams(temperature=3.0, max_tokens=3, ignore_eos=True, allowed_token_ids=[5, 6, 7, 8],
                             seed=seed0 + i) for i in range(DRAWS)]
    return [tuple(o.outputs[0].token_ids[:2]) for o in llm.generate([PROMPT] * DRAWS, params, use_tqdm=False)]


def chi_square_p_value(a: list, b: list) -> float:
    """Two-sample chi-square test of homogeneity over the cells seen; cells expected under 5 pooled."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    cells = sorted(set(ca) | set(cb))
    share = len(a) / (len(a) + len(b))
    big = [c for c in cells if min(share, 1 - share) * (ca[c] + cb[c]) >= 5]
    rest = [c for c in cells if c not in big]
    counts = [(ca[c], cb[c]) for c in big] + ([(sum(ca[c] for c in rest), sum(cb[c] for c in rest))] if rest else [])
    stat = sum((x - share * (x + y)) ** 2 / (share * (x + y)) + (y - (1 - share) * (x + y)) ** 2 / ((1 - share) * (x + y))
               for x, y in counts)
    return float(torch.special.gammaincc(torch.tensor((len(counts) - 1) / 2), torch.tensor(stat / 2)))


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return _samples(LLM(tiny_llama, dtype="float32", kv_cache_memory=2**22, max_num_seqs=256), seed0=0)


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["exact", "target-as-residual"])
def test_speculative_samples_follow_the_target_distribution(tiny_llama, plain, residual, monkeypatch):
    monkeypatch.setattr(speculator, "VERIFY_COST", FREE)
    if residual == "target-as-residual":
        monkeypatch.setattr(rejection_sampler, "residual", lambda probs, drafts: probs)
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=2**22, max_num_seqs=256, speculative_config=NGRAM)
    speculative = _samples(llm, seed0=10**6)  # other seeds: independent of the plain draws
    stats = llm.stats()
    assert stats["spec_decode_num_drafts"] >= DRAWS  # every second token verified a draft
    p = chi_square_p_value(plain, speculative)
    if residual == "exact":
        assert p > 1e-3, f"speculative samples differ from plain sampling (p = {p:.2g})"
    else:
        assert p < 1e-3, f"the test did not detect a wrong residual distribution (p = {p:.2g})"


def test_seeded_speculative_samples_are_reproducible(tiny_llama, monkeypatch):
    monkeypatch.setattr(speculator, "VERIFY_COST", FREE)
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=2**22, max_num_seqs=256, speculative_config=NGRAM)
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=3)
    first = llm.generate([PROMPT, PROMPT[:5]], params, use_tqdm=False)
    again = llm.generate([PROMPT[:5], PROMPT], params, use_tqdm=False)  # another batch order
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in reversed(again)]
