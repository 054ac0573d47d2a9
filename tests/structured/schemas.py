"""A JSON schema with a finite language (enums, bounded integers and strings, a short array) and its checker."""
from __future__ import annotations

import json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "pet": {"type": "object", "properties": {"legs": {"type": "integer", "minimum": 0, "maximum": 8}},
                "required": ["legs"], "additionalProperties": False},
    },
    "required": ["name", "age", "color", "tags", "pet"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{2}-\d{3}"
CHOICES = ["alpha", "beta", "gamma delta"]


def check_schema_output(text: str) -> None:
    value = json.loads(text)
    assert set(value) == set(SCHEMA["properties"]), text
    assert 1 <= len(value["name"]) <= 6 and isinstance(value["name"], str)
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert value["color"] in SCHEMA["properties"]["color"]["enum"]
    assert len(value["tags"]) <= 3 and all(isinstance(t, bool) for t in value["tags"])
    assert set(value["pet"]) == {"legs"} and 0 <= value["pet"]["legs"] <= 8
