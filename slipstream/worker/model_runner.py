"""ModelRunner: a SchedulerOutput -> an input batch -> one forward pass -> sampled tokens.

The runner keeps a `CachedSequence` for every sequence the scheduler has sent it, until the
scheduler names it finished: its tokens (the runner appends what it samples), its block
table and its sampling state (generator, and the grammar state of structured outputs, which
accepts each token as it is appended). Rows with one new token are laid out first, then the others.
Logits are computed only for rows that sample (the last token of a row that reaches its
sequence's last known token, and each position that verifies a draft token) and for prompt
positions whose logprob was asked for. A speculating row carries its last token and k
drafts, run as 1 + k single-token rows; it yields the drafts accepted and one token more (the
correction or the bonus).
Under tensor parallelism the runner is rank 0's: it sends each prepared step down a
`StepChannel` before running its own shard of the forward, and samples alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from slipstream.attention.metadata import use_metadata
from slipstream.backends.base import Backend
from slipstream.engine.scheduler_output import NewSequence, SchedulerOutput
from slipstream.kvcache.cache import KVCache
from slipstream.layers.sampler import SampleResult, Sampler, SamplingMetadata, logprobs_for
from slipstream.structured.bitmask import GrammarState
from slipstream.worker.input_batch import CachedSequence, InputBatch, Row
from slipstream.worker.step_channel import STEP, StepChannel

# (token id, its logprob, its rank, top-N pairs) for one prompt token, in prompt order
PromptLogprob = tuple[int, float, int, list[tuple[int, float]]]
# (row of the hidden states, its sequence, the prompt position it scores, or None where it samples)
LogitRow = tuple[int, CachedSequence, int | None]


@dataclass
class RunnerOutput:
    sampled: dict[int, list[SampleResult]] = field(default_factory=dict)  # by seq_id, the step's tokens in order
    prompt_logprobs: dict[int, list[PromptLogprob]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, backend: Backend, sampler: Sampler,
                 max_num_tokens: int, max_num_rows: int, max_model_len: int, channel: StepChannel | None = None,
                 split_tokens: int = 1):
        self.model = model
        self.sampler = sampler
        self.sequences: dict[int, CachedSequence] = {}
        self.input_batch = InputBatch.for_cache(max_num_tokens, max_num_rows, max_model_len, kv_cache, backend.device)
        self.split_tokens = split_tokens  # 1 + k with speculative decoding: see _split
        self.channel = channel
        if channel is None:  # the fused stack runs every layer in one call: no place for the all-reduces
            model.use_decode_stack(backend.decode_stack(model))
        self.graphs = None  # captured decode graphs (backends/cuda/graphs.py), set by the engine if enabled

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        rows = self._update(step)
        if not rows:
            return RunnerOutput()
        input_ids, positions, meta = self.input_batch.prepare(rows)
        plan = _logit_plan(rows)
        if self.channel is not None:
            self.channel.send(STEP, self.input_batch, [r for r, _, _ in plan])
        hidden = None if self.graphs is None else self.graphs.replay(input_ids, positions, meta)
        if hidden is None:
            with use_metadata(meta):
                hidden = self.model(input_ids, positions)
        if not plan:  # prompt chunks that neither finish their prompt nor owe logprobs
            return RunnerOutput()
        return self._postprocess(plan, self.model.compute_logits(_rows(hidden, [r for r, _, _ in plan])))

    def _update(self, step: SchedulerOutput) -> list[Row]:
        """Apply the step's changes to the cached sequences; its rows, single-token rows first."""
        for seq_id in step.finished_seq_ids:
            self.sequences.pop(seq_id, None)
        for new in step.new_sequences:
            self.sequences[new.seq_id] = _cached(new)
        rows = []
        for s in step.scheduled:
            seq = self.sequences[s.seq_id]
            if s.resumed:
                seq.block_ids = list(s.new_block_ids)
            else:
                seq.block_ids += s.new_block_ids
            seq.token_ids += s.spec_token_ids  # verified this step, then replaced by what is accepted
            seq.num_drafts = len(s.spec_token_ids)
            rows += self._split(seq, s.num_computed_tokens, s.num_new_tokens)
        return sorted(rows, key=lambda row: row[2] != 1)  # stable: decode rows first, in scheduler order

    def _split(self, seq: CachedSequence, done: int, n: int) -> list[Row]:
        """A cached sequence's few new tokens (a verification's 1 + k) as single-token rows: each
        attends to the cache up to itself, as a decode step would (every layer writes the
        step's K/V before its attention reads), so the decode kernels and the fused decode
        stack serve the step; the tokens keep their order, and so do the hidden rows."""
        if done == 0 or not 1 < n <= self.split_tokens:
            return [(seq, done, n)]
        return [(seq, done + j, 1) for j in range(n)]

    def _postprocess(self, plan: list[LogitRow], logits: torch.Tensor) -> RunnerOutput:
        out = RunnerOutput()
        prompt = [i for i, (_, _, target) in enumerate(plan) if target is not None]
        if prompt:
            for i, logprobs in zip(prompt, logits[prompt].log_softmax(-1)):
                _, seq, target = plan[i]
                token = seq.token_ids[target]
                entry = (token, *logprobs_for(logprobs, token, seq.params.prompt_logprobs))
                out.prompt_logprobs.setdefault(seq.seq_id, []).append(entry)
        samples = [i for i, (_, _, target) in enumerate(plan) if target is None]
        if samples:
            rows = _sample_rows([plan[i][1] for i in samples])
            seqs = [seq for seq, _ in rows]
            grammars = [s.grammar for s in seqs]
            meta = SamplingMetadata([s.params for s in seqs], [_history(s, p) for s, p in rows],
                                    [s.num_prompt_tokens for s in seqs], [s.generator for s in seqs],
                                    grammars if any(grammars) else None,
                                    [_draft(s, p) for s, p in rows] if any(s.num_drafts for s in seqs) else None)
            results = self.sampler(_rows(logits, samples), meta)
            start = 0
            while start < len(rows):
                seq, end = rows[start][0], start + rows[start][0].num_drafts + 1
                out.sampled[seq.seq_id] = _accept(seq, results[start:end])
                start = end
        return out


