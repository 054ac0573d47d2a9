"""Request fields that constrain the output -> one StructuredOutputsParams, or a 400 naming the field.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and vLLM's extras
(`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and `structured_outputs`
with its option names) all say the same thing; at most one of them may be set. A
`json_schema` is enforced whatever its `strict` says: the grammar makes every output match,
which `strict: false` permits. Whether a schema, regex or grammar is valid is decided by the
engine at add_request; its error is renamed here to the field the client sent. Must never
know the engine.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from slipstream.server.errors import APIError
from slipstream.structured.params import KINDS, StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)  # extras: server/fields.py

    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def structured_outputs(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """A request's (spec, the field it came from), of response_format, guided_* and structured_outputs.

    (None, None) when the output is free text.
    """
    given = {name: spec for name, spec in _specs(req).items() if spec is not None}
    if len(given) > 1:
        raise APIError(400, f"{' and '.join(given)} each constrain the output; set at most one of them",
                       param=next(iter(given)))
    if not given:
        return None, None
    (field, spec), = given.items()
    unknown = sorted(set(spec) - set(KINDS))
    if unknown:
        raise APIError(400, f"{field}: unsupported option(s) {unknown}; allowed: {', '.join(KINDS)}", param=field)
    try:
        return StructuredOutputsParams(**spec), field
    except ValueError as e:
        raise APIError(400, f"{field}: {_without_prefix(str(e))}", param=field) from None


def renamed(error: ValueError, field: str | None) -> APIError | None:
    """The engine's complaint about a spec, as a 400 naming the request field; None if it is about something else."""
    message = str(error)
    if field is None or not message.startswith("structured_outputs"):
        return None
    return APIError(400, f"{field}: {_without_prefix(message)}", param=field)


def _specs(req) -> dict[str, dict | None]:
    specs = {name: None if getattr(req, name) is None else {kind: getattr(req, name)} for name, kind in GUIDED.items()}
    specs["structured_outputs"] = req.structured_outputs
    specs["response_format"] = _response_format(req.response_format)
    return specs


def _response_format(fmt: ResponseFormat | None) -> dict | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format: type 'json_schema' needs json_schema.schema (a JSON schema object)",
                       param="response_format")
    return {"json": fmt.json_schema.schema_}


def _without_prefix(message: str) -> str:
    """'structured_outputs.json: the schema ...' -> 'json: the schema ...' (the caller names the field)."""
    return re.sub(r"^structured_outputs(\.|:\s*)", "", message)
