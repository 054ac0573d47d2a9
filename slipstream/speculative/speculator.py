"""Speculator: which decoding sequences verify draft tokens this step, and which drafts.

Owns the rule for when not to speculate and the acceptance counters; the proposer (n-gram
lookup or a draft model) says which tokens. A step that verifies drafts costs more than a
plain decode step (VERIFY_COST: each draft runs as a row of its own), and the proposal's on
top: a draft model's k steps cost what the engine measures them to, relative to the forward
that follows (the proposer's guess until measured); after PROBE_STEPS steps without drafts a
step speculates anyway, so that a measurement or an acceptance rate that turned speculation
off is taken again. Each sequence keeps a running mean of the drafts it got accepted per
verification. A step verifies the drafts of the sequences that raise its expected tokens per
unit of cost the most (most expected accepted drafts per draft first, as many as maximise
the rate), and none where that rate does not beat a plain step's: at batch 8, two sequences
that copy their prompt are worth verifying while six others have nothing to propose. A
sequence whose mean could not pay for a verification even alone pauses for PAUSE_TOKENS
tokens, then starts again from the mean over all sequences (which a new sequence starts
from too; k before any verification). Sequences under a grammar never speculate (their
masks would have to follow every draft). Drafts never reach past max_tokens or
max_model_len. Must never know blocks or the model.
"""
from __future__ import annotations

import bisect
import collections
import statistics
import time

from slipstream.engine.sequence import Sequence
from slipstream.speculative.config import SpeculativeConfig

# CPU time of a step whose n decoding rows each verify 1, 2, 3, 4 drafts, over a plain decode step at
# n rows; SmolLM2-135M bf16, 1 thread, 2-core Xeon with AMX (cpu model 167), 256-token contexts, drafts
# always rejected (benchmarks/speculative.py --measure-cost --repeats 5: medians; 8 rows in all run
# cheaper than 6 here, twice measured). Each draft runs as a single-token row of its own through the
# fused decode stack, reading its sequence's context again while it is hot in cache, so drafts cost
# less than as many rows of other sequences would. Interpolated linearly in rows and in drafts per
# row (past the last column along its slope); beyond the last row count: never speculate.
VERIFY_COST = ((1, (1.06, 1.13, 1.19, 1.27)), (2, (1.11, 1.25, 1.15, 1.21)), (4, (1.01, 1.11, 1.20, 1.37)),
               (8, (1.16, 1.37, 1.53, 1.81)), (16, (1.25, 1.60, 1.79, 2.17)))
PAUSE_TOKENS = 32
DECAY = 0.5  # weight of the past in a sequence's running mean of accepted drafts
PRIOR_DECAY = 0.9  # ... and in the mean over all sequences
COST_SAMPLES = 8  # measured proposals that price a proposal (their lower median), from half as many
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
        n, bucket = len(decodes), _bucket(len(decodes))
        ks = {seq: k for seq in decodes if (k := self._budget(seq)) > 0}
        probe = self._idle.get(bucket, 0) >= PROBE_STEPS  # measure again what the rule has long refused
        ks = self._select(ks, n, probe)  # before a costly proposer: only the sequences that may pay
        if not ks:
            self._idle[bucket] = self._idle.get(bucket, 0) + 1
            return {}
        self._idle[bucket] = 0
        start = time.perf_counter()
        proposals = dict(zip(ks, self.proposer.propose(list(ks), list(ks.values()))))
        chosen = self._select({seq: len(d) for seq, d in proposals.items() if d}, n, probe)
        cost = verify_cost(n, sum(chosen.values())) if chosen else 1.0
        self._timed = (bucket, (time.perf_counter() - start) * cost)
        return {seq: proposals[seq] for seq in chosen}

    def observe(self, step_seconds: float) -> None:
        """The forward after a proposal took step_seconds (that many plain decode steps where it verified):
        the proposal's cost, in plain decode steps at that many rows, follows."""
        if self._timed is None:
            return
        (bucket, weighted), self._timed = self._timed, None
        self.draft_cost.setdefault(bucket, collections.deque(maxlen=COST_SAMPLES)).append(weighted / step_seconds)

    def _proposal_cost(self, num_decodes: int) -> float:
        """A proposal, in plain decode steps: the lower median of the last measurements at this many rows
        (a draft model's first proposal for a sequence also prefills its prompt: an outlier, and at first
        half of the samples may be such), else the proposer's guess for k drafts."""
        samples = self.draft_cost.get(_bucket(num_decodes), ())
        if len(samples) < COST_SAMPLES // 2:
            return self.k * self.proposer.step_cost
        return statistics.median_low(samples)

    def _select(self, drafts: dict[Sequence, int], num_decodes: int, probe: bool = False) -> dict[Sequence, int]:
        """Of the sequences' draft counts, those whose verification gives the most expected tokens per plain
        decode step (each sequence's mean accepted drafts first per draft), if that beats decoding
        without drafts; probing, the most promising one alone (a draft model's probe then prefills one
        prompt, not every sequence's)."""
        order = sorted(drafts, key=lambda seq: self._expected_accepted(seq) / drafts[seq], reverse=True)
        if probe:
            return {seq: drafts[seq] for seq in order[:1] if verify_cost(num_decodes, drafts[seq]) is not None}
        proposal = self._proposal_cost(num_decodes)
        tokens = best_tokens = num_decodes
        best, best_cost, total = 0, 1.0, 0  # no drafts: num_decodes tokens for one plain step
        for i, seq in enumerate(order, 1):
            tokens += min(self._expected_accepted(seq), drafts[seq])
            total += drafts[seq]
            cost = verify_cost(num_decodes, total)
            if cost is None:
                break
            gain = tokens * best_cost - best_tokens * (cost + proposal)  # > 0: more tokens per step than the best
            if gain > 0 or (best and gain == 0):
                best, best_tokens, best_cost = i, tokens, cost + proposal
        return {seq: drafts[seq] for seq in order[:best]}

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
        alone = verify_cost(1, self.k)
        if alone is None or 1 + seq.spec_accepted <= alone + self._proposal_cost(1):  # could not pay even alone
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


def verify_cost(num_decodes: int, num_drafts: int) -> float | None:
    """A step of num_decodes rows that verify num_drafts drafts in all, in plain decode steps at that many
    rows: VERIFY_COST interpolated in rows and in drafts per row; None beyond the table's rows."""
    rows = [n for n, _ in VERIFY_COST]
    i = bisect.bisect_left(rows, num_decodes)
    if i == len(rows):
        return None
    per_row = num_drafts / num_decodes
    high = _along(VERIFY_COST[i][1], per_row)
    if i == 0 or rows[i] == num_decodes:
        return high
    low = _along(VERIFY_COST[i - 1][1], per_row)
    return low + (high - low) * (num_decodes - rows[i - 1]) / (rows[i] - rows[i - 1])


def _along(costs: tuple[float, ...], per_row: float) -> float:
    """One row of VERIFY_COST at per_row drafts: linear through (0, 1), (1, costs[0]), (2, costs[1]), ...
    and past the last point along the last segment."""
    points = (1.0, *costs)
    j = min(int(per_row), len(points) - 2)
    return points[j] + (points[j + 1] - points[j]) * (per_row - j)


def _bucket(num_decodes: int) -> int:
    return next((n for n, _ in VERIFY_COST if num_decodes <= n), VERIFY_COST[-1][0])
