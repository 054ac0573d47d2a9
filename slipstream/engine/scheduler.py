"""Scheduler: continuous batching under a token budget, chunked prefill, preemption.

Each step, running sequences get their decode token first (and, with speculative
decoding, the Speculator's draft tokens after it, with lookahead slots to verify them in); the rest of the budget
(`max_num_batched_tokens`) goes to prefill chunks, of running sequences first, then of
waiting ones admitted in arrival order while `max_num_seqs` allows (a sequence whose grammar
is still compiling is passed over, and those behind it go ahead). When a running
sequence needs a block and none is free, the newest running sequence is preempted: its
blocks are freed and it returns to the front of the queue, to be recomputed later
(reusing whatever of its prefix is still cached).

The step leaves as a `SchedulerOutput` (data); the scheduler remembers how much of each
sequence the runner already knows, so that only new sequences, new blocks and finished
sequences are sent.
"""
from __future__ import annotations

from collections import deque

from slipstream.engine.block_manager import BlockManager
from slipstream.engine.scheduler_output import NewSequence, ScheduledSequence, SchedulerOutput
from slipstream.engine.sequence import Sequence, SequenceStatus
from slipstream.speculative.speculator import Speculator


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 speculator: Speculator | None = None):
        self.block_manager = block_manager
        self.speculator = speculator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[int, Sequence] = {}  # every unfinished sequence, by seq_id
        self.num_preemptions = 0
        self._blocks_sent: dict[int, int] = {}  # seq_id -> leading block ids the runner has
        self._resumed: set[int] = set()
        self._finished: list[int] = []

    def add(self, seq: Sequence) -> None:
        self.sequences[seq.seq_id] = seq
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """This step's sequences, each with its number of new tokens."""
        scheduled: dict[Sequence, int] = {}
        drafts: dict[Sequence, list[int]] = {}
        preemptions_before = self.num_preemptions
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        proposals = self.speculator.propose(decodes) if self.speculator else {}
        for seq in decodes + prefills:
            budget = self._budget_left(scheduled)
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_schedulable_tokens, budget)
            drafts[seq] = self._lookahead(seq, proposals.get(seq, [])[:budget - n])
            if self._make_room(seq, n + len(drafts[seq]), scheduled):
                scheduled[seq] = n + len(drafts[seq])
        if self.num_preemptions == preemptions_before:  # no memory to spare after a preemption
            self._admit_waiting(scheduled, self._budget_left(scheduled))
        return self._output(scheduled, drafts)

    def _lookahead(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """The drafts whose lookahead slots fit (drafts never preempt anyone)."""
        return drafts if drafts and self.block_manager.append_slots(seq, 1 + len(drafts)) else []

    def _output(self, scheduled: dict[Sequence, int], drafts: dict[Sequence, list[int]]) -> SchedulerOutput:
        out = SchedulerOutput(finished_seq_ids=self._finished)
        self._finished = []
        for seq, n in scheduled.items():
            sent = self._blocks_sent.get(seq.seq_id)
            if sent is None:
                grammar = seq.grammar.result() if seq.grammar is not None else None  # ready: admitted only then
                out.new_sequences.append(NewSequence(seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens,
                                                     seq.params, seq.index, grammar))
            out.scheduled.append(ScheduledSequence(seq.seq_id, n, seq.num_computed_tokens, seq.block_table[sent or 0:],
                                                   seq.seq_id in self._resumed, drafts.get(seq, [])))
            self._resumed.discard(seq.seq_id)
            self._blocks_sent[seq.seq_id] = len(seq.block_table)
        return out

    def _budget_left(self, scheduled: dict[Sequence, int]) -> int:
        return self.max_num_batched_tokens - sum(scheduled.values())

    def _make_room(self, seq: Sequence, n: int, scheduled: dict[Sequence, int]) -> bool:
        """Allocate slots for `n` tokens of `seq`, preempting newer sequences if needed."""
        while not self.block_manager.append_slots(seq, n):
            victim = self.running[-1]
            scheduled.pop(victim, None)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, scheduled: dict[Sequence, int], budget: int) -> None:
        for seq in [s for s in self.waiting if s.grammar_ready]:
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            hits = self.block_manager.find_cached_prefix(seq)
            n = min(seq.num_tokens - len(hits) * self.block_manager.block_size, budget)
            if not self.block_manager.can_allocate(seq, hits, n):
                break
            cached = self.block_manager.allocate(seq, hits, n)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            if not seq.num_preemptions:
                seq.num_cached_tokens = cached
            self.running.append(seq)
            n = min(seq.num_schedulable_tokens, budget)  # a head computed again comes first
            scheduled[seq] = n
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        if seq.seq_id in self._blocks_sent:
            self._blocks_sent[seq.seq_id] = 0
            self._resumed.add(seq.seq_id)

    def release_lookahead(self, seq: Sequence) -> None:
        """After a verification: the blocks that only rejected drafts reached go back to the pool
        (the runner then gets the sequence's block table anew)."""
        if self.block_manager.trim(seq, seq.num_tokens):
            self._blocks_sent[seq.seq_id] = 0
            self._resumed.add(seq.seq_id)

    def finish(self, seq: Sequence) -> None:
        """Release a sequence that has finished or been aborted, wherever it is."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        if self.speculator is not None:
            self.speculator.finish(seq)
        seq.status = SequenceStatus.FINISHED
        del self.sequences[seq.seq_id]
        if self._blocks_sent.pop(seq.seq_id, None) is not None:
            self._finished.append(seq.seq_id)
        self._resumed.discard(seq.seq_id)
