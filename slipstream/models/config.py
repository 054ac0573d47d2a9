"""ModelConfig: a decoder's architecture in transformers' vocabulary, and how families read it.

Each family parses an HF-style config dict (a checkpoint's config.json, or a GGUF file's
metadata turned into one by the loader) with `common_fields` plus its own keys; a config it
cannot run is an `UnsupportedModelError` naming the value. This module never reads files.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class UnsupportedModelError(ValueError):
    pass


@dataclass
class ModelConfig:
    """Architecture of a llama-family decoder, in transformers' vocabulary."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # bias on q/k/v projections
    attention_out_bias: bool = False  # bias on the output projection
    qk_norm: str | None = None        # "head": q/k RMSNorm per head; "projection": over all heads (OLMoE)
    clip_qkv: float | None = None     # clamp q, k and v to [-clip_qkv, clip_qkv] (OLMoE)
    sliding_window: int | None = None
    hidden_act: str = "silu"
    final_logit_softcapping: float | None = None  # logits -> tanh(logits / cap) * cap (Gemma)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)


def common_fields(arch: str, cfg: dict) -> dict:
    """The ModelConfig fields every llama-like family reads the same way."""
    heads = cfg["num_attention_heads"]
    rope_theta, rope_scaling = rope_parameters(cfg)
    return dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        hidden_act=cfg.get("hidden_act", "silu"),
        bos_token_id=cfg.get("bos_token_id"),
    )


def rope_parameters(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict) from either transformers v4 or v5 config layouts."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return cfg.get("rope_theta") or rope.get("rope_theta", 10000.0), rope or None
