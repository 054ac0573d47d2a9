"""AttentionMetadata: the per-step description of a batch, set once before the forward.

A step is a list of rows, one per sequence, each with any number of new tokens (query
lengths vary: varlen). The model runner puts rows with exactly one new token first, so
that decode kernels take tokens [0, num_decodes) as one batch; every other row (a prompt
chunk, or several tokens to verify) attends over its cached prefix and itself. The runner
installs the metadata with `use_metadata`; attention layers read it with `get_metadata`,
so `forward(x)` signatures stay free of batch bookkeeping.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    """One row with several new tokens: queries [start, start+length) of the step."""

    start: int
    length: int
    context_len: int          # tokens with K/V after this step (cached prefix + chunk)
    block_table: torch.Tensor  # [num_blocks] long, on the device
    # per-step values (masks) every layer would otherwise recompute, keyed by what they depend on
    memo: dict = field(default_factory=dict, repr=False)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [T] cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] row i's queries are tokens [query_start_loc[i], query_start_loc[i+1])
    seq_lens: torch.Tensor         # [B] tokens with K/V once this step is done
    block_table: torch.Tensor      # [B, W] long, contiguous; entries past a row's blocks are 0
    num_decodes: int               # rows [0, num_decodes) have one query each
    query_start: list[int]         # query_start_loc on the host
    context_lens: list[int]        # seq_lens on the host
    # per-step values every layer would otherwise recompute, keyed by what they depend on
    step_cache: dict = field(default_factory=dict, repr=False)
    # slot_mapping and block_table on the host (vLLM's *_cpu): the runner passes the buffers it filled,
    # others get copies, so host-side planning never reads the device back
    slot_mapping_cpu: torch.Tensor | None = field(default=None, repr=False)
    block_table_cpu: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.slot_mapping_cpu is None:
            self.slot_mapping_cpu = self.slot_mapping.cpu()
        if self.block_table_cpu is None:
            self.block_table_cpu = self.block_table.cpu()

    @property
    def decode_block_tables(self) -> torch.Tensor:
        return self.block_table[:self.num_decodes]

    @property
    def decode_context_lens(self) -> torch.Tensor:
        return self.seq_lens[:self.num_decodes]

    def narrow_decode_tables(self, block_size: int) -> torch.Tensor:
        """The decode rows' block tables cut to the blocks of their longest context: torch paths
        gather every column, and a long prefill row in the same step widens the table."""
        longest = max(self.context_lens[:self.num_decodes])
        return self.decode_block_tables[:, :-(-longest // block_size)]

    @functools.cached_property
    def prefills(self) -> list[PrefillChunk]:
        """The rows after the decodes, each as its chunk of queries."""
        starts = self.query_start
        return [PrefillChunk(starts[i], starts[i + 1] - starts[i], self.context_lens[i], self.block_table[i])
                for i in range(self.num_decodes, len(self.context_lens))]


def leading_decodes(query_lens: list[int]) -> int:
    """How many rows at the front have exactly one query."""
    return next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))


_current: AttentionMetadata | None = None


@contextmanager
def use_metadata(metadata: AttentionMetadata):
    global _current
    _current = metadata
    try:
        yield
    finally:
        _current = None


def get_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention called outside a model-runner step (no AttentionMetadata set)")
    return _current
