"""/v1/completions on a tiny random model (token-id prompts), through the official openai client.

The tiny model has no tokenizer, so texts are empty; logprobs name each token as
"token_id:N", which lets us read the generated token ids back and compare them with
LLM.generate on the same checkpoint.
"""
from __future__ import annotations

import json

import openai
import pytest

from slipstream import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.server.conftest import API_KEY, metric

PROMPTS = random_prompts(4, 5, 40, seed=3)


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0)


def token_ids(logprobs) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


def test_greedy_tokens_equal_llm_generate(client, tiny_model):
    llm = LLM(tiny_model, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    response = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=20, temperature=0, logprobs=0,
                                         extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [token_ids(c.logprobs) for c in response.choices] == expected


def test_response_shape_and_usage(client):
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.model == "tiny" and isinstance(response.created, int)
    [choice] = response.choices
    assert (choice.index, choice.text, choice.logprobs, choice.finish_reason) == (0, "", None, "length")
    usage = response.usage
    n = len(PROMPTS[0])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (n, 5, n + 5)


def test_stream_has_usage_only_when_asked(client):
    kwargs = dict(model="tiny", prompt=PROMPTS[:2], max_tokens=6, temperature=0, stream=True,
                  extra_body={"ignore_eos": True})
    plain = list(client.completions.create(**kwargs))
    assert plain and all(c.usage is None and c.choices for c in plain)
    assert sorted(c.choices[0].index for c in plain if c.choices[0].finish_reason) == [0, 1]
    with_usage = list(client.completions.create(**kwargs, stream_options={"include_usage": True}))
    *body, last = with_usage
    assert all(c.usage is None and c.choices for c in body)
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
    assert len({c.id for c in with_usage}) == 1


def test_stream_logprobs_add_up_to_the_whole(client):
    kwargs = dict(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = list(client.completions.create(**kwargs, stream=True))
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed == whole.tokens and len(streamed) == 12
    assert [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs] == pytest.approx(whole.token_logprobs)


def test_n_and_seed(client):
    kwargs = dict(model="tiny", prompt=PROMPTS[:2], max_tokens=10, temperature=1.0, n=2, logprobs=0,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs, seed=7)
    again = client.completions.create(**kwargs, seed=7)
    other = client.completions.create(**kwargs, seed=8)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert first.usage.completion_tokens == 40
    ids = [token_ids(c.logprobs) for c in first.choices]
    assert ids == [token_ids(c.logprobs) for c in again.choices]
    assert ids != [token_ids(c.logprobs) for c in other.choices]
    assert ids[0] != ids[1]  # the two samples of one prompt differ


def test_echo_with_logprobs_covers_the_prompt(client):
    response = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=3, temperature=0, echo=True,
                                         logprobs=2, extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert token_ids(logprobs)[:len(PROMPTS[2])] == PROMPTS[2]
    assert len(logprobs.tokens) == len(PROMPTS[2]) + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])


def test_stop_token_ids_and_min_tokens(client):
    base = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=10, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True})
    ids = token_ids(base.choices[0].logprobs)
    stop_at = ids[4]
    stopped = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=10, temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True, "stop_token_ids": [stop_at]})
    got = token_ids(stopped.choices[0].logprobs)
    assert got == ids[:ids.index(stop_at) + 1] and stopped.choices[0].finish_reason == "stop"


def test_sse_wire_format(tiny_server):
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "stream": True, "ignore_eos": True}
    with tiny_server.client() as c, c.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(set(c) == {"id", "object", "created", "model", "choices"} for c in chunks)
    assert all(set(ch) == {"index", "text", "logprobs", "finish_reason"} for c in chunks for ch in c["choices"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_models_route(client, tiny_model):
    [card] = client.models.list().data
    assert card.id == "tiny" and card.object == "model" and card.owned_by == "slipstream"
    assert card.model_extra["root"] == tiny_model


def test_cache_salt_separates_prefix_caches(tiny_server):
    prompt = list(range(100, 140))  # two full 16-token blocks, used by no other test

    with tiny_server.client() as c:
        def run(salt: str) -> float:
            assert c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "cache_salt": salt}).is_success
            return metric(c.get("/metrics").text, "slipstream:prefix_cache_hits_total")

        first, other_salt, same_salt = run("alice"), run("bob"), run("alice")
    assert other_salt == first  # bob cannot reuse alice's blocks
    assert same_salt - other_salt == 32  # alice reuses both of hers


def test_logit_bias_and_allowed_token_ids_equal_llm_generate(client, tiny_model):
    llm = LLM(tiny_model, dtype="float32")
    steer = dict(logit_bias={7: 100.0, 9: -100.0}, allowed_token_ids=[7, 9, 12, 30])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **steer)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
    response = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=6, temperature=0, logprobs=0,
                                         logit_bias={"7": 100, "9": -100},
                                         extra_body={"ignore_eos": True, "allowed_token_ids": [7, 9, 12, 30]})
    assert [token_ids(c.logprobs) for c in response.choices] == expected == [[7] * 6] * 2
