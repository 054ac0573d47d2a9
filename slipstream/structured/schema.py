"""JSON-schema keywords the grammar cannot enforce: rejected by name instead of silently dropped.

xgrammar turns a schema into a grammar and ignores keywords it has no rule for (measured
keyword by keyword on 0.2.9: the grammar text does not change). A request that asks for
`uniqueItems` and gets duplicates would be a silent ignore, so those keywords are refused
with their path. Annotations (title, description, default, examples, ...) constrain
nothing and are accepted. Must never know the grammar library's API.
"""
from __future__ import annotations

# keyword -> the value at which it constrains nothing (the library's behaviour anyway)
UNSUPPORTED = {
    "uniqueItems": False, "contains": None, "minContains": None, "maxContains": None,
    "propertyNames": None, "dependentRequired": None, "dependentSchemas": None, "dependencies": None,
    "if": None, "then": None, "else": None, "not": None, "$dynamicRef": None, "$recursiveRef": None,
    "unevaluatedProperties": False, "unevaluatedItems": False,
}
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems")


def check_schema(schema, path: str = "#") -> None:
    """Raise ValueError naming the first keyword at `path` (or below) that the grammar cannot enforce."""
    if not isinstance(schema, dict):
        return  # true/false schemas; the grammar library judges them
    for keyword, neutral in UNSUPPORTED.items():
        if keyword in schema and schema[keyword] != neutral:
            raise ValueError(f"structured_outputs.json: the schema keyword {keyword!r} at {path} is not supported "
                             f"(it cannot be enforced while generating); remove it")
    _check_required(schema, path)
    for name in SCHEMA_MAPS:
        for key, sub in (schema.get(name) or {}).items() if isinstance(schema.get(name), dict) else ():
            check_schema(sub, f"{path}/{name}/{key}")
    for name in SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(name) or []) if isinstance(schema.get(name), list) else ():
            check_schema(sub, f"{path}/{name}/{i}")
    for name in SCHEMA_VALUES:
        check_schema(schema.get(name), f"{path}/{name}")


def _check_required(schema: dict, path: str) -> None:
    """A required property that no rule allows makes the schema unsatisfiable."""
    if schema.get("additionalProperties") is not False or schema.get("patternProperties"):
        return
    properties = schema.get("properties") or {}
    missing = [r for r in schema.get("required") or [] if r not in properties]
    if missing:
        raise ValueError(f"structured_outputs.json: the schema at {path} requires {missing} but defines no such "
                         "properties and allows no others, so no object can satisfy it")
