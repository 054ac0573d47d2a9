"""StructuredOutputsParams: what one request's output must match, with vLLM's option names.

Exactly one of `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice` (a
list of strings), `grammar` (EBNF as xgrammar reads it, `root ::= ...`; Lark when it has no
`::=`) or `json_object=True` (any JSON object). Checked here for shape only; whether a
schema, regex or grammar is valid is decided by grammars.py. Must never import a grammar
library: SamplingParams carries this through every layer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    key: tuple[str, str] = field(init=False, repr=False, compare=False)  # (kind, spec text): the cache key

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: exactly one of {', '.join(KINDS)} must be set, got "
                             f"{given or 'none'}")
        kind = given[0]
        object.__setattr__(self, "key", (kind, _spec_text(kind, getattr(self, kind))))

    @property
    def kind(self) -> str:
        return self.key[0]

    @property
    def is_json(self) -> bool:
        return self.kind in ("json", "json_object")


def _spec_text(kind: str, value) -> str:
    if kind == "json":
        schema = _schema(value)
        return json.dumps(schema)  # key order kept: properties are generated in the order given
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"structured_outputs.choice={value!r} is invalid; it must be a non-empty list of "
                             "non-empty strings")
        return json.dumps(value)
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"structured_outputs.json_object={value!r} is invalid; it must be true")
        return ""
    if not (isinstance(value, str) and value):
        raise ValueError(f"structured_outputs.{kind}={value!r} is invalid; it must be a non-empty string")
    return value


def _schema(value) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json: the schema is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs.json: a JSON schema must be an object, got {type(value).__name__}")
    return value
