"""Reading the `*.safetensors` shards of an HF checkpoint directory (never pickles)."""
from __future__ import annotations

import glob
import os
from typing import Iterator

import torch


def hf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory {path!r} has no *.safetensors files (pickled .bin weights are never loaded)")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
