"""Speculative decoding with a draft model: float32 greedy outputs equal the non-speculative run.

The drafts come from real checkpoints sharing the target's vocabulary: the target itself
(every draft accepted) and a noisy copy of it (about half accepted: rejections at every
offset). The draft's own blocks are checked after every step as the target's are, and every
block its prefix cache holds must carry tokens the target has (accepted ones only).
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from slipstream import LLM, SamplingParams
from slipstream.config import EngineConfig
from slipstream.speculative import speculator
from tests.conftest import build_tiny_checkpoint, random_prompts
from tests.speculative.test_speculative_engine import FREE, GREEDY, SETTINGS, SMALL, cached_prefixes, generate


@pytest.fixture(scope="module")
def noisy_draft(tiny_llama, tmp_path_factory) -> str:
    """tiny_llama with Gaussian noise of 3% of each matrix's spread: its greedy choices mostly agree."""
    path = str(tmp_path_factory.mktemp("noisy_draft"))
    shutil.copytree(tiny_llama, path, dirs_exist_ok=True)
    file = os.path.join(path, "model.safetensors")
    g = torch.Generator().manual_seed(1)
    weights = {name: w + 0.03 * w.std() * torch.randn(w.shape, generator=g) if w.dim() == 2 else w
               for name, w in load_file(file).items()}
    save_file(weights, file, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("setting", ["chunked-prefill", "preemption"])
def test_every_proposal_is_the_draft_models_own_greedy_continuation(tiny_llama, noisy_draft, prompts, setting):
    """What the mirrors' caches give equals the draft model run alone on the same tokens
    (stale K/V of rejected drafts, a wrong catch-up or a bad eviction would change it). Every
    third step decodes without drafts, so mirrors fall behind tokens they did not propose."""
    llm = _draft_llm(tiny_llama, noisy_draft, **SETTINGS[setting])
    speculator, proposer, calls = llm.engine.speculator, llm.engine.speculator.proposer, []
    propose, speculate, steps = proposer.propose, speculator.propose, iter(range(10**6))
    speculator.propose = lambda decodes: {} if next(steps) % 3 == 2 else speculate(decodes)

    def recorded(seqs, ks):
        drafts = propose(seqs, ks)
        calls.extend((list(seq.token_ids), d) for seq, d in zip(seqs, drafts) if d)
        return drafts

    proposer.propose = recorded
    generate(llm, prompts, GREEDY)
    assert len(calls) > 50
    alone = LLM(noisy_draft, dtype="float32", **SETTINGS["mixed-batch"])
    outs = alone.generate([tokens for tokens, _ in calls],
                          [SamplingParams(temperature=0, max_tokens=len(d), ignore_eos=True) for _, d in calls],
                          use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [d for _, d in calls]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, 3, 40, seed=11) + [[5, 6, 7, 8] * 6]


@pytest.fixture(autouse=True)
def always_speculate(monkeypatch):
    monkeypatch.setattr(speculator, "VERIFY_COST", FREE)


def _draft_llm(target: str, draft: str, **kwargs) -> LLM:
    llm = LLM(target, dtype="float32", speculative_config={"method": "draft_model", "model": draft,
                                                           "num_speculative_tokens": 4}, **kwargs)
    llm.engine.speculator.proposer.step_cost = 0.0  # drafts every step (a copy costs as much as the target)
    return llm


def check_draft_blocks(llm: LLM, references: list[list[int]]) -> None:
    """The draft's block accounting, and its prefix cache holding only the target's tokens."""
    proposer = llm.engine.speculator.proposer
    bm = proposer.block_manager
    owners: dict[int, int] = {}
    for mirror in proposer.mirrors.values():
        for b in mirror.block_table:
            owners[b] = owners.get(b, 0) + 1
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    for block in bm.blocks:
        assert block.ref_count == owners.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)
    for tokens in cached_prefixes(bm):
        assert any(ref[:len(tokens)] == tokens for ref in references)


