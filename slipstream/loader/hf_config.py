"""Reading an HF checkpoint's `config.json` (and `generation_config.json`) as a dict."""
from __future__ import annotations

import json
import os


def read_hf_config(path: str) -> dict:
    """config.json, with `eos_token_id` the sorted list of every end-of-sequence id it and
    generation_config.json name."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    ids = _as_list(cfg.get("eos_token_id"))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            ids += _as_list(json.load(f).get("eos_token_id"))
    return cfg | {"eos_token_id": sorted(set(ids))}


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
