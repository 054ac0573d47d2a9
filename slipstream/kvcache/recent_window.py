"""The newest R tokens (KIVI-style) and the first S tokens (attention sinks) of each sequence,
kept in 16 bits next to their TurboQuant codes.

Owns: a small pool of dense staging blocks for one layer (`RecentWindow`), and which physical
blocks hold one and when a staging block is given out or taken back (`Staging`, shared by a
model's layers). Must never decide which tokens attention reads in 16 bits:
attention/turboquant.py does that from positions.

Every token is always written as codes too, so a block without staging is still complete.
A physical block gets staging only when its first token (offset 0) is written while it is
in its sequence's window (its first ceil(S / block_size) blocks, or those that the next
query's R recent tokens reach); from then on every write to the block is mirrored, so a
staged block's dense copy always matches its codes, also after the block is freed and
reused (reuse starts again at offset 0, which re-stages or un-stages it) and for blocks that
a prefix-cache hit shares (they are never rewritten). Blocks that leave every scheduled
sequence's window are reclaimed least recently used first; a block that finds no staging
stays codes-only, which costs quality but never correctness. A cached sink block whose staging
was reclaimed is never staged again (a shared block is not rewritten), so a prefix-cache hit on
it would read its sinks from codes to the end (`holds_sinks`: the engine computes the sink
blocks again).

The pool holds max_num_seqs * (ceil(R / block_size) + 1 + ceil(S / block_size)) blocks, the
most that the windows of one step's sequences span, and its bytes come out of the KV-cache
budget. Why sinks: on SmolLM2 the first token draws much of every query's attention and its
key is far from the others, so its quantization error dominated tq4's loss.
"""
from __future__ import annotations

import math

import torch


def staging_blocks(recent_tokens: int, sink_tokens: int, block_size: int, max_num_seqs: int) -> int:
    """Staging blocks a layer needs so that every scheduled sequence's window fits."""
    recent = math.ceil(recent_tokens / block_size) + 1 if recent_tokens else 0
    return max_num_seqs * (recent + math.ceil(sink_tokens / block_size))


