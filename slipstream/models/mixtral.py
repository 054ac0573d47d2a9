"""Mixtral: the llama decoder with its MLP replaced by a sparse mixture of experts.

Attention, norms and rotary embedding are llama's; each layer's MLP (`mlp()`) is a
`SparseMoeBlock` (8 experts, top-2, the two weights renormalised to sum to 1). Qwen2-MoE,
Qwen3-MoE and OLMoE are built on this class and change only the config they read (which
sets their attention's options) and the MLP of each layer.

Checkpoints store experts either one tensor per expert (`block_sparse_moe.experts.3.w1.weight`,
as transformers' `save_pretrained` writes them) or stacked (`mlp.experts.gate_up_proj`);
`load_weights` accepts both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from slipstream.layers.moe import SparseMoeBlock
from slipstream.models.config import ModelConfig, common_fields
from slipstream.models.llama import LlamaForCausalLM
from slipstream.models.weights import load_stacked_weights, rename_weights, stack_expert_weights


@dataclass
class MoeConfig(ModelConfig):
    """A llama-like decoder whose MLPs are mixtures of experts."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0     # width of one expert
    norm_topk_prob: bool = True        # renormalise the k routing weights to sum to 1


class MixtralForCausalLM(LlamaForCausalLM):
    # checkpoint name fragment -> our module path, applied before loading
    RENAMES = {".block_sparse_moe.": ".mlp."}

    @staticmethod
    def config_from_hf(arch: str, cfg: dict) -> MoeConfig:
        return MoeConfig(**common_fields(arch, cfg), attention_bias=cfg.get("attention_bias", False),
                         sliding_window=cfg.get("sliding_window"),
                         num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                         moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)

    def mlp(self, config: MoeConfig, layer: int) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                              config.num_experts_per_tok, config.norm_topk_prob, config.hidden_act)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = stack_expert_weights(rename_weights(weights, self.RENAMES), self.config.num_experts)
        load_stacked_weights(self, weights)
