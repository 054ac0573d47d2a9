"""Structured outputs through LLM.generate: every output matches its spec, whatever else runs.

Schemas here describe finite languages (enums, bounded integers, short strings, short
arrays), so a random model must finish within max_tokens and each output can be checked
in full; `finish_reason == "stop"` says the grammar, not the length limit, ended it.
"""
from __future__ import annotations

import json
import re

import pytest

from slipstream import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.structured.schemas import CHOICES, REGEX, SCHEMA, check_schema_output

BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # K+V, 2 layers, 2 KV heads, dim 16, fp32, 16 tokens


@pytest.fixture(scope="module")
def llm(tiny_with_tokenizer):
    return LLM(tiny_with_tokenizer, dtype="float32")


def sampled(spec: dict, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 120, "structured_outputs": spec, **kwargs})


def test_json_schema_outputs_validate(llm):
    outs = llm.generate(random_prompts(6, 3, 12, seed=1, vocab=49152), sampled({"json": SCHEMA}, seed=3),
                        use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        check_schema_output(out.outputs[0].text)


def test_regex_and_choice_outputs_match(llm):
    prompts = random_prompts(4, 3, 12, seed=2, vocab=49152)
    for out in llm.generate(prompts, sampled({"regex": REGEX}), use_tqdm=False):
        assert re.fullmatch(REGEX, out.outputs[0].text), out.outputs[0].text
    for out in llm.generate(prompts, sampled({"choice": CHOICES}), use_tqdm=False):
        assert out.outputs[0].text in CHOICES


def test_grammar_output_matches(llm):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for out in llm.generate(random_prompts(3, 3, 12, seed=4, vocab=49152), sampled({"grammar": grammar}),
                            use_tqdm=False):
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", out.outputs[0].text), out.outputs[0].text


def test_json_object_output_is_an_object_prefix_and_parses_when_it_ends(llm):
    # any JSON object is an infinite language: a random model need not end it, but must never leave it
    out = llm.generate([[5, 6, 7]], sampled({"json_object": True}, max_tokens=40, seed=0), use_tqdm=False)[0]
    text = out.outputs[0].text
    assert text.startswith("{")
    if out.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_constrained_row_leaves_the_others_greedy_outputs_unchanged(llm):
    prompts = random_prompts(4, 4, 30, seed=5, vocab=49152)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    mixed = [greedy, sampled({"json": SCHEMA}), greedy, sampled({"regex": REGEX}), greedy, greedy]
    outs = llm.generate(prompts[:1] + prompts[:1] + prompts[1:2] + prompts[2:3] + prompts[2:], mixed,
                        use_tqdm=False)
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 4, 5)] == alone
    check_schema_output(outs[1].outputs[0].text)
    assert re.fullmatch(REGEX, outs[3].outputs[0].text)


def test_n_samples_each_follow_the_grammar(llm):
    out = llm.generate([[11, 12, 13]], sampled({"json": SCHEMA}, n=4, seed=9), use_tqdm=False)[0]
    texts = [o.text for o in out.outputs]
    for text in texts:
        check_schema_output(text)
    assert len(set(texts)) > 1  # each sample has its own matcher and random stream


def test_preemption_keeps_the_matcher_in_step_with_the_tokens(tiny_with_tokenizer):
    """A preempted sequence keeps its tokens, so its matcher (which accepted them) stays valid.

    Seeded sampling draws the same numbers whatever the batch, so the outputs equal a run
    without preemption; any matcher drift would change or break them.
    """
    prompts = random_prompts(6, 20, 40, seed=6, vocab=49152)
    params = [sampled({"json": SCHEMA}, seed=i, n=2 if i % 2 else 1) for i in range(len(prompts))]
    roomy = LLM(tiny_with_tokenizer, dtype="float32")
    expected = [[o.text for o in out.outputs] for out in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(tiny_with_tokenizer, dtype="float32", kv_cache_memory=12 * BLOCK_BYTES)
    got = [[o.text for o in out.outputs] for out in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.stats()["num_preemptions"] > 0
    assert got == expected
    for texts in got:
        for text in texts:
            check_schema_output(text)


def test_invalid_specs_are_rejected_at_add_request(llm):
    bad = [({"regex": "(unclosed"}, "regex"), ({"json": {"type": "object", "uniqueItems": True}}, "uniqueItems"),
           ({"json": {"type": "wat"}}, "json"), ({"grammar": "root ::= missing"}, "grammar")]
    for spec, named in bad:
        with pytest.raises(ValueError, match=named):
            llm.generate([[1, 2]], sampled(spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_every_sampling_parameter_composes_with_the_grammar(llm):
    params = sampled({"json": SCHEMA}, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.3,
                     presence_penalty=0.5, frequency_penalty=0.5, logit_bias={90: 5.0, 11: -5.0}, min_tokens=200,
                     max_tokens=200, seed=4, logprobs=2)
    out = llm.generate([[21, 22, 23]], params, use_tqdm=False)[0].outputs[0]
    # past the grammar's end only stop tokens fit; min_tokens may hold the sequence open on them, and they decode to ''
    check_schema_output(out.text)
    assert len(out.logprobs) == len(out.token_ids)


@pytest.mark.parametrize("engine_kwargs", [{"max_num_batched_tokens": 7}, {"kv_cache_dtype": "tq4"}],
                         ids=["chunked-prefill", "turboquant"])
def test_chunked_prefill_prefix_hits_and_turboquant(tiny_with_tokenizer, llm, engine_kwargs):
    prompts = random_prompts(3, 20, 40, seed=8, vocab=49152)
    params = [sampled({"json": SCHEMA}, seed=i) for i in range(len(prompts))]
    other = LLM(tiny_with_tokenizer, dtype="float32", **engine_kwargs)
    for _ in range(2):  # the second pass hits the prefix cache
        outs = other.generate(prompts, params, use_tqdm=False)
        for out in outs:
            check_schema_output(out.outputs[0].text)
    assert other.stats()["prefix_cache_hits"] > 0
    if "max_num_batched_tokens" in engine_kwargs:  # float32 caches: the same tokens as unchunked
        assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in llm.generate(prompts, params,
                                                                                               use_tqdm=False)]
