"""server/tools.py without a model: the forced-call grammar's schema, parsing replies, rendering history."""
from __future__ import annotations

import json

import pytest

from slipstream.server.errors import APIError
from slipstream.server.tools import GENERIC_PROMPT, NamedToolChoice, Tool, render_history, tool_plan
from slipstream.structured.schema import check_schema


class Fields:
    def __init__(self, tools, tool_choice=None, parallel_tool_calls=None):
        self.tools = [Tool(**t) for t in tools]
        self.tool_choice, self.parallel_tool_calls = tool_choice, parallel_tool_calls


def function(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


NESTED = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
          "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_forced_calls_schema_hoists_defs_and_names_each_function():
    plan = tool_plan(Fields([function("a", NESTED), function("b")], "required"), None)
    schema = plan.grammar()["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema["$defs"] == NESTED["$defs"]
    names = [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]]
    assert names == ["a", "b"]
    check_schema(schema)
    single = tool_plan(Fields([function("a"), function("b")], NamedToolChoice(function={"name": "b"})), None)
    assert single.grammar()["json"]["properties"]["name"] == {"const": "b"}


def test_conflicting_defs_are_a_400():
    other = json.loads(json.dumps(NESTED).replace('"string"', '"integer"'))
    with pytest.raises(APIError, match="Place"):
        tool_plan(Fields([function("a", NESTED), function("b", other)], "required"), None).grammar()


@pytest.mark.parametrize("text,names", [
    ('{"name": "a", "arguments": {"x": 1}}', ["a"]),
    ('[{"name": "a", "arguments": {}}, {"name": "b", "parameters": {"y": 2}}]', ["a", "b"]),
    ('<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "a", "arguments": {}}',
     ["b", "a"]),
    ('{"name": "zzz", "arguments": {}}', None), ('{"name": "a", "arguments": "x"}', None),
    ("Sure, here it is.", None), ('{"name": "a", "arguments": {}} and more', None),
])
def test_parse(text, names):
    calls = tool_plan(Fields([function("a"), function("b")]), None).parse(text)
    assert (None if calls is None else [c.function.name for c in calls]) == names
    for call in calls or []:
        assert call.id.startswith("call_") and isinstance(json.loads(call.function.arguments), dict)


def test_generic_history_and_system_prompt():
    plan = tool_plan(Fields([function("a")]), "{{ messages }}")
    call = {"id": "call_1", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    out = render_history(messages, plan, native=False)
    assert out[0]["content"].startswith("Be brief.\n\n" + GENERIC_PROMPT) and '"name": "a"' in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"name": "a", "arguments": {"x": 1}} and "tool_calls" not in out[2]
    assert out[3] == {"role": "user", "content": "Result of tool call call_1: 42"}
    native = render_history(messages, None, native=True)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1} and native[3]["role"] == "tool"


def test_bad_history_arguments_are_a_400():
    call = {"id": "c", "type": "function", "function": {"name": "a", "arguments": "not json"}}
    with pytest.raises(APIError, match="arguments must be a JSON object"):
        render_history([{"role": "assistant", "content": "", "tool_calls": [call]}], None, native=False)
