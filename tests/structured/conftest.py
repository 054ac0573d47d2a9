"""A tiny random llama with SmolLM2's tokenizer: a real 49k vocabulary for grammars, at random-model speed.

A random model is an adversarial writer: it puts its mass anywhere in the vocabulary, so
whatever it emits under a grammar is valid only because the mask made it so.
"""
from __future__ import annotations

import pytest

from slipstream.loader.tokenizer import load_tokenizer
from tests.conftest import build_tiny_checkpoint

SMOLLM2_VOCAB = 49152


@pytest.fixture(scope="session")
def tiny_with_tokenizer(tmp_path_factory, smollm2_gguf) -> str:
    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_tokenizer")), "llama", num_kv_heads=2,
                                 vocab_size=SMOLLM2_VOCAB, eos_token_id=2, max_position_embeddings=1024)
    load_tokenizer(smollm2_gguf).save_pretrained(path)
    return path
