"""Speculator: which decoding sequences verify draft tokens this step, and which drafts.

Owns the rule for when not to speculate and the acceptance counters; the proposer (n-gram
lookup or a draft model) says which tokens. A step that verifies drafts costs more than a
plain decode step (VERIFY_COST: every sequence carries 1 + k tokens, run as 1 + k rows),
and the proposal's on top: a draft model's k steps cost what the engine measures them to,
relative to the forward that follows (the proposer's guess until measured); after
PROBE_STEPS steps without drafts a step speculates anyway, so that a measurement or an
acceptance rate that turned speculation off is taken again. Each sequence keeps a
running mean of the drafts it got accepted per verification; a step speculates only where
the tokens it expects (1 + that mean for each row with drafts, 1 for the others) beat the
cost of the step, in plain decode steps. A sequence whose mean could not pay for a
verification even alone pauses for PAUSE_TOKENS tokens, then starts again from the mean
over all sequences (which a new sequence starts from too; k before any verification). Sequences under a grammar never speculate (their masks
would have to follow every draft). Drafts never reach past max_tokens or max_model_len.
Must never know blocks or the model.
"""
from __future__ import annotations

import collections
import itertools
import statistics
import time

from slipstream.engine.sequence import Sequence
from slipstream.speculative.config import SpeculativeConfig

# CPU time of a step whose rows each verify 4 drafts over a plain decode step, by decoding rows;
# SmolLM2-135M bf16, 1 thread, 2-core Xeon with AMX (cpu model 207), drafts always rejected
# (benchmarks/speculative.py --measure-cost), the more of 32- and 256-token contexts (at 1,024
# tokens: 1.52, 1.70, 1.40, 1.40, 1.28). The verifying rows run as single-token rows through
# the fused decode stack. Beyond the last row count: never speculate.
VERIFY_COST = ((1, 1.28), (2, 1.36), (4, 1.69), (8, 1.89), (16, 2.28))
PAUSE_TOKENS = 32
DECAY = 0.5  # weight of the past in a sequence's running mean of accepted drafts
PRIOR_DECAY = 0.9  # ... and in the mean over all sequences
COST_SAMPLES = 8  # measured proposals that price a draft (their median), from half as many
# steps without drafts after which a step speculates anyway, to measure again (rarely: a draft
# model's probe may first prefill every sequence's prompt, ~0.3 s at batch 8 here)
PROBE_STEPS = 256


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int):
        self.k = config.num_speculative_tokens
        self.proposer = proposer  # propose(seqs, ks) -> drafts per sequence; step_cost (a guess); finish(seq)
        self.max_model_len = max_model_len
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.mean_accepted = float(self.k)  # over every sequence's verifications: a new sequence's prior
        # VERIFY_COST's row counts -> one draft's last measured costs in decode steps, and steps without drafts
        self.draft_cost: dict[int, collections.deque] = {}
        self._idle: dict[int, int] = {}
        # the last proposal's row bucket and seconds, times VERIFY_COST where its step verifies: the
        # step's forward is then that many decode steps
        self._timed: tuple[int, float] | None = None

    def propose(self, decodes: list[Sequence]) -> dict[Sequence, list[int]]:
        """Draft tokens for this step's decoding sequences, or none where the step would not pay."""
        self._timed = None
        cost, bucket = verify_cost(len(decodes)), _bucket(len(decodes))
        ks = {seq: k for seq in decodes if (k := self._budget(seq)) > 0}
        probe = self._idle.get(bucket, 0) >= PROBE_STEPS  # measure again what the rule has long refused
        if cost is None or not (probe and ks or self._pays(ks, cost, len(decodes))):  # before a costly proposer
            self._idle[bucket] = self._idle.get(bucket, 0) + 1
            return {}
        self._idle[bucket] = 0
        start = time.perf_counter()
        proposals = self.proposer.propose(list(ks), list(ks.values()))
        drafts = {seq: d for seq, d in zip(ks, proposals) if d}
        verifies = bool(drafts) and (probe or self._pays(drafts, cost, len(decodes)))
        self._timed = (bucket, (time.perf_counter() - start) * (cost if verifies else 1.0))
        return drafts if verifies else {}

    def observe(self, step_seconds: float) -> None:
        """The forward after a proposal took step_seconds (VERIFY_COST decode steps where it verified):
        one draft's cost, in decode steps at that many rows, follows."""
        if self._timed is None:
            return
        (bucket, weighted), self._timed = self._timed, None
        samples = self.draft_cost.setdefault(bucket, collections.deque(maxlen=COST_SAMPLES))
        samples.append(weighted / (step_seconds * self.k))

    def _proposal_cost(self, num_decodes: int) -> float:
        """k drafts, in decode steps: the median of the last measurements at this many rows (a
        proposal that first prefills a prompt is an outlier), else the proposer's guess."""
        samples = self.draft_cost.get(_bucket(num_decodes), ())
        return self.k * (statistics.median(samples) if len(samples) >= COST_SAMPLES // 2 else self.proposer.step_cost)

    def _pays(self, speculating, cost: float, num_decodes: int) -> bool:
        expected = num_decodes + sum(self._expected_accepted(seq) for seq in speculating)
        return bool(speculating) and expected > (cost + self._proposal_cost(num_decodes)) * num_decodes

    def _budget(self, seq: Sequence) -> int:
        """How many drafts the sequence may verify this step (none under a grammar or while paused)."""
        if seq.grammar is not None or seq.num_tokens < seq.spec_paused_until:
            return 0
        return min(self.k, seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)

    def finish(self, seq: Sequence) -> None:
        self.proposer.finish(seq)

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """Count one verification and update the sequence's running mean of accepted drafts."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        m = seq.metrics
        m.num_drafts, m.num_draft_tokens = m.num_drafts + 1, m.num_draft_tokens + num_drafted
        m.num_accepted_tokens += num_accepted
        seq.spec_accepted = DECAY * self._expected_accepted(seq) + (1 - DECAY) * num_accepted
        self.mean_accepted = PRIOR_DECAY * self.mean_accepted + (1 - PRIOR_DECAY) * num_accepted
        if 1 + seq.spec_accepted <= VERIFY_COST[0][1] + self._proposal_cost(1):  # could not pay even alone
            seq.spec_paused_until, seq.spec_accepted = seq.num_tokens + PAUSE_TOKENS, None

    def _expected_accepted(self, seq: Sequence) -> float:
        """A sequence's running mean of accepted drafts; before its first verification, every
        sequence's (all k before any)."""
        return self.mean_accepted if seq.spec_accepted is None else seq.spec_accepted

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


def _bucket(num_decodes: int) -> int:
    return next((n for n, _ in VERIFY_COST if num_decodes <= n), VERIFY_COST[-1][0])
