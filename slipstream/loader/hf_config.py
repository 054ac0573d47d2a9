"""Reading an HF `config.json` (and `generation_config.json`) into the model family's config."""
from __future__ import annotations

import json
import os

from slipstream.config import ModelConfig


class UnsupportedModelError(ValueError):
    pass


def read_hf_config(path: str) -> ModelConfig:
    from slipstream.models.registry import ARCHITECTURES

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} in {path} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    config = ARCHITECTURES[arch].config_from_hf(arch, cfg)
    config.eos_token_ids = _eos_ids(path, cfg)
    return config


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


def _eos_ids(path: str, cfg: dict) -> list[int]:
    ids = _as_list(cfg.get("eos_token_id"))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            ids += _as_list(json.load(f).get("eos_token_id"))
    return sorted(set(ids))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
