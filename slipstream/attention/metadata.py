"""AttentionMetadata: the per-step description of a mixed batch, set once before the forward.

Tokens of a step are laid out decode tokens first (one per decoding sequence), then the
prefill chunks one after another. The model runner builds this object and installs it with
`set_metadata`; attention layers read it with `get_metadata`, so `forward(x)` signatures
stay free of batch bookkeeping.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens: queries [start, start+length) of the step."""

    start: int
    length: int
    context_len: int          # tokens with K/V after this step (cached prefix + chunk)
    block_table: torch.Tensor  # [num_blocks] long, on the device


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor            # [T] cache slot of each new token
    num_decode_tokens: int                # decode queries are rows [0, num_decode_tokens)
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] long (padded with 0)
    decode_context_lens: torch.Tensor | None  # [B] long
    prefills: list[PrefillChunk]
    # per-step values every layer would otherwise recompute, keyed by what they depend on
    step_cache: dict = field(default_factory=dict, repr=False)


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
