"""Streaming a chat reply that may be tool calls: OpenAI's `delta.tool_calls` chunks.

Under `required` or a named function the reply is calls, so it is held until it ends and
then sent as calls. Under `auto` text is streamed as content unless its first non-blank
character could begin a call (`{`, `[`, or a `<tool_call>` tag); such a reply is held to
the end and sent as calls if it parses as calls, else as content. Each call goes out as
two deltas: its index, id and name, then its arguments.
"""
from __future__ import annotations

from slipstream.server.tools import ToolCall, ToolPlan

CALL_STARTS = ("{", "[", "<")


class ToolCallStream:
    """One choice's stream: feed it text deltas, send what it returns."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.decided = self.holding = plan.forced
        self.held = ""
        self.calls: list[ToolCall] | None = None

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content to send now, tool-call deltas to send now)."""
        if not self.decided:
            self.held += text
            head = self.held.lstrip()
            if not head and not finished:
                return "", []
            self.decided, self.holding = True, head.startswith(CALL_STARTS)
            text, self.held = self.held, ""
        if not self.holding:
            return text, []
        self.held += text
        if not finished:
            return "", []
        self.calls = self.plan.parse(self.held)
        return ("", deltas(self.calls)) if self.calls else (self.held, [])


def deltas(calls: list[ToolCall]) -> list[dict]:
    out = []
    for i, call in enumerate(calls):
        out.append({"index": i, "id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": ""}})
        out.append({"index": i, "function": {"arguments": call.function.arguments}})
    return out
