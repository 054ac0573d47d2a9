"""Request: what a user submitted, and the sequences (n of them) generating its outputs."""
from __future__ import annotations

from dataclasses import dataclass

from slipstream.engine.sequence import Sequence
from slipstream.outputs import CompletionOutput, RequestMetrics, RequestOutput
from slipstream.sampling_params import SamplingParams


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.seqs[0].prompt_logprobs,
            outputs=[_completion(s) for s in self.seqs],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.seqs[0].num_cached_tokens,
        )


def _completion(seq: Sequence) -> CompletionOutput:
    return CompletionOutput(
        index=seq.index,
        text=seq.output_text,
        token_ids=list(seq.output_token_ids),
        cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
        logprobs=seq.logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )
