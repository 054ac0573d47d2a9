"""DraftModelProposer: a smaller checkpoint with the target's tokenizer guesses the next k tokens.

The draft runs on this engine's own parts: a Worker (its model and backend, and a paged
cache of the model dtype holding as many tokens as the target's), a BlockManager with its
prefix cache, and a ModelRunner. It decodes greedily, so each proposal is a point mass and
the target's verification rule stays exact for sampled requests too. Every target sequence
that speculates has a mirror, a draft-side Sequence; before a proposal the mirror keeps the
K/V of the tokens it shares with the target (the drafts the target accepted among them), and
draft steps compute the rest, in chunks of max_num_batched_tokens, then one step per further
draft. Only blocks of tokens the target holds enter the draft's prefix cache. A mirror that
finds no room evicts the mirrors that are not proposing this step, then proposes nothing:
drafts never preempt the target. Must never know the target's scheduler, blocks or model.
"""
from __future__ import annotations

import dataclasses

import torch

from slipstream.config import EngineConfig
from slipstream.engine.block_manager import BlockManager
from slipstream.engine.model_loader import LoadedModel
from slipstream.engine.scheduler_output import NewSequence, ScheduledSequence, SchedulerOutput
from slipstream.engine.sequence import Sequence
from slipstream.layers.sampler import Sampler
from slipstream.outputs import RequestMetrics
from slipstream.sampling_params import SamplingParams
from slipstream.speculative.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from slipstream.worker.model_runner import ModelRunner
from slipstream.worker.worker import build_worker

GREEDY = SamplingParams(temperature=0, max_tokens=1)


