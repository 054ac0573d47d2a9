"""ModelRunner: a scheduled batch -> flat tensors -> one forward pass -> sampled tokens.

Tokens are laid out decode tokens first, then prefill chunks. For every token we compute
its position and its cache slot (block_id * block_size + offset); decode sequences also
get padded block tables and context lengths. Logits are computed only for rows that
sample (the last token of a sequence whose tokens are all computed after this step) and
for prompt rows of sequences that asked for prompt logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from slipstream.attention.metadata import AttentionMetadata, PrefillChunk, use_metadata
from slipstream.engine.sequence import Sequence
from slipstream.kvcache.cache import KVCache
from slipstream.layers.sampler import SampleResult, Sampler, logprobs_for

# (token id, its logprob, its rank, top-N pairs) for one prompt token
PromptLogprob = tuple[int, float, int, list[tuple[int, float]]]


@dataclass
class StepOutput:
    sampled: dict[Sequence, SampleResult] = field(default_factory=dict)
    prompt_logprobs: dict[Sequence, list[PromptLogprob]] = field(default_factory=dict)


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logit_rows: list[int]
    order: list[tuple[Sequence, int]]


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, sampler: Sampler, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.block_size = kv_cache.block_size
        for attn, layer_cache in zip(model.attention_layers(), kv_cache.layers):
            attn.kv_cache = layer_cache

    @torch.inference_mode()
    def execute(self, scheduled: dict[Sequence, int]) -> StepOutput:
        batch = self._prepare(scheduled)
        with use_metadata(batch.metadata):
            hidden = self.model(batch.input_ids, batch.positions)
        logits = self.model.compute_logits(hidden[batch.logit_rows])
        return self._postprocess(batch, logits)

    # --- batch preparation -------------------------------------------------------------
    def _prepare(self, scheduled: dict[Sequence, int]) -> _Batch:
        decodes = [s for s, n in scheduled.items() if n == 1]
        prefills = [(s, n) for s, n in scheduled.items() if n > 1]
        ids, positions, slots = [], [], []
        decode_tables = decode_lens = None
        if decodes:
            decode_tables, decode_lens = self._decode_inputs(decodes, ids, positions, slots)
        chunks = []
        start = len(decodes)
        for seq, n in prefills:
            chunks.append(self._prefill_inputs(seq, n, start, ids, positions, slots))
            start += n
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(torch.cat(slots)),
            num_decode_tokens=len(decodes),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            prefills=chunks,
        )
        order = [(s, 1) for s in decodes] + prefills
        return _Batch(self._tensor(torch.cat(ids)), self._tensor(torch.cat(positions)), metadata,
                      self._logit_rows(order), order)

    def _decode_inputs(self, seqs: list[Sequence], ids, positions, slots):
        pos = torch.tensor([s.num_computed_tokens for s in seqs])
        width = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])
        ids.append(torch.tensor([s.token_ids[s.num_computed_tokens] for s in seqs]))
        positions.append(pos)
        slots.append(tables[torch.arange(len(seqs)), pos // self.block_size] * self.block_size + pos % self.block_size)
        return self._tensor(tables), self._tensor(pos + 1)

    def _prefill_inputs(self, seq: Sequence, n: int, start: int, ids, positions, slots) -> PrefillChunk:
        first = seq.num_computed_tokens
        pos = torch.arange(first, first + n)
        table = torch.tensor(seq.block_table)
        ids.append(torch.tensor(seq.token_ids[first:first + n]))
        positions.append(pos)
        slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
        return PrefillChunk(start, n, first + n, self._tensor(table))

    def _logit_rows(self, order: list[tuple[Sequence, int]]) -> list[int]:
        rows, start = [], 0
        for seq, n in order:
            if seq.wants_prompt_logprobs:
                rows.extend(range(start, start + n))
            elif _samples(seq, n):
                rows.append(start + n - 1)
            start += n
        return rows

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    # --- sampling and prompt logprobs --------------------------------------------------
    def _postprocess(self, batch: _Batch, logits: torch.Tensor) -> StepOutput:
        out = StepOutput()
        sample_seqs, sample_rows, row = [], [], 0
        for seq, n in batch.order:
            if seq.wants_prompt_logprobs:
                out.prompt_logprobs[seq] = _prompt_logprobs(seq, n, logits[row:row + n])
                row += n
                if _samples(seq, n):
                    sample_seqs.append(seq)
                    sample_rows.append(row - 1)
            elif _samples(seq, n):
                sample_seqs.append(seq)
                sample_rows.append(row)
                row += 1
        if sample_seqs:
            out.sampled = dict(zip(sample_seqs, self.sampler(_rows(logits, sample_rows), sample_seqs)))
        return out


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    # a slice where the rows are consecutive (every decode step): indexing with a list costs ~50 us
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return logits[rows[0]:rows[0] + len(rows)]
    return logits[rows]


def _samples(seq: Sequence, n: int) -> bool:
    return seq.num_computed_tokens + n == seq.num_tokens


def _prompt_logprobs(seq: Sequence, n: int, logits: torch.Tensor) -> list[PromptLogprob]:
    """Row i predicts token first+i+1; only prompt tokens not yet scored are reported."""
    first = seq.num_computed_tokens
    logprobs = logits.log_softmax(-1)
    result = []
    for target in range(max(first + 1, len(seq.prompt_logprobs)), min(first + n + 1, seq.num_prompt_tokens)):
        token = seq.token_ids[target]
        value, rank, top = logprobs_for(logprobs[target - first - 1], token, seq.params.prompt_logprobs)
        result.append((token, value, rank, top))
    return result
