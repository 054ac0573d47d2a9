"""NgramProposer: prompt lookup, the next tokens guessed by copying what followed an earlier match.

The longest suffix of the sequence (prompt_lookup_max down to prompt_lookup_min tokens) that
occurred before, at its most recent occurrence, proposes the up to k tokens that followed it.
Knows token ids only: never the model, the scheduler or the cache.
"""
from __future__ import annotations

import numpy as np

from slipstream.engine.sequence import Sequence
from slipstream.speculative.config import SpeculativeConfig


class StatelessProposer:
    """A proposer that reads each sequence's token ids alone (`lookup`), keeps nothing between
    steps and costs nothing next to a step."""

    step_cost = 0.0

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [self.lookup(seq.token_ids, k) for seq, k in zip(seqs, ks)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def finish(self, seq: Sequence) -> None:
        pass


class NgramProposer(StatelessProposer):
    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `token_ids` (none where no suffix occurred before)."""
        tokens = np.asarray(token_ids)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows that start before the suffix itself and have a token after them
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(1))
            if hits.size:
                start = hits[-1] + n
                return tokens[start:start + k].tolist()
        return []
