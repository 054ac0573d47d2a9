"""The token embedding and the LM head, split over the vocabulary under tensor parallelism.

Rank r holds rows [r*L, (r+1)*L) of the table, L = ceil(vocab / ranks), the last rank's
missing rows zero. A lookup takes the rows this rank holds (zeros for the others) and the
ranks' lookups are summed; the LM head multiplies by the local rows and the ranks' logits
are gathered and cut back to the vocabulary. With one rank both are the plain modules.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from slipstream.distributed.parallel_state import all_gather, all_reduce, tp_rank, tp_size
from slipstream.distributed.shard import Shard, set_shards
from slipstream.layers.linear import Linear


def vocab_shard(vocab_size: int) -> tuple[int, int, Shard]:
    """(first row, local rows, the checkpoint table's shard) of this rank."""
    rows = -(-vocab_size // tp_size())
    start = tp_rank() * rows
    return start, rows, Shard(0, ((start, max(0, min(rows, vocab_size - start))),), rows)


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int):
        self.vocab_start, rows, shard = vocab_shard(vocab_size)
        super().__init__(rows, hidden_size)
        if tp_size() > 1:
            set_shards(self.weight, {None: shard})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(ids, self.vocab_start, self.num_embeddings, super().forward)


def vocab_parallel_lookup(ids: torch.Tensor, vocab_start: int, rows: int,
                          lookup: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`lookup` of local rows: with one rank the ids themselves, else the rows this rank holds
    (zeros for the others), summed over the ranks."""
    if tp_size() == 1:
        return lookup(ids)
    local = ids - vocab_start
    outside = (local < 0) | (local >= rows)
    x = lookup(local.masked_fill(outside, 0))
    return all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(Linear):
    """hidden -> logits over the whole vocabulary; the weight may be the embedding's (tied)."""

    def __init__(self, hidden_size: int, vocab_size: int):
        _, rows, shard = vocab_shard(vocab_size)
        super().__init__(hidden_size, rows, bias=False)
        self.vocab_size = vocab_size
        if tp_size() > 1:
            set_shards(self.weight, {None: shard})

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return super().forward(hidden)
        return all_gather(super().forward(hidden))[..., :self.vocab_size]
