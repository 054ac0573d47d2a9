"""How much one request may ask of the server: body size, prompts, stop strings.

Each limit is checked before the work it bounds is done, and its error names the limit and
the flag that sets it: a body over `max_request_body_bytes` is a 413 (body_limit.py); too
many prompts, too many or too long stop strings are 400s before anything is tokenized.
Every stop string is searched for after every token and held back from streams until it
cannot match, so their number and length are the per-token cost a request imposes on the
engine thread. The prompt's own length (characters, then tokens, against max_model_len)
is the InputProcessor's check. No web framework here: the CLI reads the defaults without
importing one.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ServerLimits:
    max_request_body_bytes: int = 2**20  # nginx's default; see the module docstring
    max_prompts_per_request: int = 64  # the engine's default max_num_seqs: one request fills one batch
    max_stop_strings: int = 64  # OpenAI allows 4; vLLM has no limit
    max_stop_string_length: int = 1024  # characters

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name}={value!r} must be a positive integer")

    # The errors start with the field's name, which the server reports as the 400's param.
    def check_prompts(self, count: int) -> None:
        if count > self.max_prompts_per_request:
            raise ValueError(f"prompt: {count} prompts in one request; at most {self.max_prompts_per_request} "
                             "are allowed (--max-prompts-per-request)")

    def check_stop(self, stop: str | list[str] | None) -> None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > self.max_stop_strings:
            raise ValueError(f"stop: {len(stops)} stop strings; at most {self.max_stop_strings} are allowed "
                             "(--max-stop-strings)")
        longest = max(map(len, stops), default=0)
        if longest > self.max_stop_string_length:
            raise ValueError(f"stop: a stop string of {longest} characters; at most {self.max_stop_string_length} "
                             "are allowed (--max-stop-string-length)")

