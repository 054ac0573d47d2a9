"""response_format, vLLM's guided_* extras, tools and echo scoring over HTTP, on a random model with a real vocabulary.

A random model writes anything it is allowed to, so every valid output here is the
grammar's doing. Errors are checked for status, OpenAI's error JSON and the field named.
"""
from __future__ import annotations

import json
import re

import openai
import pytest

from slipstream import LLM, SamplingParams
from tests.server.conftest import launch_server
from tests.server.test_errors import assert_error
from tests.structured.schemas import CHOICES, REGEX, SCHEMA, check_schema_output

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server(tiny_with_tokenizer, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("structured_server") / "server.log")
    server = launch_server(tiny_with_tokenizer, log, "--served-model-name", "tiny").wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def chat(http, **fields) -> dict:
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 120, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def complete(http, **fields) -> dict:
    response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 120, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def streamed_text(client, route: str, **fields) -> str:
    if route == "chat":
        chunks = client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **fields)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    chunks = client.completions.create(model="tiny", prompt="Hello", stream=True, **fields)
    return "".join(c.choices[0].text for c in chunks if c.choices)


# --- response_format and vLLM's extras -------------------------------------------------
def test_json_schema_response_format_on_both_routes(http):
    for seed in range(3):
        check_schema_output(chat(http, response_format=RESPONSE_FORMAT, temperature=1.0, seed=seed)
                            ["choices"][0]["message"]["content"])
    check_schema_output(complete(http, response_format=RESPONSE_FORMAT, temperature=1.0)["choices"][0]["text"])


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_streamed_outputs_follow_the_grammar(client, route):
    text = streamed_text(client, route, max_tokens=120, temperature=1.0, extra_body={"guided_json": SCHEMA})
    check_schema_output(text)


@pytest.mark.parametrize("fields,check", [
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ({"guided_json": json.dumps(SCHEMA)}, lambda t: check_schema_output(t) or True),
    ({"guided_grammar": 'root ::= "x" [0-9] [0-9]?'}, lambda t: re.fullmatch(r"x[0-9]{1,2}", t)),
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
], ids=["guided_regex", "guided_choice", "guided_json-text", "guided_grammar", "so-regex", "so-choice"])
def test_vllm_extras(http, fields, check):
    body = complete(http, temperature=1.0, n=2, **fields)
    for choice in body["choices"]:
        assert check(choice["text"]), choice["text"]
        assert choice["finish_reason"] == "stop"


def test_json_object_output_starts_an_object(http):
    text = chat(http, response_format={"type": "json_object"}, max_tokens=8)["choices"][0]["message"]["content"]
    assert text.startswith("{")  # any JSON object: a random model need not close it (SmolLM2's test parses it)


def test_text_response_format_is_unconstrained(http):
    free = chat(http, temperature=0, max_tokens=8)["choices"][0]["message"]["content"]
    assert chat(http, temperature=0, max_tokens=8, response_format={"type": "text"})["choices"][0]["message"][
        "content"] == free


@pytest.mark.parametrize("fields,param,contains", [
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"guided_json": {"type": "no-such-type"}}, "guided_json", "json"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "at most one"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex", "both constrain"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
      "tool_choice": "required"}, "tools", "'not'"),
])
def test_invalid_constraints_are_400s_naming_the_field(http, fields, param, contains):
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **fields})
    assert_error(response, 400, param=param, contains=contains)
    assert http.get("/health").status_code == 200


# --- tools -----------------------------------------------------------------------------
def test_tool_round_trip(client):
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME],
                                           tool_choice="required", parallel_tool_calls=False, temperature=0,
                                           max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    arguments = json.loads(call.function.arguments)
    assert call.function.name in ("get_weather", "get_time")
    if call.function.name == "get_weather":
        assert arguments["city"] in ("Paris", "Oslo") and 1 <= arguments["days"] <= 7
    history = MESSAGES + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    final = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER, TIME], tool_choice="none",
                                           temperature=0, max_tokens=8)
    assert final.choices[0].message.tool_calls is None
    assert isinstance(final.choices[0].message.content, str) and final.choices[0].finish_reason == "length"


def test_named_tool_choice_and_parallel_calls(client):
    named = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], temperature=1.0,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           max_tokens=60, seed=1)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    several = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[TIME], tool_choice="required",
                                             temperature=1.0, max_tokens=200, seed=2)
    if several.choices[0].finish_reason == "tool_calls":  # a random model may make more calls than fit
        assert all(c.function.name == "get_time" for c in several.choices[0].message.tool_calls)


def test_streamed_tool_call_deltas_reassemble_to_the_call(client):
    fields = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                  max_tokens=60, parallel_tool_calls=False)
    whole = client.chat.completions.create(**fields).choices[0].message.tool_calls
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **fields):
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_auto_tool_choice_parses_calls_or_returns_text(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], temperature=0,
                                         max_tokens=8)
    assert out.choices[0].message.content and out.choices[0].message.tool_calls is None  # random text: no call


# --- echo scoring (lm-eval's shapes) ---------------------------------------------------
@pytest.fixture(scope="module")
def reference(tiny_with_tokenizer):
    llm = LLM(tiny_with_tokenizer, dtype="float32")
    return llm.generate("The quick brown fox", SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]


@pytest.mark.parametrize("max_tokens", [0, 1])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_equal_prompt_logprobs(http, reference, max_tokens, stream):
    body = {"prompt": "The quick brown fox", "echo": True, "logprobs": 1, "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        logprobs = {k: sum((e["choices"][0]["logprobs"][k] for e in events), []) for k in
                    ("tokens", "token_logprobs", "text_offset")}
        text = "".join(e["choices"][0]["text"] for e in events)
    else:
        choice = response.json()["choices"][0]
        logprobs, text = choice["logprobs"], choice["text"]
        assert response.json()["usage"]["completion_tokens"] == max_tokens
        assert len(choice["logprobs"]["top_logprobs"]) == len(reference.prompt_token_ids) + max_tokens
    n = len(reference.prompt_token_ids)
    assert len(logprobs["tokens"]) == n + max_tokens
    assert logprobs["token_logprobs"][0] is None
    expected = [entries[t].logprob for t, entries in zip(reference.prompt_token_ids[1:], reference.prompt_logprobs[1:])]
    assert logprobs["token_logprobs"][1:n] == pytest.approx(expected, abs=1e-5)
    assert "".join(logprobs["tokens"][:n]) == "The quick brown fox"
    assert logprobs["text_offset"][:n] == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(n)]
    if max_tokens == 0:
        assert text == "The quick brown fox"


def test_max_tokens_zero_without_echo_is_rejected(http):
    response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 0})
    assert_error(response, 400, param="max_tokens")
