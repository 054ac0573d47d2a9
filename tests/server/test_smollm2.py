"""End to end on the default model (SmolLM2, float32): the openai client, text and chat, against LLM.

One server for the module. The reference outputs come from LLM in this process, with the
server's engine settings, computed while the server loads.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
import openai
import pytest
from hypothesis import given, settings

from slipstream import LLM, SamplingParams
from tests.server.conftest import Server, launch_server, metric
from tests.server.test_fuzz import SETTINGS, bodies, check

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
KV_MEMORY = 128 * 2**20
FRANCE = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]
SUBJECTS = ["the moon", "Python", "the ocean", "a cat", "music", "Paris", "winter", "coffee"]
TEMPLATES = ["Tell me about {}.", "Write one sentence about {}:", "{} is", "Q: What is {}?\nA:"]
PROMPTS = [t.format(s) for t in TEMPLATES for s in SUBJECTS]  # 32 prompts
CONCURRENT_TOKENS = 6


@dataclass
class Smol:
    server: Server
    sequential: list[str]  # greedy, CONCURRENT_TOKENS tokens, each prompt alone
    france: object  # CompletionOutput, greedy, 24 tokens
    chat: object  # CompletionOutput of llm.chat, greedy, 16 tokens
    france_ids: list[int]
    chat_ids: list[int]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("smol_server") / "server.log")
    server = launch_server(MODEL, log, "--kv-cache-memory", str(KV_MEMORY))
    try:
        llm = LLM(MODEL, dtype="float32", kv_cache_memory=KV_MEMORY)
        greedy = SamplingParams(temperature=0, max_tokens=CONCURRENT_TOKENS)
        sequential = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].text for p in PROMPTS]
        france = llm.generate(FRANCE, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
        chat = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
        refs = Smol(server, sequential, france.outputs[0], chat.outputs[0], france.prompt_token_ids,
                    chat.prompt_token_ids)
        del llm
        server.wait_ready()
    except BaseException:
        server.process.kill()
        raise
    yield refs
    server.stop()


@pytest.fixture(scope="module")
def client(smol):
    return openai.OpenAI(base_url=f"{smol.server.url}/v1", api_key="unused", max_retries=0)


# --- same output as the engine ---------------------------------------------------------------
def test_greedy_completion_equals_llm_generate(smol, client):
    response = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=24, temperature=0)
    [choice] = response.choices
    assert choice.text == smol.france.text and "Paris" in choice.text
    assert choice.finish_reason == smol.france.finish_reason
    assert response.usage.prompt_tokens == len(smol.france_ids)
    assert response.usage.completion_tokens == len(smol.france.token_ids)


def test_greedy_chat_equals_llm_chat(smol, client):
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    [choice] = response.choices
    assert choice.message.role == "assistant" and choice.message.content == smol.chat.text
    assert response.usage.prompt_tokens == len(smol.chat_ids)
    assert response.usage.completion_tokens == len(smol.chat.token_ids)


def test_32_concurrent_streams_equal_the_sequential_run(smol):
    async def one(client, prompt) -> tuple[str, str | None]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=CONCURRENT_TOKENS,
                                                 temperature=0, stream=True)
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def most_running(done: asyncio.Event) -> float:
        most = 0.0
        async with httpx.AsyncClient(base_url=smol.server.url) as http:
            while not done.is_set():
                most = max(most, metric((await http.get("/metrics")).text, "slipstream:num_requests_running"))
                await asyncio.sleep(0.02)
        return most

    async def run_all():
        done = asyncio.Event()
        watcher = asyncio.create_task(most_running(done))
        async with openai.AsyncOpenAI(base_url=f"{smol.server.url}/v1", api_key="unused", max_retries=0) as c:
            results = await asyncio.gather(*(one(c, p) for p in PROMPTS))
        done.set()
        return results, await watcher

    results, most = asyncio.run(run_all())
    assert all(finish in ("stop", "length") for _, finish in results)
    assert [text for text, _ in results] == smol.sequential
    assert most >= 8  # they did run in one batch


# --- the openai client, streamed and not -----------------------------------------------------
def test_completion_stream_equals_whole_and_usage_only_when_asked(smol, client):
    kwargs = dict(model=MODEL, prompt=FRANCE, max_tokens=24, temperature=0, stream=True)
    plain = list(client.completions.create(**kwargs))
    assert "".join(c.choices[0].text for c in plain) == smol.france.text
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason == smol.france.finish_reason
    *body, last = client.completions.create(**kwargs, stream_options={"include_usage": True})
    assert "".join(c.choices[0].text for c in body) == smol.france.text
    assert last.choices == [] and last.usage.completion_tokens == len(smol.france.token_ids)
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_chat_without_max_tokens_fits_the_kv_cache(smol, client):
    # The server's KV cache (KV_MEMORY) holds fewer tokens than the model's context: the default
    # max_tokens must be what fits, not the whole context (which could never be admitted).
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    assert response.choices[0].message.content == smol.chat.text
    assert response.choices[0].finish_reason == "stop"


def test_chat_stream(smol, client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, stream=True)
    chunks = list(client.chat.completions.create(**kwargs))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == smol.chat.text
    assert chunks[-1].choices[0].finish_reason == smol.chat.finish_reason
    assert all(c.usage is None for c in chunks)
    *_, last = client.chat.completions.create(**kwargs, stream_options={"include_usage": True})
    assert last.choices == [] and last.usage.completion_tokens == len(smol.chat.token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates_the_text(smol, client, stream):
    full = smol.france.text
    stop = full[10:14]
    expected = full[:full.index(stop)]
    response = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=24, temperature=0, stop=[stop],
                                         stream=stream)
    chunks = list(response) if stream else [response]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproduces_a_sample(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=12, temperature=1.0,
                                         seed=seed).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2)}) > 1


def test_n_choices(client):
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, n=2,
                                              seed=3)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].message.content != response.choices[1].message.content
    response = client.completions.create(model=MODEL, prompt=[FRANCE, "Hello"], max_tokens=4, n=2, temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text == response.choices[1].text  # greedy: both samples agree
    assert 4 <= response.usage.completion_tokens <= 16


def test_completion_logprobs(smol, client):
    response = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=24, temperature=0, logprobs=3)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == response.usage.completion_tokens
    assert "".join(lp.tokens) == smol.france.text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and logprob <= 0
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token
        assert top[token] == pytest.approx(logprob)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_chat_logprobs(smol, client):
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                              logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) and entry.logprob <= 0
        assert bytes(entry.bytes).decode() == entry.token
    # the EOS token that ended the reply is an output token too (counted in usage, absent from the text)
    assert "".join(e.token for e in content) == smol.chat.text + "<|im_end|>"
    assert response.choices[0].finish_reason == "stop"


def test_echo(smol, client):
    response = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=4, temperature=0, echo=True,
                                         logprobs=1)
    choice = response.choices[0]
    assert choice.text.startswith(FRANCE) and choice.text == FRANCE + smol.france.text[:len(choice.text) - len(FRANCE)]
    assert len(choice.logprobs.tokens) == response.usage.prompt_tokens + response.usage.completion_tokens
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    streamed = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=4, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_tokenize_and_detokenize(smol):
    with smol.server.client() as c:
        tokens = c.post("/tokenize", json={"prompt": FRANCE}).json()
        assert tokens["tokens"] == smol.france_ids and tokens["count"] == len(smol.france_ids)
        assert tokens["max_model_len"] > 0
        assert c.post("/detokenize", json={"tokens": smol.france_ids}).json() == {"prompt": FRANCE}
        chat = c.post("/tokenize", json={"messages": MESSAGES}).json()
        assert chat["tokens"] == smol.chat_ids


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=10**6)
    assert "max_model_len" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
    assert e.value.param == "temperature"


@pytest.fixture(scope="module")
def http(smol):
    with smol.server.client() as c:
        yield c


@settings(SETTINGS, max_examples=40)
@given(body=bodies(MODEL, chat=True))
def test_fuzz_chat_with_a_chat_template(http, body):
    check(http, "/v1/chat/completions", body)


def test_alive_after_fuzz(http):
    assert http.get("/health").status_code == 200
