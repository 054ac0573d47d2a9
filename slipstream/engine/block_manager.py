"""BlockManager: physical KV blocks, their reference counts, block tables, and the prefix cache.

Every full block gets a hash chained from its parent's hash, its own token ids and the
request's cache salt. A new sequence reuses the cached blocks of its longest cached
prefix (reference count + 1) and computes only the rest. Freed blocks keep their content
and hash; allocation takes the least recently freed block first, so a cached prefix lives
until its memory is actually needed. A hit is verified against the block's token ids and
its parent block, so even a hash collision can never hand out the wrong K/V. Where `stale_head`
says that a hit's first blocks no longer read as they were computed (a TurboQuant cache's sinks
whose 16-bit copy is gone, kvcache/cache.py), those are computed again into fresh blocks and the
rest of the hit is shared: their K/V depends on no later token, and the rest was computed with
the head as it then read.

Invariants: free + used = total; ref counts never negative; a block is in the free queue
exactly when its ref count is 0.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Callable

from slipstream.engine.sequence import Sequence

HashFn = Callable[[bytes | None, tuple[int, ...], str | None], bytes]


def sha256_block_hash(parent: bytes | None, token_ids: tuple[int, ...], salt: str | None) -> bytes:
    h = hashlib.sha256(parent or b"root")
    h.update(repr((token_ids, salt)).encode())
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "parent_id", "salt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.reset()

    def reset(self) -> None:
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.parent_id: int | None = None
        self.salt: str | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = sha256_block_hash, stale_head: Callable[[list[int]], int] = lambda hits: 0):
        self.block_size = block_size
        self.stale_head = stale_head
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # --- sizes -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(self.blocks[b].hash is not None for b in self.free_queue)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache ------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Chained hashes of the sequence's first `num_blocks` full blocks (memoised on it)."""
        hashes = seq.block_hashes
        for i in range(len(hashes), num_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(self.hash_fn(hashes[i - 1] if i else None, tokens, seq.cache_salt))
        return hashes[:num_blocks]

    def find_cached_prefix(self, seq: Sequence) -> list[int | None]:
        """Block ids holding the longest cached prefix, None for a head block to compute again; the last token is
        always left to compute."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []
        hits: list[int] = []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i, h in enumerate(self.block_hashes(seq, max_blocks)):
            block_id = self.cached.get(h)
            if block_id is None or not self._matches(self.blocks[block_id], seq, i, hits):
                break
            hits.append(block_id)
        stale = self.stale_head(hits) if hits else 0
        return [] if stale >= len(hits) > 0 else [None] * stale + hits[stale:]

    def _matches(self, block: Block, seq: Sequence, index: int, hits: list[int]) -> bool:
        tokens = tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size])
        parent = hits[-1] if hits else None
        return block.token_ids == tokens and block.parent_id == parent and block.salt == seq.cache_salt

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks the sequence has completely filled with computed K/V."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        hashes = self.block_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.cached:
                block.hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                block.parent_id = seq.block_table[i - 1] if i else None
                block.salt = seq.cache_salt
                self.cached[block.hash] = block.block_id
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    # --- allocation --------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, hits: list[int | None], num_new_tokens: int) -> bool:
        """Room for a head to compute again and the first `num_new_tokens` tokens after the hit (admitted on its
        head's room alone, the last of tq3's 14 requests in benchmarks/kv_capacity.py was preempted 14 times, not
        once: at the chunk after its head, each time it came back)."""
        needed = hits.count(None) + self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        reclaimed = sum(self.blocks[b].ref_count == 0 for b in hits if b is not None)
        return needed <= self.num_free_blocks - reclaimed

    def allocate(self, seq: Sequence, hits: list[int | None], num_new_tokens: int) -> int:
        """Admit a waiting sequence: share its cached prefix, with fresh blocks for a head to compute again (the
        sequence's first chunk then), and room for the first `num_new_tokens` tokens after it. Returns the prompt
        tokens that the cache serves."""
        assert not seq.block_table
        head = hits.count(None)
        for block_id in hits[head:]:
            self._take(block_id)
        seq.block_table = [self._fresh_block() for _ in range(head)] + hits[head:]
        seq.num_computed_tokens = len(hits) * self.block_size  # the room after the hit counts from its end
        seq.num_registered_blocks = len(hits)
        assert self.append_slots(seq, num_new_tokens)
        if head:
            seq.cached_gap, seq.num_computed_tokens = (head * self.block_size, seq.num_computed_tokens), 0
        cached = (len(hits) - head) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += cached
        return cached

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for the next `num_new_tokens`; all-or-nothing."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            return False
        seq.block_table += [self._fresh_block() for _ in range(needed)]
        return True

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, tail first, so its head stays cached the longest."""
        self.trim(seq, 0)
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.cached_gap = None

    def trim(self, seq: Sequence, num_tokens: int) -> bool:
        """Release the blocks past those the first `num_tokens` tokens need (lookahead slots of
        rejected draft tokens, never registered: they lie past the computed tokens); True if any."""
        keep = self.blocks_for(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} ref count went negative"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        released = len(seq.block_table) > keep
        del seq.block_table[keep:]
        return released

    def _fresh_block(self) -> int:
        """The least recently freed block, its cached content given up."""
        block_id = next(iter(self.free_queue))
        self._evict(block_id)
        self._take(block_id)
        return block_id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.reset()

    # --- accounting --------------------------------------------------------------------
    def fragmentation(self, seqs: list[Sequence]) -> float:
        """1 - (token slots holding K/V) / (token slots in allocated blocks)."""
        filled: dict[int, int] = {}
        for seq in seqs:
            for i, block_id in enumerate(seq.block_table):
                n = min(self.block_size, max(0, seq.num_computed_tokens - i * self.block_size))
                filled[block_id] = max(filled.get(block_id, 0), n)
        if not filled:
            return 0.0
        return 1.0 - sum(filled.values()) / (len(filled) * self.block_size)