class DraftModelProposer:
    def __init__(self, spec: SpeculativeConfig, engine: EngineConfig, target: LoadedModel, num_tokens: int):
        config = dataclasses.replace(engine, model=spec.model, quantization=spec.quantization, kv_cache_dtype="auto",
                                     kv_cache_dense_layers=0, kv_cache_recent_tokens=0, kv_cache_sink_tokens=0,
                                     speculative_config=None, gpu_memory_utilization=None)
        worker = build_worker(config, kv_cache_tokens=num_tokens)
        _check_vocabulary(spec.model, worker.loaded, target)
        self.max_model_len = worker.max_model_len
        self.budget = engine.max_num_batched_tokens
        self.block_manager = BlockManager(worker.kv_cache.num_blocks, engine.block_size, engine.enable_prefix_caching)
        self.runner = ModelRunner(worker.loaded.model, worker.kv_cache, worker.backend, Sampler([]), self.budget,
                                  engine.max_num_rows, self.max_model_len, split_tokens=1 + spec.num_speculative_tokens)
        # a guess until the Speculator has measured it: decode reads every weight, so a draft step
        # costs about this share of a target step
        self.step_cost = _weight_bytes(worker.loaded.model) / _weight_bytes(target.model)
        self.mirrors: dict[int, Sequence] = {}  # target seq_id -> its mirror
        self._finished: list[int] = []  # mirrors' seq_ids the runner still holds

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to k greedy draft tokens after each sequence's tokens."""
        wanted = {}
        for seq, k in zip(seqs, ks):
            mirror = self._sync(seq, k, seqs)
            if mirror is not None:
                wanted[mirror] = k
        drafts = self._decode(wanted)
        return [drafts.get(self.mirrors.get(seq.seq_id), []) for seq in seqs]

    def finish(self, seq: Sequence) -> None:
        """The target sequence is done: its mirror's blocks go back to the draft's pool."""
        self._drop(seq.seq_id)

    def _drop(self, seq_id: int) -> None:
        mirror = self.mirrors.pop(seq_id, None)
        if mirror is not None:
            self.block_manager.free(mirror)
            self._finished.append(mirror.seq_id)

    def _sync(self, seq: Sequence, k: int, proposing: list[Sequence]) -> Sequence | None:
        """The sequence's mirror, holding the target's tokens and room for k drafts; None if no room."""
        bm, mirror = self.block_manager, self.mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = Sequence(seq.request_id, seq.token_ids, GREEDY, RequestMetrics(0.0), cache_salt=seq.cache_salt)
            hits = bm.find_cached_prefix(mirror)
            n = mirror.num_tokens - len(hits) * bm.block_size + k - 1
            if not self._room(lambda: bm.can_allocate(mirror, hits, n), proposing):
                return None
            bm.allocate(mirror, hits, n)
            self.mirrors[seq.seq_id] = mirror
            return mirror
        # the last token is computed again: its logits give the first draft
        shared = min(_common_prefix(mirror.token_ids, seq.token_ids), seq.num_tokens - 1)
        mirror.num_computed_tokens = min(mirror.num_computed_tokens, shared)
        mirror.token_ids = list(seq.token_ids)
        bm.cache_full_blocks(mirror)  # every computed token is the target's here
        if not self._room(lambda: bm.append_slots(mirror, mirror.num_uncomputed_tokens + k - 1), proposing):
            self._drop(seq.seq_id)
            return None
        return mirror

    def _room(self, fits, proposing: list[Sequence]) -> bool:
        """fits(), after evicting the mirrors of sequences that do not propose now if it failed."""
        if fits():
            return True
        keep = {seq.seq_id for seq in proposing}
        for seq_id in [s for s in self.mirrors if s not in keep]:
            self._drop(seq_id)
        return fits()

    def _decode(self, wanted: dict[Sequence, int]) -> dict[Sequence, list[int]]:
        """Draft steps until every mirror has its k drafts: catch-up chunks, then one token per step."""
        drafts: dict[Sequence, list[int]] = {m: [] for m in wanted}
        fresh = set(wanted)  # the runner gets these mirrors anew: their tokens changed since it saw them
        while wanted:
            step, budget = SchedulerOutput(finished_seq_ids=self._finished), self.budget
            self._finished = []
            for mirror in wanted:
                n = min(mirror.num_uncomputed_tokens, budget)
                if n == 0:
                    break
                if mirror in fresh:
                    step.finished_seq_ids.append(mirror.seq_id)
                    step.new_sequences.append(NewSequence(mirror.seq_id, list(mirror.token_ids),
                                                          mirror.num_tokens, GREEDY))
                step.scheduled.append(ScheduledSequence(mirror.seq_id, n, mirror.num_computed_tokens,
                                                        list(mirror.block_table) if mirror in fresh else [],
                                                        resumed=mirror in fresh))
                fresh.discard(mirror)
                budget -= n
            sampled = self.runner.execute(step).sampled
            for s, mirror in zip(step.scheduled, list(wanted)):
                mirror.num_computed_tokens += s.num_new_tokens
                for result in sampled.get(mirror.seq_id, []):
                    mirror.token_ids.append(result.token_id)
                    drafts[mirror].append(result.token_id)
                if len(drafts[mirror]) == wanted[mirror]:
                    del wanted[mirror]
        return drafts


def _common_prefix(mirror: list[int], target: list[int]) -> int:
    """Tokens the two share: a mirror holds the target's tokens of its last proposal and at
    most MAX_SPECULATIVE_TOKENS drafts, and the target has only appended since."""
    n = min(len(mirror), len(target))
    start = max(0, len(mirror) - MAX_SPECULATIVE_TOKENS)
    return next((i for i in range(start, n) if mirror[i] != target[i]), n)


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _check_vocabulary(name: str, draft: LoadedModel, target: LoadedModel) -> None:
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_config: draft model {name!r} has a vocabulary of {draft.config.vocab_size} "
                         f"tokens; the target's has {target.config.vocab_size} (a draft needs the target's tokenizer)")
    if None not in (draft.tokenizer, target.tokenizer) and draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(f"speculative_config: draft model {name!r} has another tokenizer than the target's "
                         "(the same token ids must mean the same text)")
