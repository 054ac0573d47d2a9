"""TritonExperts: the CUDA backend's ExpertsMethod, the grouped GEMMs of moe_gemm.py (imported on first use).

Owns: what the kernels return summed per token in a fixed order (each token's k pairs in
expert order: no atomics, so a token's output does not depend on the rest of the batch), and
when to decline (an activation without a kernel: layers/moe.py's torch path runs).
"""
from __future__ import annotations

import torch

from slipstream.layers.mlp import ACTIVATIONS
from slipstream.layers.moe import ExpertGroups, Experts, ExpertsMethod


class TritonExperts(ExpertsMethod):
    def apply(self, experts: Experts, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        from slipstream.backends.cuda import moe_gemm

        act = next((name for name, fn in ACTIVATIONS.items() if fn is experts.act), None)
        if act not in moe_gemm.ACTIVATIONS or not len(groups.token):
            return super().apply(experts, x, groups)
        ys = moe_gemm.grouped_experts(x.contiguous(), experts.gate_up_proj, experts.down_proj, groups.token,
                                      groups.pair_weights, groups.counts, act)
        by_token = groups.token.argsort(stable=True)  # every token has the same number of pairs, top_k
        return ys[by_token].view(len(x), -1, ys.shape[1]).sum(1).to(x.dtype)
