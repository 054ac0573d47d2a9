"""Per-sequence grammar state and the logits processor that masks constrained rows every step.

A `GrammarState` is one sequence's matcher: it has accepted exactly the sequence's output
tokens so far. It lives with the runner's copy of the sequence, so preemption (which
recomputes K/V but never changes tokens) leaves it as it is; undoing accepted tokens
(rejected speculative tokens) is the matcher's `rollback(k)`. `GrammarBitmask` fills the
token bitmask of the constrained rows only and sets every other logit of those rows to
-inf; stop tokens stay allowed exactly where the grammar may end. Unconstrained rows are
never touched. Must never know the scheduler or the engine.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from slipstream.structured.grammars import CompiledGrammar

if TYPE_CHECKING:
    from slipstream.layers.sampler import SamplingMetadata


class GrammarState:
    def __init__(self, grammar: CompiledGrammar):
        self.grammar = grammar
        self.matcher = xgr.GrammarMatcher(grammar.compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The tokens allowed next, as bits of bitmask[row]."""
        if self.matcher.is_terminated():  # ended, and generation goes on (ignore_eos): only stops fit
            bitmask[row] = 0
            for token in self.grammar.stop_token_ids:
                bitmask[row, token // 32] |= _bit(token % 32)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.grammar.token_filter is not None:
            bitmask[row] &= self.grammar.token_filter

    def accept(self, token_id: int) -> None:
        if self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}, which its own mask allowed")


class GrammarBitmask:
    """The logits processor: rows with a GrammarState keep only what their grammar allows next."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # grown to the batch, reused

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> None:
        rows = [i for i, g in enumerate(meta.grammars or ()) if g is not None]
        if not rows:
            return
        if self.bitmask.shape[0] < logits.shape[0]:
            self.bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        bitmask = self.bitmask[:logits.shape[0]]
        for row in rows:
            meta.grammars[row].fill(bitmask, row)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=self.vocab_size, indices=rows)


def _bit(position: int) -> int:
    """Bit `position` of an int32 word, as a signed int32 value."""
    return -(1 << 31) if position == 31 else 1 << position
