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
