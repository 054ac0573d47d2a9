"""Gemma 3 (text): multi-query attention, local sliding-window layers interleaved with global ones.

Differences from the llama family, each in one place below:
- embeddings are scaled by sqrt(hidden_size), the factor rounded to the model dtype first;
- Gemma's RMSNorm scales by (1 + weight), in float32, before casting back;
- per-head q/k norms, and a norm after attention and after the MLP as well as before them;
- gated GELU (tanh approximation) MLP;
- local layers attend to the last `sliding_window` tokens and use their own rope base;
  global layers see the whole context with rope_theta (and its scaling, if any);
- attention scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- optional tanh soft-capping of the final logits; tied LM head. Gemma 3 replaced Gemma 2's
  soft-capping of attention scores with the q/k norms: `attn_logit_softcapping` is ignored,
  as transformers (the reference) ignores it.

Text-only: `Gemma3ForCausalLM` checkpoints and `gemma3` GGUF files. The multimodal
`Gemma3ForConditionalGeneration` (vision tower, nested config) is not supported.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
from torch import nn

from slipstream.layers.embedding import VocabParallelEmbedding
from slipstream.layers.mlp import GatedMLP
from slipstream.layers.norm import RMSNorm
from slipstream.layers.rotary import RotaryEmbedding
from slipstream.models.causal_lm import CausalLM, scaled_embedding
from slipstream.models.config import ModelConfig, UnsupportedModelError, common_fields
from slipstream.models.llama import LlamaAttention

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class Gemma3Config(ModelConfig):
    layer_types: list[str] = field(default_factory=list)  # SLIDING or FULL, one per layer
    query_pre_attn_scalar: float = 256.0
    rope_local_theta: float = 10000.0                    # rope base of the sliding layers


def _rope_bases(cfg: dict) -> tuple[float, dict | None, float]:
    """(global theta, global scaling dict, local theta) from the v5 or the v4 config layout."""
    rope = cfg.get("rope_parameters") or {}
    if FULL in rope or SLIDING in rope:  # transformers v5: one dict per layer type
        full, local = rope.get(FULL) or {}, rope.get(SLIDING) or {}
        return full.get("rope_theta", 1e6), full or None, local.get("rope_theta", 10000.0)
    scaling = cfg.get("rope_scaling")
    return cfg.get("rope_theta", 1e6), scaling, cfg.get("rope_local_base_freq", 10000.0)


def _layer_types(cfg: dict) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:  # older configs: every `pattern`-th layer is global
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(cfg["num_hidden_layers"])]
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown or len(types) != cfg["num_hidden_layers"]:
        raise UnsupportedModelError(f"layer_types must list {cfg['num_hidden_layers']} of {SLIDING!r}/{FULL!r}, "
                                    f"got {len(types)} with unknown {unknown}")
    return list(types)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, layer_type: str, rotary: RotaryEmbedding):
        super().__init__()
        norm = partial(RMSNorm, eps=config.rms_norm_eps, unit_offset=True)
        self.input_layernorm = norm(config.hidden_size)
        window = config.sliding_window if layer_type == SLIDING else None
        self.self_attn = LlamaAttention(config, rotary, window, config.query_pre_attn_scalar ** -0.5, unit_offset=True)
        self.post_attention_layernorm = norm(config.hidden_size)
        self.pre_feedforward_layernorm = norm(config.hidden_size)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.post_feedforward_layernorm = norm(config.hidden_size)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    decode_stack: Callable[[torch.Tensor, torch.Tensor], bool] | None = None  # as LlamaModel's

    def __init__(self, config: Gemma3Config):
        super().__init__()
        rotary = {
            FULL: RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling),
            SLIDING: RotaryEmbedding(config.head_dim, config.rope_local_theta),
        }
        self.embed_scale = config.hidden_size ** 0.5
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, t, rotary[t]) for t in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = scaled_embedding(self.embed_tokens, input_ids, self.embed_scale)
        if self.decode_stack is not None and self.decode_stack(positions, x):
            return x
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class Gemma3ForCausalLM(CausalLM):
    @staticmethod
    def config_from_hf(arch: str, cfg: dict) -> Gemma3Config:
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("Gemma 3 configs with use_bidirectional_attention=true are not supported")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedModelError(f"Gemma 3 hidden_activation {act!r} is not supported; "
                                        "supported: 'gelu_pytorch_tanh'")
        rope_theta, rope_scaling, rope_local_theta = _rope_bases(cfg)
        fields = common_fields(arch, cfg) | dict(
            max_position_embeddings=cfg.get("max_position_embeddings", 131072),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            hidden_act="gelu_pytorch_tanh",
        )
        return Gemma3Config(
            **fields,
            attention_bias=cfg.get("attention_bias", False),
            attention_out_bias=cfg.get("attention_bias", False),
            qk_norm="head",
            sliding_window=cfg.get("sliding_window", 4096),
            layer_types=_layer_types(cfg),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
            rope_local_theta=rope_local_theta,
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )

    def __init__(self, config: Gemma3Config):
        super().__init__(config, Gemma3Model(config))
