"""BodyLimitMiddleware: a request body over the limit is a 413 and is never held in memory.

A body whose Content-Length is over the limit is refused before any of it is read; a
chunked body, as soon as the bytes read pass the limit. Any other body is read here in
full (as the app would read it anyway) and handed on, followed by whatever the client
sends next (a disconnect, which aborts a running request).
"""
from __future__ import annotations

from slipstream.server.errors import APIError


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(f"request body is {int(declared)} bytes", scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left; the app will hear it
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(f"request body exceeds {self.max_bytes} bytes", scope, receive, send)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, what: str, scope, receive, send) -> None:
        response = APIError(413, f"{what}; at most {self.max_bytes} bytes are allowed (--max-request-body-bytes)",
                            code="request_too_large").response(headers={"Connection": "close"})
        await response(scope, receive, send)


def _replay(messages: list[dict], receive):
    """A receive() that returns `messages` first, then whatever the client sends next."""
    pending = list(messages)

    async def replayed() -> dict:
        return pending.pop(0) if pending else await receive()

    return replayed
