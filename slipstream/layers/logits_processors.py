"""Logits processors: per-request edits of the raw logits, applied before temperature and sampling.

Each processor takes the batch's logits [B, V] (float32, edited in place) and the step's
SamplingMetadata, and touches only the rows whose parameters ask for it. The sampler runs
them in order: allowed_token_ids, logit_bias, min_tokens, then the penalties (vLLM's order:
restrictions and biases first, penalties on the result).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from slipstream.sampling_params import SamplingParams

if TYPE_CHECKING:
    from slipstream.layers.sampler import SamplingMetadata

LogitsProcessor = Callable[[torch.Tensor, "SamplingMetadata"], None]


def allowed_token_ids(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    for row, p in enumerate(meta.params):
        if p.allowed_token_ids:
            keep = torch.tensor(p.allowed_token_ids, device=logits.device)
            logits[row] = torch.full_like(logits[row], float("-inf")).index_copy_(0, keep, logits[row, keep])


def logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    for row, p in enumerate(meta.params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[row].index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=logits.device))


class MinTokens:
    """Stop tokens (stop_token_ids, and EOS unless ignore_eos) are masked until min_tokens outputs exist.

    Except where nothing else is left (a grammar that can only end, or allowed_token_ids
    made only of stops): the sequence ends early rather than sampling from no token at all.
    """

    def __init__(self, eos_token_ids: list[int]):
        self.eos_token_ids = eos_token_ids

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> None:
        for row, (p, tokens, prompt) in enumerate(zip(meta.params, meta.token_ids, meta.num_prompt_tokens)):
            if len(tokens) - prompt < p.min_tokens:
                stops = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                if stops:
                    kept = logits[row, stops].clone()
                    logits[row, stops] = float("-inf")
                    if not torch.isfinite(logits[row]).any():
                        logits[row, stops] = kept


def penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """repetition_penalty over prompt and output tokens; presence and frequency over the output."""
    for row, (p, tokens, prompt) in enumerate(zip(meta.params, meta.token_ids, meta.num_prompt_tokens)):
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            _penalize(logits[row], p, tokens, prompt)


def _penalize(row: torch.Tensor, p: SamplingParams, tokens: list[int], prompt: int) -> None:
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(tokens, device=row.device).unique()
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and len(tokens) > prompt:
        counts = torch.bincount(torch.tensor(tokens[prompt:], device=row.device), minlength=row.numel()).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def default_processors(eos_token_ids: list[int]) -> list[LogitsProcessor]:
    return [allowed_token_ids, logit_bias, MinTokens(eos_token_ids), penalties]
