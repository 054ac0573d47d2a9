"""Speculator: how many draft tokens each decoding sequence verifies this step, and when none.

Owns the proposer, the rules for when not to speculate and the acceptance counters. Per
step: no drafts when more than MAX_BATCH sequences decode (a batch that large is no longer
bound by reading the weights, so verifying k more tokens per row costs about k more decode
steps). Per sequence: a running mean of recent acceptance; below MIN_ACCEPTANCE the
sequence stops proposing for PAUSE_TOKENS tokens, then tries again. Sequences under a
grammar never speculate (their masks would have to follow every draft). Drafts never reach
past max_tokens or max_model_len. Must never know blocks or the model.
"""
from __future__ import annotations

from slipstream.engine.sequence import Sequence
from slipstream.speculative.config import SpeculativeConfig
from slipstream.speculative.ngram import NgramProposer

MAX_BATCH = 16
MIN_ACCEPTANCE = 0.25
PAUSE_TOKENS = 32
DECAY = 0.5  # weight of the past in the running mean of acceptance


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(config)
        self.max_model_len = max_model_len
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    def drafts(self, seq: Sequence, budget: int, num_decodes: int) -> list[int]:
        """Draft tokens for a decoding `seq`, at most `budget` of them."""
        if num_decodes > MAX_BATCH or seq.grammar is not None or seq.num_tokens < seq.spec_paused_until:
            return []
        k = min(self.k, budget, seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens - 1)
        return self.proposer.propose(seq.token_ids, k) if k > 0 else []

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """Count one verification and update the sequence's recent acceptance."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        m = seq.metrics
        m.num_drafts, m.num_draft_tokens = m.num_drafts + 1, m.num_draft_tokens + num_drafted
        m.num_accepted_tokens += num_accepted
        seq.spec_acceptance = DECAY * seq.spec_acceptance + (1 - DECAY) * num_accepted / num_drafted
        if seq.spec_acceptance < MIN_ACCEPTANCE:
            seq.spec_paused_until, seq.spec_acceptance = seq.num_tokens + PAUSE_TOKENS, 1.0

    def stats(self) -> dict:
        drafts, tokens, accepted = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": tokens,
                "spec_decode_num_accepted_tokens": accepted,
                "spec_decode_acceptance_rate": accepted / tokens if tokens else 0.0,
                "spec_decode_mean_accepted_length": 1 + accepted / drafts if drafts else 0.0}
