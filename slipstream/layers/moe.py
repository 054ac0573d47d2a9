"""Mixture of experts: a top-k router, experts as stacked weights, execution grouped by expert.

One `SparseMoeBlock` replaces a dense MLP. The router scores every expert for every token
(linear -> softmax in float32 -> top-k, optionally renormalising the k weights). The
experts' weights are stacked tensors, `gate_up_proj` [E, 2*I, H] and `down_proj` [E, H, I]
(transformers 5's fused layout). Execution is grouped by expert: the (token, expert) pairs
are sorted by expert, each expert runs once on all its tokens, and the weighted outputs
are scatter-added back to their tokens; how the groups run is the `ExpertsMethod` a backend
binds (backends/cpu/moe.py: native expert kernels, float32 for large groups). Options of the
same block cover the families:

- a shared expert that every token passes through, scaled by its own sigmoid gate (Qwen2-MoE);
- Gemma 4's router: the router reads its own input (the pre-norm residual), RMS-normalised
  and scaled, and each expert's weight is multiplied by a learned per-expert scale.

The block counts how many tokens each expert received (`expert_counts`, accumulated until
reset); `load_balance_summary` prints those counts. This module never knows checkpoint
names (models/weights.py stacks per-expert tensors into this layout).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.distributed.parallel_state import all_reduce, expert_parallel, split, tp_rank, tp_size
from slipstream.distributed.shard import Shard, set_shards
from slipstream.layers.linear import Linear
from slipstream.layers.mlp import GatedMLP, activation
from slipstream.layers.norm import rms_norm


class TopKRouter(Linear):
    """Scores -> softmax (float32) -> top-k; returns (weights [T, k] float32, expert ids [T, k]).
    The scores are a linear layer's, so the backend binds their GEMM like any other (never
    quantized: a quantized router moves tokens between experts)."""

    quantized = False

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 input_scale: bool = False, per_expert_scale: bool = False, eps: float = 1e-6):
        super().__init__(hidden_size, num_experts, bias=False)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.top_k = top_k
        self.renormalize = renormalize
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(hidden_size)) if input_scale else None
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts)) if per_expert_scale else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scale is not None:  # Gemma 4: normalised input, learned scale, 1/sqrt(H)
            x = rms_norm(x, self.eps) * self.scale * x.shape[-1] ** -0.5
        probs = super().forward(x).float().softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.per_expert_scale is not None:
            weights = weights * self.per_expert_scale[ids].float()
        return weights, ids


@dataclass
class ExpertGroups:
    """A layer's (token, expert) pairs sorted by expert: `token[j]` and `pair_weights[j]` (float32)
    of pair j; expert e takes the `counts[e]` pairs after those of experts 0..e-1."""
    token: torch.Tensor
    pair_weights: torch.Tensor
    counts: torch.Tensor  # [E] on the device

    @functools.cached_property
    def sizes(self) -> list[int]:
        """counts on the host, for methods that loop over experts in Python: one host sync per layer."""
        return self.counts.tolist()


class ExpertsMethod:
    """How a backend runs the expert groups: here each expert once on its tokens, in the model
    dtype, the weighted outputs scatter-added back."""

    def apply(self, experts: Experts, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        xs, start = x[groups.token], 0
        ys = torch.empty_like(xs)
        for e, n in enumerate(groups.sizes):
            if n:
                ys[start:start + n] = experts.expert(e, xs[start:start + n])
            start += n
        ys.mul_(groups.pair_weights.unsqueeze(1).to(ys.dtype))
        return x.new_zeros(x.shape).index_add_(0, groups.token, ys)


class Experts(nn.Module):
    """E gated MLPs held as stacked weights, run grouped by expert by the method a backend binds.

    Under tensor parallelism every rank holds every expert's slice of the intermediate
    features (gate and up by rows, down by columns), or with expert parallelism E/N whole
    experts (`first_expert` on), running only the pairs routed to them. Either way its output
    is a partial sum that the block all-reduces, and the router, replicated, needs no exchange."""

    method = ExpertsMethod()

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str = "silu"):
        super().__init__()
        local_experts = split(num_experts, "num_experts") if expert_parallel() else num_experts
        local = intermediate_size if expert_parallel() else split(intermediate_size, "the experts' intermediate_size")
        self.first_expert = tp_rank() * local_experts if expert_parallel() else 0
        self.gate_up_proj = nn.Parameter(torch.empty(local_experts, 2 * local, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(local_experts, hidden_size, local))
        if expert_parallel():
            for param in (self.gate_up_proj, self.down_proj):
                set_shards(param, {None: Shard(0, ((self.first_expert, local_experts),))})
        elif tp_size() > 1:
            start = tp_rank() * local
            set_shards(self.gate_up_proj, {None: Shard(1, ((start, local), (intermediate_size + start, local)))})
            set_shards(self.down_proj, {None: Shard(2, ((start, local),))})
        self.act = activation(act)
        self.silu = act == "silu"

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights, ids [T, k]; counts [E] = pairs per expert. Returns [T, H]."""
        order = ids.flatten().argsort(stable=True)  # pairs grouped by expert, expert 0 first
        first, local = self.first_expert, self.gate_up_proj.shape[0]
        if local < len(counts):  # expert parallel: this rank's experts' pairs, found on the host
            sizes = counts.tolist()
            order = order[sum(sizes[:first]):sum(sizes[:first + local])]
            counts = counts[first:first + local]
        groups = ExpertGroups(order // ids.shape[1], weights.flatten()[order].float(), counts)
        return self.method.apply(self, x, groups)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down_proj[e])


