"""Reading an HF `config.json` (and `generation_config.json`) into a ModelConfig."""
from __future__ import annotations

import json
import os

from slipstream.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class UnsupportedModelError(ValueError):
    pass


def read_hf_config(path: str) -> ModelConfig:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} in {path} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    heads = cfg["num_attention_heads"]
    bias = cfg.get("attention_bias", False)
    return ModelConfig(
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
        rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
        rope_scaling=rope or None,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=True if arch == "Qwen2ForCausalLM" else bias,
        attention_out_bias=bias if arch in ("LlamaForCausalLM", "MistralForCausalLM") else False,
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=_sliding_window(arch, cfg),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(path, cfg),
    )


def _sliding_window(arch: str, cfg: dict) -> int | None:
    if arch == "MistralForCausalLM":
        return cfg.get("sliding_window")
    if arch.startswith("Qwen") and cfg.get("use_sliding_window"):
        raise UnsupportedModelError("Qwen configs with use_sliding_window=true are not supported")
    return None


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
