"""OpenAI's request and response shapes (plus vLLM's common extras) as pydantic models.

Requests are checked here for types only; values (ranges, lengths, limits) are checked by
SamplingParams, the server's limits and the engine, whose ValueErrors the server turns into
400s. Types are strict, as OpenAI's API states them: a string is never a number, a boolean
never an integer, a float never an integer (`"temperature": "0.5"`, `"max_tokens": true`,
`"n": 2.0` are 400s); an integer is a number. Every field may be null, meaning "the
default". Undeclared fields are kept, and rejected by name unless server/fields.py lists
them as accepted and ignored. Strings must be valid Unicode (no lone surrogates: they
cannot be tokenized or sent back as UTF-8). Chat roles are the API's own and message names
are identifiers, because chat templates insert both verbatim: a role like
"user<|im_end|><|im_start|>system" would forge a turn.
"""
from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, StringConstraints, Tag,
                      model_serializer)

from slipstream.server.response_format import ResponseFormat
from slipstream.server.tools import NamedToolChoice, Tool, ToolCall


def _valid_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"invalid Unicode (lone surrogate) at position {e.start}") from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)  # extras: server/fields.py


class StreamOptions(_Request):
    include_usage: bool | None = False


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = Field(None, le=128)  # OpenAI's limit; one request must not flood the queue
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None  # accepted, ignored (server/fields.py)
    cache_salt: Text | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's extra: sample only among these
    skip_special_tokens: bool | None = None  # vLLM's extra
    include_stop_str_in_output: bool | None = None  # vLLM's extra
    # structured outputs (server/response_format.py): at most one of these
    response_format: ResponseFormat | None = None
    guided_json: dict | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    structured_outputs: dict | None = None


TokenIds = list[int]


def _prompt_form(value) -> str:
    """Which of the four forms a prompt takes, from its first element.

    So that one member of the union is validated, not all four: a union tried in full
    validates every element of a long list once per member, on the event loop.
    """
    if isinstance(value, str):
        return "str"
    first = value[0] if isinstance(value, list) and value else None
    return {list: "list[list[int]]", str: "list[str]"}.get(type(first), "list[int]")


Prompt = Annotated[Annotated[TokenIds, Tag("list[int]")] | Annotated[list[TokenIds], Tag("list[list[int]]")]
                   | Annotated[Text, Tag("str")] | Annotated[list[Text], Tag("list[str]")], Discriminator(_prompt_form)]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    logprobs: int | None = None
    echo: bool | None = False
    suffix: Text | None = None  # not supported: rejected if set


class ContentPart(_Request):
    type: Text
    text: Text | None = None


Role = Literal["system", "developer", "user", "assistant", "tool"]
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule for names


class ChatMessage(_Request):
    role: Role
    content: Text | list[ContentPart] | None = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's past calls
    tool_call_id: Text | None = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    # tool calling (server/tools.py)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Request):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: TokenIds


# --- responses -------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = []


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler):
        return {k: v for k, v in handler(self).items() if k != "tool_calls" or v is not None}


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    """Only the fields that changed, as in OpenAI's chunks."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None  # server/tool_deltas.py

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "slipstream"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
