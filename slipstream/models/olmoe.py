"""OLMoE: Mixtral's layout with OLMo's attention.

The q/k RMSNorms span the whole projection (all heads together, before the split into
heads), unlike Qwen3's per-head norms; `clip_qkv`, when set, clamps q, k and v. Top-k
weights are not renormalised unless `norm_topk_prob`.
"""
from __future__ import annotations

from slipstream.models.config import common_fields
from slipstream.models.mixtral import MixtralForCausalLM, MoeConfig


class OlmoeForCausalLM(MixtralForCausalLM):
    RENAMES = {}

    @staticmethod
    def config_from_hf(arch: str, cfg: dict) -> MoeConfig:
        bias = cfg.get("attention_bias", False)
        return MoeConfig(**common_fields(arch, cfg), attention_bias=bias, attention_out_bias=bias,
                         qk_norm="projection", clip_qkv=cfg.get("clip_qkv"),
                         num_experts=cfg["num_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                         moe_intermediate_size=cfg["intermediate_size"],
                         norm_topk_prob=cfg.get("norm_topk_prob", False))
