"""API keys: every route but /health needs `Authorization: Bearer <key>`.

The key comes from `--api-key` or, better, from the SLIPSTREAM_API_KEY environment variable
(a command line is visible to every user in `ps`). The scheme is case-insensitive (RFC 7235:
`bearer`, `BEARER` and `Bearer` are the same) and a 401 says how to authenticate in its
`WWW-Authenticate` header (RFC 6750). Must never log or echo the key.
"""
from __future__ import annotations

import os
import secrets

from starlette.datastructures import Headers

from slipstream.server.errors import APIError

API_KEY_ENV = "SLIPSTREAM_API_KEY"
UNPROTECTED = {"/health"}  # load balancers probe it without credentials


def resolve_api_key(flag: str | None) -> str | None:
    """The key from the command line, else from the environment; None means no authentication."""
    key = flag if flag is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        source = "--api-key" if flag is not None else API_KEY_ENV
        raise ValueError(f"{source} is set but empty; give a key, or unset it to serve without authentication")
    return key


class APIKeyMiddleware:
    """Plain ASGI, so that streamed responses pass through untouched."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in UNPROTECTED:
            return await self.app(scope, receive, send)
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        given = token.strip().encode("utf-8", "replace")
        if scheme.lower() == "bearer" and secrets.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        challenge = 'Bearer realm="slipstream"' + (', error="invalid_token"' if scheme else "")
        response = APIError(401, "missing or invalid API key; send the header 'Authorization: Bearer <key>'",
                            code="invalid_api_key").response(headers={"WWW-Authenticate": challenge})
        await response(scope, receive, send)