def _generate_checked(llm: LLM, prompts, params, references) -> list:
    engine, step = llm.engine, llm.engine.step

    def checked_step():
        outs = step()
        check_draft_blocks(llm, references)
        return outs

    engine.step = checked_step
    try:
        result = generate(llm, prompts, params)
    finally:
        del engine.step
    assert engine.speculator.proposer.block_manager.num_used_blocks == 0  # every mirror freed
    return result


@pytest.mark.parametrize("draft", ["self", "noisy"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_greedy_tokens_equal_the_non_speculative_run(tiny_llama, noisy_draft, prompts, setting, draft):
    kwargs = SETTINGS[setting]
    reference = generate(LLM(tiny_llama, dtype="float32", **kwargs), prompts, GREEDY)
    llm = _draft_llm(tiny_llama, tiny_llama if draft == "self" else noisy_draft, **kwargs)
    full = [p + tokens for p, (tokens, _) in zip(prompts, reference)]
    assert _generate_checked(llm, prompts, GREEDY, full) == reference
    rate = llm.stats()["spec_decode_acceptance_rate"]
    if "kv_cache_dtype" in kwargs:  # the target reads a 3-bit cache, the draft its own full one
        assert 0 < rate < 0.8
    elif draft == "self":
        assert rate > 0.9
    else:
        assert 0.2 < rate < 0.8  # long accepted runs and rejections


def test_stops_and_prefix_cache_hits(tiny_llama, noisy_draft, prompts):
    """Stops see accepted tokens as without speculation; a second turn hits both prefix caches."""
    free = [tokens for tokens, _ in generate(LLM(tiny_llama, dtype="float32", **SMALL), prompts, GREEDY)]
    params = [SamplingParams(temperature=0, max_tokens=3 + i) for i in range(len(prompts))]
    params[0] = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[free[0][7]])
    params[1] = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3)
    reference = generate(LLM(tiny_llama, dtype="float32", **SMALL), prompts, params)
    llm = _draft_llm(tiny_llama, noisy_draft, **SMALL)
    full = [p + tokens for p, (tokens, _) in zip(prompts, reference)]
    assert _generate_checked(llm, prompts, params, full) == reference
    assert reference[0][1] == "stop"
    follow_ups = full
    expected = generate(LLM(tiny_llama, dtype="float32", **SMALL), follow_ups, GREEDY)
    draft_bm = llm.engine.speculator.proposer.block_manager
    hits_before = draft_bm.prefix_cache_hits
    second = [p + tokens for p, (tokens, _) in zip(follow_ups, expected)]
    assert _generate_checked(llm, follow_ups, GREEDY, full + second) == expected
    assert draft_bm.prefix_cache_hits > hits_before


def test_seeded_samples_are_reproducible(tiny_llama, noisy_draft):
    llm = _draft_llm(tiny_llama, noisy_draft, kv_cache_memory=2**22)
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=3)
    first = llm.generate([[5, 6, 7, 8, 9], [9, 8, 7]], params, use_tqdm=False)
    again = llm.generate([[9, 8, 7], [5, 6, 7, 8, 9]], params, use_tqdm=False)  # another batch order
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in reversed(again)]
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    other = build_tiny_checkpoint(str(tmp_path / "other"), vocab_size=256)
    with pytest.raises(ValueError, match=r"draft model .* has a vocabulary of 256 tokens; the target's has 384"):
        _draft_llm(tiny_llama, other)


@pytest.mark.parametrize("value, message", [
    ({"method": "draft_model", "num_speculative_tokens": 3}, "method 'draft_model' needs 'model'"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
     "['prompt_lookup_max'] belong(s) to method 'ngram', not 'draft_model'"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 3}, "['model'] belong(s) to method 'draft_model'"),
])
def test_bad_configs_are_clear_errors(value, message):
    with pytest.raises(ValueError) as e:
        EngineConfig.from_kwargs(speculative_config=value)
    assert message in str(e.value)


def test_tensor_parallel_refuses_a_draft_model():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not run a draft model"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, speculative_config={
            "method": "draft_model", "model": "x", "num_speculative_tokens": 2})
