"""InputBatch: one step's inputs as flat tensors in persistent buffers, and what the runner
keeps of each sequence between steps.

The buffers (vLLM's names) are allocated once for the largest step the scheduler can send
(max_num_batched_tokens tokens, EngineConfig.max_num_rows rows) and refilled in place every step, so
their addresses never change, as a captured CUDA graph needs: input_ids, positions and
slot_mapping [tokens]; query_start_loc [rows + 1]; seq_lens [rows]; block_table, the first
rows * W entries viewed as [rows, W] for the W blocks the step's longest row uses. Rows with
one new token come first; any row may carry any number of new tokens. Under tensor
parallelism rank 0 packs a prepared step into one tensor and the workers unpack it into
their own buffers, so every rank builds the same metadata from the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slipstream.attention.metadata import AttentionMetadata, leading_decodes
from slipstream.kvcache.cache import KVCache
from slipstream.sampling_params import SamplingParams
from slipstream.structured.bitmask import GrammarState


@dataclass
class CachedSequence:
    """The runner's copy of a sequence: its tokens (it appends what it samples), blocks and sampling state."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator
    block_ids: list[int]
    next_prompt_logprob: int = 1  # first prompt position whose logprob is still owed (position 0 has none)
    grammar: GrammarState | None = None  # structured outputs: has accepted every output token so far
    num_drafts: int = 0  # draft tokens at the end of token_ids while this step verifies them

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.next_prompt_logprob < self.num_prompt_tokens


# (sequence, tokens already computed, new tokens) for each row of a step
Row = tuple[CachedSequence, int, int]


class InputBatch:
    @classmethod
    def for_cache(cls, max_num_tokens: int, max_num_rows: int, max_model_len: int, kv_cache: KVCache,
                  device: torch.device) -> "InputBatch":
        """Sized for the largest step: a row's block table spans at most max_model_len or the whole cache."""
        max_blocks = min(kv_cache.num_blocks, -(-max_model_len // kv_cache.block_size))
        return cls(max_num_tokens, max_num_rows, max_blocks, kv_cache.block_size, device)

    def __init__(self, max_num_tokens: int, max_num_rows: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device):
        self.block_size = block_size
        self.device = device
        self.host = {name: torch.zeros(size, dtype=torch.int64) for name, size in (
            ("input_ids", max_num_tokens), ("positions", max_num_tokens), ("slot_mapping", max_num_tokens),
            ("query_start_loc", max_num_rows + 1), ("seq_lens", max_num_rows),
            ("block_table", max_num_rows * max_blocks_per_seq))}
        self.np = {name: t.numpy() for name, t in self.host.items()}
        self.buffers = self.host if device.type == "cpu" else {n: t.to(device) for n, t in self.host.items()}

    def prepare(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input_ids [T], positions [T] and the attention metadata of `rows` (single-token rows first)."""
        query_lens = [n for _, _, n in rows]
        context_lens = [done + n for _, done, n in rows]
        width = -(-max(context_lens) // self.block_size)
        tokens, count = sum(query_lens), len(rows)
        table = self.np["block_table"][:count * width].reshape(count, width)
        table[:] = 0
        new_ids = []
        for i, (seq, done, n) in enumerate(rows):
            new_ids += seq.token_ids[done:done + n]
            blocks = seq.block_ids[:width]
            table[i, :len(blocks)] = blocks
        self.np["seq_lens"][:count] = context_lens
        self.np["input_ids"][:tokens] = new_ids
        starts, pos = self.np["query_start_loc"][:count + 1], self.np["positions"][:tokens]
        size = self.block_size
        if tokens == count:  # one token a row (decode): lists cost less than numpy's calls at a few rows
            starts[:] = range(count + 1)
            pos[:] = [done for _, done, _ in rows]
            self.np["slot_mapping"][:tokens] = [seq.block_ids[done // size] * size + done % size
                                                for seq, done, _ in rows]
        else:
            starts[:] = np.cumsum([0, *query_lens])
            row = np.repeat(np.arange(count), query_lens)
            pos[:] = np.arange(tokens) + (np.array([done for _, done, _ in rows]) - starts[:count])[row]
            self.np["slot_mapping"][:tokens] = table[row, pos // size] * size + pos % size
        self.shape = (tokens, count, width)
        return self._inputs()

    def pack(self) -> torch.Tensor:
        """The last prepared step's buffers as one host tensor (what tensor-parallel workers receive)."""
        return torch.cat([self.host[name][:n] for name, n in _sizes(self.shape).items()])

    def unpack(self, shape: tuple[int, int, int],
               packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """prepare()'s result for a step that another rank prepared and packed."""
        self.shape, start = shape, 0
        for name, n in _sizes(shape).items():
            self.host[name][:n] = packed[start:start + n]
            start += n
        return self._inputs()

    def _inputs(self) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        _, count, width = self.shape
        starts = self.np["query_start_loc"][:count + 1].tolist()
        sizes = _sizes(self.shape)
        host = {name: self.host[name][:n] for name, n in sizes.items()}
        host["block_table"] = host["block_table"].view(count, width)
        t = host if self.buffers is self.host else {  # the device's own persistent buffers
            name: self.buffers[name][:n].view(host[name].shape).copy_(host[name], non_blocking=True)
            for name, n in sizes.items()}
        query_lens = [b - a for a, b in zip(starts, starts[1:])]
        meta = AttentionMetadata(t["slot_mapping"], t["query_start_loc"], t["seq_lens"], t["block_table"],
                                 leading_decodes(query_lens), starts, self.np["seq_lens"][:count].tolist(),
                                 slot_mapping_cpu=host["slot_mapping"], block_table_cpu=host["block_table"])
        return t["input_ids"], t["positions"], meta


def _sizes(shape: tuple[int, int, int]) -> dict[str, int]:
    """The filled length of each buffer for a step of (tokens, rows, block-table width)."""
    tokens, count, width = shape
    return {"input_ids": tokens, "positions": tokens, "slot_mapping": tokens,
            "query_start_loc": count + 1, "seq_lens": count, "block_table": count * width}


def packed_size(shape: tuple[int, int, int]) -> int:
    return sum(_sizes(shape).values())
