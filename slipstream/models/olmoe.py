"""OLMoE: Mixtral's layout with OLMo's attention.

The q/k RMSNorms span the whole projection (all heads together, before the split into
heads), unlike Qwen3's per-head norms; `clip_qkv`, when set, clamps q, k and v. Top-k
weights are not renormalised unless `norm_topk_prob`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from slipstream.attention import attend
from slipstream.attention.metadata import get_metadata
from slipstream.layers.norm import RMSNorm
from slipstream.layers.rotary import RotaryEmbedding
from slipstream.models.config import common_fields
from slipstream.models.llama import LlamaAttention
from slipstream.models.mixtral import MixtralForCausalLM, MoeConfig


@dataclass
class OlmoeConfig(MoeConfig):
    clip_qkv: float | None = None


class OlmoeAttention(LlamaAttention):
    def __init__(self, config: OlmoeConfig, rotary: RotaryEmbedding):
        super().__init__(config, rotary)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        self.clip_qkv = config.clip_qkv

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = attend(q, k, v, self.kv_cache, get_metadata(), self.scale, self.sliding_window)
        return self.o_proj(out.flatten(1))


class OlmoeForCausalLM(MixtralForCausalLM):
    RENAMES = {}

    @staticmethod
    def config_from_hf(arch: str, cfg: dict) -> OlmoeConfig:
        bias = cfg.get("attention_bias", False)
        return OlmoeConfig(**common_fields(arch, cfg), attention_bias=bias, attention_out_bias=bias,
                           num_experts=cfg["num_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                           moe_intermediate_size=cfg["intermediate_size"],
                           norm_topk_prob=cfg.get("norm_topk_prob", False), clip_qkv=cfg.get("clip_qkv"))

    def attention(self, config: OlmoeConfig, rotary: RotaryEmbedding, layer: int) -> nn.Module:
        return OlmoeAttention(config, rotary)
