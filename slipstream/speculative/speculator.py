"""Speculator: which decoding sequences verify draft tokens this step, and which drafts.

Owns the proposer, the rule for when not to speculate and the acceptance counters. A step
that verifies drafts costs more than a plain decode step (VERIFY_COST: every row carries
1 + k tokens, and the fused decode stack takes one token per row, so the step runs layer by
layer). Each sequence keeps a running mean of the drafts it got accepted per verification;
a step speculates only where the tokens it expects (1 + that mean for each row with drafts,
1 for the others) beat the cost of the step, in plain decode steps. A sequence whose mean
could not pay for a verification even alone pauses for PAUSE_TOKENS tokens, then starts
again from the optimistic guess. Sequences under a grammar never speculate (their masks
would have to follow every draft). Drafts never reach past max_tokens or max_model_len.
Must never know blocks or the model.
"""
from __future__ import annotations

import itertools

from slipstream.engine.sequence import Sequence
from slipstream.speculative.config import SpeculativeConfig
from slipstream.speculative.ngram import NgramProposer

# CPU time of a step whose rows each verify 4 drafts over a plain decode step, by decoding rows;
# SmolLM2-135M bf16, 1 thread, 2-core Xeon with AMX (cpu model 207), drafts always rejected
# (benchmarks/speculative.py --measure-cost). Beyond the last row count: never speculate.
VERIFY_COST = ((1, 2.05), (2, 2.18), (4, 2.64), (8, 3.03), (16, 3.59))
PAUSE_TOKENS = 32
DECAY = 0.5  # weight of the past in a sequence's running mean of accepted drafts


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(config)
        self.max_model_len = max_model_len
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    def propose(self, decodes: list[Sequence]) -> dict[Sequence, list[int]]:
        """Draft tokens for this step's decoding sequences, or none where the step would not pay."""
        cost = verify_cost(len(decodes))
        if cost is None:
            return {}
        drafts = {seq: d for seq in decodes if (d := self._drafts(seq))}
        expected = len(decodes) + sum(_expected_accepted(seq, self.k) for seq in drafts)
        return drafts if expected > cost * len(decodes) else {}

    def _drafts(self, seq: Sequence) -> list[int]:
        if seq.grammar is not None or seq.num_tokens < seq.spec_paused_until:
            return []
        k = min(self.k, seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
        return self.proposer.propose(seq.token_ids, k) if k > 0 else []

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """Count one verification and update the sequence's running mean of accepted drafts."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        m = seq.metrics
        m.num_drafts, m.num_draft_tokens = m.num_drafts + 1, m.num_draft_tokens + num_drafted
        m.num_accepted_tokens += num_accepted
        seq.spec_accepted = DECAY * _expected_accepted(seq, self.k) + (1 - DECAY) * num_accepted
        if 1 + seq.spec_accepted <= VERIFY_COST[0][1]:  # could not pay even alone
            seq.spec_paused_until, seq.spec_accepted = seq.num_tokens + PAUSE_TOKENS, None

    def stats(self) -> dict:
        drafts, tokens, accepted = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": tokens,
                "spec_decode_num_accepted_tokens": accepted,
                "spec_decode_acceptance_rate": accepted / tokens if tokens else 0.0,
                "spec_decode_mean_accepted_length": 1 + accepted / drafts if drafts else 0.0}


def verify_cost(num_decodes: int) -> float | None:
    """VERIFY_COST interpolated linearly in the number of rows; None beyond the table."""
    for (n0, c0), (n1, c1) in itertools.pairwise(VERIFY_COST):
        if num_decodes <= n1:
            return c0 + (c1 - c0) * max(num_decodes - n0, 0) / (n1 - n0)
    return None


def _expected_accepted(seq: Sequence, k: int) -> float:
    """A sequence's running mean of accepted drafts; before its first verification, all of them."""
    return k if seq.spec_accepted is None else seq.spec_accepted
