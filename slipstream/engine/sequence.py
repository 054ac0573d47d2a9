"""Sequence: one stream of tokens being generated, and everything the engine tracks for it.

A request with n > 1 owns n sequences. A sequence knows its tokens (prompt + output), how
many of them already have K/V in the cache (`num_computed_tokens`), which physical blocks
hold that K/V (`block_table`), and its timings. Preemption resets `num_computed_tokens` to
0 and frees the blocks; the tokens themselves are kept and recomputed. A prefix-cache hit
whose head is computed again (BlockManager) leaves a gap: once the head's tokens are
computed, the cached tokens after it count as computed too (`advance`).
"""
from __future__ import annotations

import enum
import itertools
from concurrent.futures import Future

from slipstream.outputs import RequestMetrics, TokenLogprobs
from slipstream.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 metrics: RequestMetrics, index: int = 0, cache_salt: str | None = None,
                 grammar: Future | None = None):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.metrics = metrics
        self.cache_salt = cache_salt
        self.grammar = grammar  # structured outputs: a Future of its CompiledGrammar, compiled off this thread
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks (prefix cache)
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.cached_gap: tuple[int, int] | None = None  # (end of a head computed again, end of its cached hit)
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.num_preemptions = 0
        self.spec_accepted: float | None = None  # speculative decoding: running mean of accepted drafts
        self.spec_paused_until = 0  # no drafts before the sequence has this many tokens
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.output_text = ""
        # incremental detokenization window; a few prompt tokens give the first output its spacing
        self.read_offset = self.num_prompt_tokens
        self.prefix_offset = max(0, self.num_prompt_tokens - 5)
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_schedulable_tokens(self) -> int:
        """Uncomputed tokens that one chunk may take: a head computed again ends its chunk (`cached_gap`)."""
        return (self.cached_gap[0] if self.cached_gap else self.num_tokens) - self.num_computed_tokens

    def advance(self, num_tokens: int) -> None:
        """`num_tokens` more tokens have K/V; at the end of a head computed again, so do the cached ones after it."""
        self.num_computed_tokens = min(self.num_computed_tokens + num_tokens, self.num_tokens)
        if self.cached_gap and self.num_computed_tokens == self.cached_gap[0]:
            self.num_computed_tokens, self.cached_gap = self.cached_gap[1], None

    @property
    def grammar_ready(self) -> bool:
        """No grammar, or one compiled (a failed one is never ready: the engine aborts its request)."""
        return self.grammar is None or (self.grammar.done() and self.grammar.exception() is None)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while some prompt token still lacks its log-probability."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens


