"""Structured outputs on the default model (SmolLM2, float32) through the openai client's own helpers.

`client.chat.completions.parse(response_format=<pydantic model>)` sends OpenAI's strict
json_schema and validates the reply with the model class; 20 such requests at temperature
0.8 over nested objects, arrays, enums, bounded integers and optional fields must all parse.
"""
from __future__ import annotations

import asyncio
import enum
import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import launch_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
KV_MEMORY = 128 * 2**20


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    city: City


class Item(BaseModel):
    name: str = Field(max_length=16)
    quantity: int = Field(ge=1, le=10)


class ShoppingList(BaseModel):
    items: list[Item] = Field(min_length=1, max_length=4)


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Review(BaseModel):
    sentiment: Literal["positive", "negative", "neutral"]
    stars: int = Field(ge=1, le=5)
    color: Color


class Book(BaseModel):
    title: str = Field(max_length=32)
    year: int | None = Field(ge=1000, le=2100)
    subtitle: str | None = Field(max_length=24)


CASES = [(Person, "Describe a person who lives in a city."), (ShoppingList, "Write a short shopping list."),
         (Review, "Review a movie you liked."), (Book, "Describe a famous book.")]
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("smol_structured") / "server.log")
    server = launch_server(MODEL, log, "--kv-cache-memory", str(KV_MEMORY)).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)


def test_parse_with_pydantic_models_validates_every_reply(server):
    async def one(client, model, prompt, seed):
        completion = await client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": prompt}], response_format=model,
            temperature=0.8, seed=seed, max_tokens=300)
        message = completion.choices[0].message
        assert isinstance(message.parsed, model), message.content
        return model.model_validate_json(message.content)

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                      timeout=600) as client:
            return await asyncio.gather(*(one(client, model, prompt, seed)
                                          for seed in range(5) for model, prompt in CASES))

    assert len(asyncio.run(run())) == 20


def test_json_object_replies_parse(client):
    for seed, temperature in [(0, 0.0), (1, 0.8), (2, 0.8)]:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
            response_format={"type": "json_object"}, temperature=temperature, seed=seed, max_tokens=300)
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_tool_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather like in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL], tool_choice="required",
                                           temperature=0, max_tokens=100)
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"weather": "sunny", "celsius": 21}'}]
    # a 135M model under `auto` calls again; `none` asks for the answer
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL], tool_choice="none",
                                           temperature=0, max_tokens=40)
    assert final.choices[0].message.content and final.choices[0].message.tool_calls is None
