"""Checkpoint naming: how a checkpoint's tensors become our parameters.

Our modules fuse what checkpoints keep apart (q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`) and hold experts stacked (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]); families whose checkpoints name modules differently rename
them first. Everything here works on (name, tensor) iterators and a module's parameter
names; it never reads files and never knows a family's config. A tensor may also be a
`GGUFWeight` (blocks as a GGUF file stores them): it fuses by whole rows and is attached to
its layers instead of copied into a float parameter. Under tensor parallelism each tensor
is cut to the rank's shard (distributed/shard.py) as it is read, before anything is fused.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

from slipstream.distributed.shard import shard_of
from slipstream.layers.gguf_linear import GGUFWeight, attach

Weights = Iterable[tuple[str, torch.Tensor | GGUFWeight]]

# checkpoint name fragment -> (fused parameter fragment, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# per-expert tensor name -> (stacked parameter, shard in gate_up or None for down)
_EXPERT_PROJ = {
    "w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1), "up_proj": ("gate_up_proj", 1),
    "w2": ("down_proj", None), "down_proj": ("down_proj", None),
}
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def load_stacked_weights(model: nn.Module, weights: Weights) -> None:
    """Copy checkpoint tensors into parameters, stacking split projections into fused ones.

    Every parameter must be written exactly once (a tied LM head counts as written by the
    embedding); a missing or unexpected tensor is an error naming it.
    """
    params = dict(model.named_parameters())
    pending = {name: {} for name in params}
    for name, tensor in weights:
        target, shard = name, None
        for fragment, (fused, index) in _STACKED.items():
            if f".{fragment}." in name:
                target, shard = name.replace(f".{fragment}.", f".{fused}."), index
                break
        if target not in params:
            if getattr(model.config, "tie_word_embeddings", False) and target == "lm_head.weight":
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        pending[target][shard] = shard_of(params[target], shard, tensor)
    for name, param in params.items():
        shards = pending[name]
        if not shards:
            raise ValueError(f"checkpoint lacks tensor for parameter {name!r}")
        tensor = shards[None] if None in shards else _concat_rows([shards[i] for i in sorted(shards)])
        if tensor.shape != param.shape:
            raise ValueError(f"tensor for {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        if isinstance(tensor, GGUFWeight):
            attach(model, name, tensor)
            continue
        with torch.no_grad():
            param.copy_(tensor)


def _concat_rows(shards: list) -> torch.Tensor | GGUFWeight:
    if all(isinstance(s, GGUFWeight) for s in shards):
        return GGUFWeight.concat(shards)
    return torch.cat([s.dequantize() if isinstance(s, GGUFWeight) else s for s in shards])


def rename_weights(weights: Weights, renames: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Replace the first matching fragment of each name (checkpoint layout -> ours)."""
    for name, tensor in weights:
        for old, new in renames.items():
            if old in name:
                name = name.replace(old, new, 1)
                break
        yield name, tensor


def stack_expert_weights(weights: Weights, num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn per-expert tensors (`...experts.3.w1.weight`, `...experts.3.gate_proj.weight`) into
    stacked ones (`...experts.gate_up_proj` [E, 2I, H], `...experts.down_proj` [E, H, I]).

    Other tensors, including already stacked experts, pass through unchanged. A stacked
    tensor is emitted as soon as all its experts have been read; an incomplete set is an error.
    """
    pending: dict[str, dict[int, dict]] = {}
    for name, tensor in weights:
        match = _PER_EXPERT.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        if expert >= num_experts:
            raise ValueError(f"checkpoint tensor {name!r} names expert {expert}, but the model has {num_experts}")
        target, shard = _EXPERT_PROJ[proj]
        key = f"{prefix}.{target}"
        parts = pending.setdefault(key, {})
        parts.setdefault(expert, {})[shard] = tensor
        shards = 2 if shard is not None else 1
        if len(parts) == num_experts and all(len(p) == shards for p in parts.values()):
            yield key, torch.stack([_expert_tensor(parts[e]) for e in range(num_experts)])
            del pending[key]
    if pending:
        key, parts = next(iter(pending.items()))
        raise ValueError(f"checkpoint has an incomplete set of expert tensors for {key!r}: "
                         f"experts {sorted(parts)} of {num_experts}")


def _expert_tensor(parts: dict) -> torch.Tensor:
    return parts[None] if None in parts else torch.cat([parts[0], parts[1]])
