"""Qwen2-MoE and Qwen3-MoE: Mixtral's layout with Qwen's attention and their own expert options.

- Qwen2-MoE: q/k/v bias; every MoE layer also has a shared expert, scaled per token by a
  sigmoid gate, added to the routed experts' output; top-k weights are not renormalised
  unless `norm_topk_prob`.
- Qwen3-MoE: per-head q/k RMSNorm (as Qwen3), no shared expert.
- Both: layers listed in `mlp_only_layers`, or not on the `decoder_sparse_step` grid, keep a
  dense MLP of `intermediate_size`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from slipstream.layers.mlp import GatedMLP
from slipstream.layers.moe import SparseMoeBlock
from slipstream.models.config import UnsupportedModelError, common_fields
from slipstream.models.mixtral import MixtralForCausalLM, MoeConfig


@dataclass
class QwenMoeConfig(MoeConfig):
    shared_expert_intermediate_size: int = 0
    dense_layers: list[int] = field(default_factory=list)  # layers with a dense MLP instead of experts


class QwenMoeForCausalLM(MixtralForCausalLM):
    RENAMES = {}

    @staticmethod
    def config_from_hf(arch: str, cfg: dict) -> QwenMoeConfig:
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError(f"{arch} configs with use_sliding_window=true are not supported")
        qwen2 = arch == "Qwen2MoeForCausalLM"
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        step = cfg.get("decoder_sparse_step", 1)
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        dense = [i for i in range(cfg["num_hidden_layers"])
                 if i in mlp_only or not (num_experts > 0 and (i + 1) % step == 0)]
        bias = cfg.get("qkv_bias", True) if qwen2 else cfg.get("attention_bias", False)
        return QwenMoeConfig(
            **common_fields(arch, cfg),
            attention_bias=bias,
            attention_out_bias=False if qwen2 else bias,
            qk_norm=None if qwen2 else "head",
            num_experts=num_experts,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            norm_topk_prob=cfg.get("norm_topk_prob", False),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) if qwen2 else 0,
            dense_layers=dense,
        )

    def mlp(self, config: QwenMoeConfig, layer: int) -> nn.Module:
        if layer in config.dense_layers:
            return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                              config.num_experts_per_tok, config.norm_topk_prob, config.hidden_act,
                              shared_expert_intermediate_size=config.shared_expert_intermediate_size)
