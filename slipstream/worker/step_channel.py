"""StepChannel: what rank 0 tells the tensor-parallel workers, one message per step.

A message is a broadcast of a fixed int64 header (operation, the step's shape, how many
logit rows) over the group's CPU group, and for a step a second broadcast: the packed input
batch, then the hidden rows whose logits rank 0 computes (the workers join that LM-head
all-gather). Nothing is pickled. Rank 0 waits at most `send_timeout` for the ranks to take
a message (a hung rank is an error, not a hung engine); they wait for the next one as long
as it takes. This module never knows models or schedulers.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from slipstream.worker.input_batch import InputBatch, packed_size

STEP, FINISH_CALIBRATION, SHUTDOWN = 1, 2, 3


class StepChannel:
    def __init__(self, group, send_timeout: timedelta):
        self.group, self.send_timeout = group, send_timeout
        self.header = torch.zeros(5, dtype=torch.int64)

    def send(self, op: int, batch: InputBatch | None = None, logit_rows: list[int] = ()) -> None:
        shape = batch.shape if op == STEP else (0, 0, 0)
        self.header.copy_(torch.tensor([op, *shape, len(logit_rows)]))
        self._broadcast(self.header)
        if op == STEP:
            self._broadcast(torch.cat([batch.pack(), torch.tensor(logit_rows, dtype=torch.int64)]))

    def _broadcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, 0, group=self.group, async_op=True).wait(timeout=self.send_timeout)

    def receive(self, batch: InputBatch) -> tuple[int, tuple | None, list[int]]:
        """(operation, the step's (input_ids, positions, metadata) or None, its logit rows)."""
        dist.broadcast(self.header, 0, group=self.group)
        op, *shape, num_logit_rows = self.header.tolist()
        if op != STEP:
            return op, None, []
        size = packed_size(tuple(shape))
        payload = torch.empty(size + num_logit_rows, dtype=torch.int64)
        dist.broadcast(payload, 0, group=self.group)
        return op, batch.unpack(tuple(shape), payload[:size]), payload[size:].tolist()
