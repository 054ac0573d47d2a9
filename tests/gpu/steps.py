"""What the GPU kernel tests share: the device, lazily imported kernel modules, and random steps
(ragged rows over shuffled block tables) as the model runner lays them out."""
from __future__ import annotations

import importlib

import torch

from tests.conftest import step_metadata

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def kernels(name: str):
    """A kernel module of backends/cuda, checked to run where conftest.py says: the interpreter off a GPU."""
    module = importlib.import_module(f"slipstream.backends.cuda.{name}")
    if DEVICE.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        jitted = [v for v in vars(module).values() if type(v).__name__ in ("JITFunction", "InterpretedFunction")]
        assert jitted and all(isinstance(f, InterpretedFunction) for f in jitted), \
            f"{name}'s kernels were decorated before TRITON_INTERPRET=1 was set"
    return module


def random_step(rows: list[tuple[int, int]], block_size: int, num_blocks: int, seed: int = 0):
    """rows: (new tokens, context length after the step) per row, one-token rows first. Returns the
    step's metadata over block tables drawn from a shuffled pool, as after frees and reuse."""
    return step_over(rows, shuffled_tables([c for _, c in rows], block_size, num_blocks, seed), block_size)


def shuffled_tables(context_lens: list[int], block_size: int, num_blocks: int, seed: int = 0) -> list[list[int]]:
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return [[order.pop() for _ in range(-(-c // block_size))] for c in context_lens]


def step_over(rows: list[tuple[int, int]], tables: list[list[int]], block_size: int):
    """The metadata of a step whose row i continues the sequence with blocks tables[i]."""
    tables = tables[:len(rows)]  # a step may continue only the first sequences
    slots = [t[p // block_size] * block_size + p % block_size for (n, c), t in zip(rows, tables, strict=True)
             for p in range(c - n, c)]
    return to_device(step_metadata([n for n, _ in rows], [c for _, c in rows], tables, slots))


def to_device(meta):
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_table"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    return meta
