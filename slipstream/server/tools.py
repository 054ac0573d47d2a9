"""Tool calling: `tools` and `tool_choice` -> a prompt, a grammar, and `message.tool_calls` parsed back.

Rendering. A chat template that mentions `tools` renders them itself (and its own history
shapes: assistant `tool_calls`, `tool` messages). Any other template gets the generic
format: a system message that lists each function as one JSON line and asks for a call as
`{"name": ..., "arguments": {...}}` (a JSON array of those for several calls); past calls
are written back in that form and tool results become user messages `Result of tool call
<id> (<name>): <content>`, since such templates know no `tool` role.

Choice. `none`: the tools are not shown and nothing is parsed. `auto` (the default with
tools): free text, parsed as calls when the whole reply is calls. `required` and a named
function: a grammar admits only calls (an array of them when `parallel_tool_calls`, the
default), so the reply always parses. Calls get ids `call_<24 hex>`, JSON-text arguments,
and `finish_reason="tool_calls"`. Must never know the engine.
"""
from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

from slipstream.server.errors import APIError
from slipstream.server.response_format import structured_outputs
from slipstream.structured.params import StructuredOutputsParams

TAG = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)  # Hermes / Qwen style, which native templates ask for
GENERIC_PROMPT = (
    "# Tools\n"
    "You may call the functions listed below, one JSON object per line. To call one, reply with only a JSON "
    'object {"name": <function name>, "arguments": <its arguments as a JSON object>}; to call several at once, '
    "reply with a JSON array of such objects. Otherwise reply normally.\n")


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # undeclared fields are rejected by server/fields.py


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # calls are always grammar-checked where the choice forces one


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


@dataclass(frozen=True)
class ToolPlan:
    tools: list[Tool]
    choice: str  # "auto", "required", or the name of the function that must be called
    parallel: bool
    native: bool  # the chat template renders tools itself

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.native else None

    def system_prompt(self) -> str:
        lines = (json.dumps(t.function.model_dump(exclude={"strict"}, exclude_none=True)) for t in self.tools)
        return GENERIC_PROMPT + "\n".join(lines)

    def grammar(self) -> dict | None:
        """The structured-outputs spec that admits only calls, for `required` and a named function."""
        if not self.forced:
            return None
        tools = self.tools if self.choice == "required" else [t for t in self.tools if t.function.name == self.choice]
        schema, defs = _calls_schema(tools, self.parallel and self.choice == "required")
        return {"json": {**schema, "$defs": defs} if defs else schema}

    def parse(self, text: str) -> list[ToolCall] | None:
        """The reply as tool calls, or None if it is not (only) calls to these tools."""
        blocks = TAG.findall(text) if "<tool_call>" in text else [text]
        calls = []
        for block in blocks:
            try:
                value = json.loads(block.strip())
            except ValueError:
                return None
            for item in value if isinstance(value, list) else [value]:
                call = self._call(item)
                if call is None:
                    return None
                calls.append(call)
        return calls or None

    def _call(self, item) -> ToolCall | None:
        names = {t.function.name for t in self.tools}
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))  # Llama 3 says "parameters"
        if not isinstance(arguments, dict):
            return None
        return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=item["name"],
                                                                                   arguments=json.dumps(arguments)))


def tool_plan(fields, chat_template: str | None) -> ToolPlan | None:
    """What a chat request's tools, tool_choice and parallel_tool_calls ask for.

    None when there are no tools to offer, or tool_choice is 'none'.
    """
    choice = fields.tool_choice
    if not fields.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, f"tool_choice={_choice_name(choice)!r} needs tools; none were given",
                           param="tool_choice")
        return None
    names = [t.function.name for t in fields.tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"tools: function names must be distinct, got {names}", param="tools")
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not among tools "
                            f"{names}", param="tool_choice")
    return ToolPlan(list(fields.tools), _choice_name(choice or "auto"), fields.parallel_tool_calls is not False,
                    renders_tools(chat_template))


def renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def output_constraint(req, plan: ToolPlan | None) -> tuple[StructuredOutputsParams | None, str | None]:
    """A chat request's (spec, field): its structured-output field, or the grammar of forced tool calls."""
    structured, field = structured_outputs(req)
    calls = plan.grammar() if plan is not None else None
    if calls is None:
        return structured, field
    if structured is not None:
        raise APIError(400, f"{field} and tool_choice={plan.choice!r} both constrain the output; use one",
                       param=field)
    return StructuredOutputsParams(**calls), "tools"


def render_history(messages: list[dict], plan: ToolPlan | None, native: bool) -> list[dict]:
    """Messages with past tool calls and results in the form the template can render, and the tools prompt."""
    messages = [_native_message(m) if native else _generic_message(m) for m in messages]
    if plan is None or plan.native:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + plan.system_prompt()}] + messages[1:]
    return [{"role": "system", "content": plan.system_prompt()}] + messages


def _native_message(m: dict) -> dict:
    """HF templates take a call's arguments as an object."""
    if not m.get("tool_calls"):
        return m
    calls = [{"id": c["id"], "type": "function",
              "function": {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
             for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def _generic_message(m: dict) -> dict:
    if m["role"] == "tool":
        name = f" ({m['name']})" if m.get("name") else ""
        return {"role": "user", "content": f"Result of tool call {m.get('tool_call_id') or ''}{name}: {m['content']}"}
    if not m.get("tool_calls"):
        return m
    calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
             for c in m["tool_calls"]]
    text = json.dumps(calls[0] if len(calls) == 1 else calls)
    return {"role": m["role"], "content": (m["content"] + "\n" if m["content"] else "") + text}


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        raise APIError(400, f"messages: tool call arguments must be a JSON object, got {text[:80]!r}",
                       param="messages") from None
    if not isinstance(value, dict):
        raise APIError(400, f"messages: tool call arguments must be a JSON object, got {text[:80]!r}",
                       param="messages")
    return value


def _calls_schema(tools: list[Tool], parallel: bool) -> tuple[dict, dict]:
    """A JSON schema of one call (or an array of calls) to any of `tools`, and the $defs it refers to."""
    defs: dict = {}
    calls = [_call_schema(t.function, defs) for t in tools]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return ({"type": "array", "items": one, "minItems": 1} if parallel else one), defs


def _call_schema(function: FunctionDefinition, defs: dict) -> dict:
    """`$ref`s point at the document root, so each function's `$defs` move to the root of the call schema."""
    parameters = copy.deepcopy(function.parameters) or {"type": "object"}
    for key in ("$defs", "definitions"):
        for name, sub in (parameters.pop(key, None) or {}).items():
            if defs.setdefault(name, _root_refs(sub)) != _root_refs(sub):
                raise APIError(400, f"tools: two functions define {name!r} differently in their $defs; rename one",
                               param="tools")
    return {"type": "object", "properties": {"name": {"const": function.name}, "arguments": _root_refs(parameters)},
            "required": ["name", "arguments"], "additionalProperties": False}


def _root_refs(schema):
    """'#/definitions/X' -> '#/$defs/X', where every function's definitions now live."""
    if isinstance(schema, dict):
        return {k: v.replace("#/definitions/", "#/$defs/", 1) if k == "$ref" and isinstance(v, str) else _root_refs(v)
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_root_refs(v) for v in schema]
    return schema


def _choice_name(choice) -> str:
    return choice.function.name if isinstance(choice, NamedToolChoice) else choice
