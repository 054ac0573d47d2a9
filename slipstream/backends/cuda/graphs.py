"""DecodeGraphs: CUDA graphs of the model's forward for all-decode steps, one per batch-size bucket.

Owns: the bucket sizes (vLLM's: 1, 2, 4, then every multiple of 8 up to max_num_seqs), the
graphs' own persistent inputs (token ids, positions, slots, sequence lengths, block tables
as wide as max_model_len needs, query_start_loc fixed at 0..size), capture, and per step
copying the step's inputs in, padding the rows up to the bucket, and replaying. Must never
know the scheduler or sampling: the runner hands it a step's tensors, it hands back the hidden
states of the real rows, or None where no graph serves the step (a prefill row, more rows
than the largest bucket, not captured).

Padding rows are decodes of one token at position 0 whose K/V go to a scratch block that
no sequence owns (the engine keeps it out of the block manager), so they never touch a real
sequence's cache. Attention is captured with the host-side values it decides from set for
the worst case (contexts of max_model_len, so split-KV is chosen once per bucket); every
length itself is read on the device, so one graph serves every context.

What a graph can capture: only device work, with no Python deciding per step. The engine
enables graphs only for dense KV caches (a TurboQuant cache's 16-bit window is planned on the
host every step; MoE layers list their expert tiles on the device, so they are captured), and
only with `enforce_eager=False`: no GPU run has shown graphs correct yet, so they are off by
default.
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.attention.metadata import AttentionMetadata, use_metadata


def graph_blockers(device: torch.device, triton: bool, turboquant: bool) -> list[str]:
    """Why decode graphs cannot be captured for this engine (none: they can)."""
    reasons = [] if device.type == "cuda" else [f"they need a CUDA device, not {device}"]
    if not triton:
        reasons.append("the graphs capture the Triton attention kernel, and triton is not installed")
    if turboquant:
        reasons.append("TurboQuant caches plan their 16-bit window on the host every step")
    return reasons


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to and including max_num_seqs."""
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} must be a positive integer")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def bucket_for(batch: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `batch` rows; None if none does."""
    return next((s for s in sizes if s >= batch), None)


class DecodeGraphs:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, max_model_len: int,
                 scratch_block: int, device: torch.device):
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.scratch_block, self.block_size = scratch_block, block_size
        n = self.sizes[-1]
        long = dict(dtype=torch.int64, device=device)
        self.input_ids, self.positions = torch.zeros(n, **long), torch.zeros(n, **long)
        self.slot_mapping, self.seq_lens = torch.zeros(n, **long), torch.zeros(n, **long)
        self.query_start_loc = torch.arange(n + 1, **long)
        self.block_table = torch.zeros(n, max_blocks_per_seq, **long)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int | None:
        """Copy an all-decode step into the graph inputs, padding rows up to its bucket; the bucket,
        or None (nothing copied) where no graph serves the step."""
        batch = len(input_ids)
        size = bucket_for(batch, self.sizes)
        if size is None or meta.num_decodes != batch or meta.block_table.shape[1] > self.block_table.shape[1]:
            return None
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.block_table[:batch, :meta.block_table.shape[1]].copy_(meta.block_table)  # columns past a row's length: never read
        self._pad(batch, size)
        return size

    def _pad(self, start: int, stop: int) -> None:
        """Rows [start, stop): one token at position 0, written into the scratch block."""
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.slot_mapping[start:stop] = self.scratch_block * self.block_size
        self.seq_lens[start:stop] = 1
        self.block_table[start:stop, 0] = self.scratch_block

    def metadata(self, size: int) -> AttentionMetadata:
        """The metadata a graph of `size` rows is captured with (host values for the worst case)."""
        return AttentionMetadata(self.slot_mapping[:size], self.query_start_loc[:size + 1], self.seq_lens[:size],
                                 self.block_table[:size], size, list(range(size + 1)), [self.max_model_len] * size)

    @torch.inference_mode()  # as the runner's steps: no autograd state recorded into the graphs
    def capture(self, model: nn.Module) -> None:
        """One graph per bucket, largest first, sharing one memory pool (each warmed up once eagerly)."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._pad(0, size)
            meta = self.metadata(size)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), use_metadata(meta):
                model(self.input_ids[:size], self.positions[:size])  # warm-up: Triton compiles outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), use_metadata(meta):
                out = model(self.input_ids[:size], self.positions[:size])
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The hidden states [batch, H] of an all-decode step through its bucket's graph, or None."""
        size = self.fill(input_ids, positions, meta)
        if size is None or size not in self.graphs:
            return None
        graph, out = self.graphs[size]
        graph.replay()
        return out[:len(input_ids)]
