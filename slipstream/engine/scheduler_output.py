"""SchedulerOutput: one step's work as data, the only thing the scheduler hands the model runner.

There are no prefill or decode phases here, only sequences whose computed tokens catch up
with the tokens they have: a prompt chunk, one decode token, or several tokens to verify.
The runner keeps what it needs of each sequence (its tokens, block table, sampling state)
from the first time the sequence is scheduled until it is named in `finished_seq_ids`, so
later steps send only what changed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slipstream.sampling_params import SamplingParams

if TYPE_CHECKING:
    from slipstream.structured.grammars import CompiledGrammar


@dataclass(slots=True)
class NewSequence:
    """A sequence the runner has not seen: its tokens so far and how to sample it."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    index: int = 0  # which of the request's n samples: seeds its random stream
    grammar: CompiledGrammar | None = None  # structured outputs: compiled, immutable, shared by the request's samples


@dataclass(slots=True)
class ScheduledSequence:
    seq_id: int
    num_new_tokens: int       # tokens whose K/V this step computes
    num_computed_tokens: int  # tokens already in the cache before this step
    new_block_ids: list[int]  # appended to the sequence's block table (its whole table when `resumed`)
    resumed: bool = False     # its block table starts over (preempted, or cut back after rejected drafts)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify: the last of the new tokens


@dataclass
class SchedulerOutput:
    new_sequences: list[NewSequence] = field(default_factory=list)
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
