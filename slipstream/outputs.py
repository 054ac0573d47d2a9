"""What the engine hands back for a request, shaped like vLLM's outputs."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# One entry per token: {token_id: Logprob}; the sampled/prompt token is always included.
TokenLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """Timings in seconds, measured on the engine's monotonic clock."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    # speculative decoding: verification steps, draft tokens verified, and accepted
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per verification step: the accepted drafts and the token sampled after them (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def queue_time(self) -> float | None:
        return _diff(self.first_scheduled_time, self.arrival_time)

    @property
    def ttft(self) -> float | None:
        return _diff(self.first_token_time, self.arrival_time)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's definition)."""
        if self.num_generation_tokens < 2 or self.first_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return _diff(self.finished_time, self.arrival_time)


def _diff(end: float | None, start: float) -> float | None:
    return None if end is None else end - start


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