class SparseMoeBlock(nn.Module):
    """Router + grouped experts (+ optional sigmoid-gated shared expert); counts tokens per expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, act: str = "silu", shared_expert_intermediate_size: int = 0,
                 router_input_scale: bool = False, per_expert_scale: bool = False, eps: float = 1e-6):
        super().__init__()
        self.num_experts = num_experts
        self.gate = TopKRouter(hidden_size, num_experts, top_k, renormalize, router_input_scale, per_expert_scale, eps)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, act)
        self.shared_expert = None
        if shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, act)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
        self.register_buffer("expert_counts", torch.zeros(num_experts, dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. `router_input` (default x) is what the router scores."""
        weights, ids = self.gate(x if router_input is None else router_input)
        flat = ids.flatten()  # not bincount: on a GPU it reads its largest id back to the host
        counts = flat.new_zeros(self.num_experts).scatter_add_(0, flat, torch.ones_like(flat))
        self.expert_counts += counts
        out = all_reduce(self.experts(x, weights, ids, counts))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def reset_counts(self) -> None:
        self.expert_counts.zero_()


def routing_stats(layers: Iterable[nn.Module]) -> dict[int, list[int]]:
    """{decoder layer index: tokens routed to each expert} for every layer whose MLP is a SparseMoeBlock."""
    return {i: block.expert_counts.tolist() for i, block in _moe_blocks(layers)}


def reset_routing_stats(layers: Iterable[nn.Module]) -> None:
    for _, block in _moe_blocks(layers):
        block.reset_counts()


def _moe_blocks(layers: Iterable[nn.Module]) -> Iterator[tuple[int, SparseMoeBlock]]:
    for i, layer in enumerate(layers):
        block = next((m for m in layer.modules() if isinstance(m, SparseMoeBlock)), None)
        if block is not None:
            yield i, block


def load_balance_summary(expert_load: dict[int, list[int]]) -> str:
    """A table: per layer, routed pairs, max/mean and min/mean load (1.00 = perfectly balanced)."""
    lines = ["layer  pairs  max/mean  min/mean  busiest  idle experts"]
    for layer, counts in expert_load.items():
        total = sum(counts)
        mean = total / len(counts)
        if not total:
            lines.append(f"{layer:5d}  {0:5d}         -         -        -  {len(counts)}")
            continue
        busiest = max(range(len(counts)), key=counts.__getitem__)
        lines.append(f"{layer:5d}  {total:5d}  {max(counts) / mean:8.2f}  {min(counts) / mean:8.2f}  "
                     f"{busiest:7d}  {counts.count(0)}")
    return "\n".join(lines)