def _cached(new: NewSequence) -> CachedSequence:
    return CachedSequence(new.seq_id, list(new.token_ids), new.num_prompt_tokens, new.params,
                          _make_generator(new.params.seed, new.index), [],
                          grammar=GrammarState(new.grammar) if new.grammar is not None else None)


def _sample_rows(seqs: list[CachedSequence]) -> list[tuple[CachedSequence, int]]:
    """(sequence, position of the token the row follows) per sampling row: a speculating
    sequence has one row per draft, then one after its last token, consecutive."""
    rows: list[tuple[CachedSequence, int]] = []
    while len(rows) < len(seqs):
        seq = seqs[len(rows)]
        last = len(seq.token_ids) - 1
        rows += [(seq, p) for p in range(last - seq.num_drafts, last + 1)]
    return rows


def _history(seq: CachedSequence, position: int) -> list[int]:
    """The tokens a row's logits follow (the sequence itself, uncopied, where it follows the last)."""
    return seq.token_ids if position == len(seq.token_ids) - 1 else seq.token_ids[:position + 1]


def _draft(seq: CachedSequence, position: int) -> int | None:
    return seq.token_ids[position + 1] if position + 1 < len(seq.token_ids) else None


def _accept(seq: CachedSequence, results: list[SampleResult]) -> list[SampleResult]:
    """Replace the drafts by what the step sampled: the drafts up to the first rejected, and one token more."""
    drafts = seq.token_ids[len(seq.token_ids) - seq.num_drafts:]
    rejected = next((i for i, (r, d) in enumerate(zip(results, drafts)) if r.token_id != d), len(drafts))
    del seq.token_ids[len(seq.token_ids) - seq.num_drafts:]
    seq.num_drafts = 0
    for result in results[:rejected + 1]:
        seq.token_ids.append(result.token_id)
        if seq.grammar is not None:
            seq.grammar.accept(result.token_id)
    return results[:rejected + 1]


def _logit_plan(rows: list[Row]) -> list[LogitRow]:
    """(hidden row, sequence, prompt target position or None for the sample) per logit row."""
    plan, start = [], 0
    for seq, done, n in rows:
        if seq.wants_prompt_logprobs:  # row t - 1 predicts prompt token t
            targets = range(max(done + 1, seq.next_prompt_logprob), min(done + n + 1, seq.num_prompt_tokens))
            plan += [(start + t - done - 1, seq, t) for t in targets]
            seq.next_prompt_logprob = max(seq.next_prompt_logprob, targets.stop)
        if done + n == len(seq.token_ids):
            plan += [(start + n - 1 - j, seq, None) for j in range(seq.num_drafts, -1, -1)]
        start += n
    return plan


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    # a slice where the rows are consecutive (every decode step): indexing with a list costs ~50 us
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return x[rows[0]:rows[0] + len(rows)]
    return x[rows]


def _make_generator(seed: int | None, index: int) -> torch.Generator:
    """Each sequence owns its random stream, so its samples do not depend on the batch."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:  # any Python int; the n samples of one request get distinct streams
        generator.manual_seed(hash((seed, index)) & (2**63 - 1))
    return generator
