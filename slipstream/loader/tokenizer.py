"""Tokenizer and chat template, from transformers (GGUF files via `gguf_file=`).

A checkpoint directory without tokenizer files still loads: the engine then accepts
token-id prompts only and returns empty texts.
"""
from __future__ import annotations

import os
import warnings

NO_TOKENIZER = "no tokenizer is loaded (the model has no tokenizer files, or skip_tokenizer_init=True)"


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if path.endswith(".gguf"):
            return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        if not _has_tokenizer_files(path):
            return None
        return AutoTokenizer.from_pretrained(path)


def _has_tokenizer_files(path: str) -> bool:
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    return any(os.path.isfile(os.path.join(path, n)) for n in names)
