"""No silent ignores: a request field is honoured, on the accepted-and-ignored list below, or a 400 naming it.

The request models keep the fields they do not declare (`extra="allow"`); this walks a
parsed request, nested messages, tools and formats included, and rejects the first such
field that is set. A field sent as null means "the default" and is never an error.
"""
from __future__ import annotations

from pydantic import BaseModel

from slipstream.server.errors import APIError

# OpenAI fields about storage, billing and identity: they change nothing about the output.
IGNORED = {
    "user": "an end-user id for the provider's abuse monitoring",
    "store": "whether the provider stores the completion",
    "metadata": "tags for stored completions",
    "service_tier": "the provider's latency tier",
    "prompt_cache_key": "a hint for the provider's prompt cache (the prefix cache needs none)",
    "safety_identifier": "an end-user id for the provider's safety checks",
}


def check_fields(request: BaseModel) -> None:
    """Raise a 400 naming the first field of `request` (at any depth) that is neither declared nor ignored."""
    path = _first_unknown(request, "")
    if path is not None:
        raise APIError(400, f"{path}: this field is not supported, so it is rejected rather than ignored; "
                            f"fields accepted and ignored: {', '.join(sorted(IGNORED))}", param=path.split(".")[0])


def _first_unknown(value, path: str) -> str | None:
    if isinstance(value, list):
        return next((p for i, v in enumerate(value) if (p := _first_unknown(v, f"{path}.{i}")) is not None), None)
    if not isinstance(value, BaseModel):
        return None
    for name, extra in (value.model_extra or {}).items():
        if extra is not None and (path or name not in IGNORED):
            return f"{path}.{name}" if path else name
    for name in type(value).model_fields:
        found = _first_unknown(getattr(value, name), f"{path}.{name}" if path else name)
        if found is not None:
            return found
    return None
