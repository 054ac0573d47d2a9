"""ShmCollectives: all-reduce and all-gather between the tensor-parallel ranks of one machine
through one shared mapping, in microseconds where gloo's TCP loopback takes about 1.5 ms.

The mapping holds one flag per rank (a cache line each) and two sets of one slot per rank. A
call writes this rank's tensor into its slot of the set the call's sequence number picks,
publishes the number, waits until every rank has (kernels/shm_sync.c: release/acquire), then
reads the slots in rank order, so every rank adds in the same order and holds the same
bits. Alternating sets is what makes reuse safe: a rank that writes call s+2 has seen every
rank publish s+1, which each does only after reading call s. Tensors larger than a slot
return False: the caller sends them through gloo. A wait that outlasts a second asks
`alive()` whether the other ranks still exist, and raises once they do not or `timeout_s`
has passed. This module never knows layers, models or how the ranks were started.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from slipstream.backends.cpu import abi

SLOT_BYTES = 4 * 2**20  # a [64, 16384] fp32 all-reduce, or SmolLM2's logits of 85 rows per rank
FLAG_BYTES = 64  # one cache line per rank's flag: no false sharing between the spinning ranks
WAIT_NS = 10**9


class ShmCollectives:
    def __init__(self, path: str, rank: int, size: int, alive: Callable[[], bool], timeout_s: float):
        self.lib = abi.kernels()
        self.rank, self.size, self.alive, self.timeout_s = rank, size, alive, timeout_s
        self.buffer = torch.from_file(path, shared=True, size=size * (FLAG_BYTES + 2 * SLOT_BYTES), dtype=torch.uint8)
        self.flags = self.buffer[:size * FLAG_BYTES]
        self.seq = 0

    @staticmethod
    def available() -> bool:
        return abi.kernels() is not None

    def all_reduce(self, x: torch.Tensor) -> bool:
        """x = the sum of every rank's x, in place; False (nothing done) where x exceeds a slot."""
        slots = self._exchange(x)
        if slots is None:
            return False
        x.copy_(slots[0])
        for slot in slots[1:]:
            x.add_(slot)
        return True

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        """Every rank's x concatenated along dim in rank order; None where x exceeds a slot."""
        slots = self._exchange(x)
        return None if slots is None else torch.cat(slots, dim)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        nbytes = x.numel() * x.element_size()
        if nbytes > SLOT_BYTES or not x.is_contiguous():
            return None
        self.seq += 1
        base = self.size * FLAG_BYTES + (self.seq % 2) * self.size * SLOT_BYTES
        slots = [self.buffer[base + r * SLOT_BYTES:base + r * SLOT_BYTES + nbytes].view(x.dtype).view(x.shape)
                 for r in range(self.size)]
        slots[self.rank].copy_(x)
        self.lib.shm_publish(self.flags.data_ptr() + self.rank * FLAG_BYTES, self.seq)
        self._wait()
        return slots

    def _wait(self) -> None:
        start = time.monotonic()
        while self.lib.shm_wait(self.flags.data_ptr(), FLAG_BYTES // 8, self.size, self.seq, WAIT_NS) != 0:
            if not self.alive():
                raise RuntimeError("a tensor-parallel rank is gone: its shared-memory flag stopped moving")
            if time.monotonic() - start > self.timeout_s:
                raise RuntimeError(f"a tensor-parallel rank hung: no shared-memory all-reduce within {self.timeout_s:.0f} s")