class Staging:
    """Which physical blocks hold a staging block, and when one is given out or taken back: the same for every
    layer, since every layer sees the same writes, so a model's layers share one (KVCache builds it) and it
    runs once per step, not once per layer."""

    def __init__(self, recent_tokens: int, sink_tokens: int, num_blocks: int, num_staging: int, block_size: int,
                 device: torch.device):
        self.tokens, self.sinks, self.block_size, self.num_staging = recent_tokens, sink_tokens, block_size, num_staging
        self.sink_blocks = math.ceil(sink_tokens / block_size)
        # decided on the host (the plan, a list: a step's planning is a few list lookups, where tensor ops on a
        # handful of tokens cost ~0.2 ms a decode step), published to `staging_of` for the reads and kernels:
        # planning never reads the device back, and a step's reads see the plan of the steps before it (see assign)
        self.host_staging_of = [-1] * num_blocks
        self.published = torch.full((num_blocks,), -1, dtype=torch.long)  # what the reads see, on the host
        self.staging_of = self.published if device.type == "cpu" else self.published.to(device)
        # this step's (token, staged row) pairs, mirrored before each layer's attention and after it
        self.none = (torch.empty(0, dtype=torch.long, device=device),) * 2
        self.writes = self.late_writes = self.none
        self._block_of = [-1] * num_staging
        self._last_use = [-1] * num_staging
        self._clock = 0
        self._changed: list[int] = []  # blocks whose staging this step's assign changed

    def first_block(self, context_len: int) -> int:
        """Index in a block table of the first block that the next query's recent window reaches."""
        if not self.tokens:
            return -(-context_len // self.block_size)  # none: one past the last block
        return max(0, context_len - self.tokens) // self.block_size

    def assign(self, slot_mapping: torch.Tensor, in_window: list[bool], active_blocks: list[int],
               defer: bool = False) -> None:
        """Before a step writes its new tokens [T] at slot_mapping (on the host): blocks they start get staging
        or lose it, and `writes` says which tokens every layer mirrors into which staged rows.

        in_window [T]: the token's block is in its sequence's window after this step.
        active_blocks: physical blocks in the windows of this step's sequences (kept).
        defer (steps with prefill chunks): the step's reads see the staging as the steps before it left it, the
        plan is published at the next step, and tokens whose block the plan moves are mirrored after each layer's
        attention (`late_writes`; the rest before it, where the step's later rows of a sequence read them). A
        chunk's tail takes the slots of the window that its own first queries read (the pool is sized for decode,
        whose new block evicts none that its query reads): published at once, 64-token chunks read most of their
        window from codes (SmolLM2 tq4 at 8k, prose: +1.46% perplexity against the bf16 cache, deferred +0.46%).
        """
        self._publish()
        self._clock += 1
        plan = self.host_staging_of
        for block in active_blocks:
            if plan[block] >= 0:
                self._last_use[plan[block]] = self._clock
        slots = slot_mapping.tolist()
        blocks = [slot // self.block_size for slot in slots]
        for i, slot in enumerate(slots):
            if slot % self.block_size == 0:
                self._restage(blocks[i], in_window[i])
        staging = [plan[block] for block in blocks]
        if not defer:
            self.writes, self.late_writes = self._pairs(slots, staging), self.none
            self._publish()
            return
        seen = self.published[blocks].tolist()
        self.writes = self._pairs(slots, [s if s == p else -1 for s, p in zip(staging, seen)])
        self.late_writes = self._pairs(slots, [s if s != p else -1 for s, p in zip(staging, seen)])

    def _pairs(self, slots: list[int], staging: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, staged row) of the tokens with a staging block, on the device."""
        tokens = [i for i, s in enumerate(staging) if s >= 0]
        rows = torch.tensor([staging[i] * self.block_size + slots[i] % self.block_size for i in tokens],
                            dtype=torch.long)
        tokens, device = torch.tensor(tokens, dtype=torch.long), self.staging_of.device
        return tokens.to(device, non_blocking=True), rows.to(device, non_blocking=True)

    def _publish(self) -> None:
        """The plan's changes since the last publication, into the staging the reads see."""
        if self._changed:
            changed = torch.tensor(self._changed)
            planned = torch.tensor([self.host_staging_of[block] for block in self._changed])
            self.published[changed] = planned
            if self.staging_of is not self.published:
                device = self.staging_of.device
                self.staging_of[changed.to(device, non_blocking=True)] = planned.to(device, non_blocking=True)
            self._changed = []

    def _restage(self, block: int, wanted: bool) -> None:
        """A block starts over at offset 0: give it staging if it is wanted, else drop any."""
        staging = self.host_staging_of[block]
        if staging >= 0 and not wanted:
            self._block_of[staging], self._last_use[staging] = -1, -1
            self._place(block, -1)
        elif staging < 0 and wanted:
            staging = min(range(len(self._block_of)), key=self._last_use.__getitem__, default=-1)
            if staging < 0 or self._last_use[staging] == self._clock:
                return  # every staging block is in use this step: this block stays codes-only
            if self._block_of[staging] >= 0:
                self._place(self._block_of[staging], -1)
            self._block_of[staging] = block
            self._place(block, staging)
        if staging >= 0:
            self._last_use[staging] = self._clock

    def _place(self, block: int, staging: int) -> None:
        self.host_staging_of[block] = staging
        self._changed.append(block)

    def exists(self, blocks: torch.Tensor) -> torch.Tensor:
        """[..., n] physical blocks -> [..., n * block_size] bool: the token has a staged copy."""
        return (self.staging_of[blocks] >= 0).repeat_interleave(self.block_size, -1)

    def holds_sinks(self, blocks: list[int]) -> bool:
        """Whether the sink blocks among a block table's head `blocks` still have their staging (in the plan)."""
        return all(self.host_staging_of[block] >= 0 for block in blocks[:self.sink_blocks])


class RecentWindow:
    """One layer's staging pool, placed by a `Staging` that may be shared; `tokens` is R, `sinks` is S."""

    def __init__(self, staging: Staging, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.staging = staging
        self.tokens, self.sinks, self.block_size = staging.tokens, staging.sinks, staging.block_size
        self.sink_blocks, self.staging_of = staging.sink_blocks, staging.staging_of
        shape = (staging.num_staging, staging.block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def first_block(self, context_len: int) -> int:
        return self.staging.first_block(context_len)

    def exists(self, blocks: torch.Tensor) -> torch.Tensor:
        return self.staging.exists(blocks)

    def write(self, k: torch.Tensor, v: torch.Tensor, late: bool = False) -> None:
        """Mirror the step's new k/v [T, Hk, D] into the staged blocks (`Staging.assign` planned where): those
        before the layer's attention, or with `late` those after it."""
        tokens, rows = self.staging.late_writes if late else self.staging.writes
        if not len(tokens):  # a step without prefill chunks moves none late
            return
        self.k.view(-1, *self.k.shape[2:])[rows] = k[tokens].to(self.k.dtype)
        self.v.view(-1, *self.v.shape[2:])[rows] = v[tokens].to(self.v.dtype)

    def gather(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Staged K/V of physical blocks [..., n] -> [..., n * block_size, Hk, D] (garbage where none)."""
        index = self.staging_of[blocks].clamp_min(0)
        return self.k[index].flatten(-4, -3), self.v[index].flatten(-4, -3)
