"""The tensor-parallel group of this process: its rank, its size, and the collectives layers call.

Layers read `tp_rank()` / `tp_size()` when they are built (to size their shards) and call
`all_reduce` / `all_gather` in their forward; with one rank every call is the identity, so
single-process code pays nothing. `device_group` carries activations (gloo on CPU, NCCL on
CUDA), or `shm` where the ranks share a machine and its memory (CPU; tensors up to a slot);
`cpu_group` carries the step inputs rank 0 broadcasts. This module never knows
models, schedulers or how the processes were started (distributed/launcher.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    device_group: object | None = None
    cpu_group: object | None = None
    shm: object | None = None  # backends/cpu/shm_collectives.ShmCollectives
    expert_parallel: bool = False  # MoE experts split by expert instead of by their features


_group = TensorParallelGroup()


def set_group(group: TensorParallelGroup) -> None:
    global _group
    _group = group


def group() -> TensorParallelGroup:
    return _group


def tp_rank() -> int:
    return _group.rank


def tp_size() -> int:
    return _group.size


def expert_parallel() -> bool:
    return _group.size > 1 and _group.expert_parallel


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's x (in place)."""
    if _group.size > 1 and not (_group.shm is not None and _group.shm.all_reduce(x)):
        dist.all_reduce(x, group=_group.device_group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's x, concatenated along `dim` in rank order."""
    if _group.size == 1:
        return x
    gathered = None if _group.shm is None else _group.shm.all_gather(x, dim)
    if gathered is not None:
        return gathered
    parts = [torch.empty_like(x) for _ in range(_group.size)]
    dist.all_gather(parts, x.contiguous(), group=_group.device_group)
    return torch.cat(parts, dim=dim)


def agree(value: int, op: str) -> int:
    """`op` ("min" or "max") of every rank's value, over the CPU group (start-up only)."""
    if _group.size == 1:
        return value
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=_group.cpu_group)
    return int(t)


def split(total: int, name: str) -> int:
    """This rank's share of `total` (heads, features) that every rank must hold equally."""
    if total % _group.size:
        raise ValueError(f"tensor_parallel_size={_group.size} must divide {name}={total}")
    return total // _group.size
