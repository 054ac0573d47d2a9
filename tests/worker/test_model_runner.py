"""The model runner takes the step as data: any number of new tokens per row, rows in any mix.

A row with several new tokens after its prompt (what verifying speculative tokens needs) must
give the same logits as feeding those tokens one decode step at a time; the runner's copy of
each sequence follows SchedulerOutputs alone (new sequences, new blocks, finished ones).
"""
from __future__ import annotations

import torch

from slipstream import LLM, SamplingParams
from slipstream.attention.metadata import use_metadata
from slipstream.engine.scheduler_output import NewSequence, ScheduledSequence, SchedulerOutput
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _logits(runner, rows):
    """Every row's logits for a step given as (seq_id, tokens already computed, new tokens)."""
    step = [(runner.sequences[i], done, n) for i, done, n in rows]
    input_ids, positions, meta = runner.input_batch.prepare(sorted(step, key=lambda r: r[2] != 1))
    with torch.inference_mode(), use_metadata(meta):
        return runner.model.compute_logits(runner.model(input_ids, positions))


def test_several_new_tokens_in_one_row_equal_one_decode_step_each(tiny_llama):
    runner = LLM(tiny_llama, dtype="float32", block_size=4).engine.runner
    a, b = random_prompts(2, 9, 9, seed=4)
    follow = [11, 12, 13]
    runner.execute(SchedulerOutput([NewSequence(1, a + follow, 9, GREEDY), NewSequence(2, b, 9, GREEDY)],
                                   [ScheduledSequence(1, 9, 0, [0, 1, 2]), ScheduledSequence(2, 9, 0, [3, 4, 5])]))
    together = _logits(runner, [(2, 9, 1), (1, 9, 3)])  # a decode row, then sequence 1's three tokens at once
    alone = [_logits(runner, [(1, 9 + i, 1)])[0] for i in range(3)]
    torch.testing.assert_close(together[1:], torch.stack(alone), rtol=1e-5, atol=1e-5)


def test_the_runner_forgets_finished_sequences_and_follows_resumed_block_tables(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", block_size=4)
    runner = llm.engine.runner
    prompt = random_prompts(1, 6, 6, seed=5)[0]
    out = runner.execute(SchedulerOutput([NewSequence(7, prompt, 6, GREEDY)], [ScheduledSequence(7, 6, 0, [0, 1])]))
    assert list(out.sampled) == [7] and runner.sequences[7].token_ids[-1] == out.sampled[7][0].token_id
    # preempted and recomputed into other blocks: the same next token
    again = runner.execute(SchedulerOutput([], [ScheduledSequence(7, 7, 0, [5, 6], resumed=True)]))
    assert runner.sequences[7].block_ids == [5, 6]
    expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert [out.sampled[7][0].token_id, again.sampled[7][0].token_id] == expected[0].outputs[0].token_ids
    runner.execute(SchedulerOutput(finished_seq_ids=[7]))
    assert 7 not in runner.sequences
