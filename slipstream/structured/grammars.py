"""Grammars: a StructuredOutputsParams -> a validated grammar (at once) -> a compiled grammar (later).

Validation builds xgrammar's tokenizer-free `Grammar` on the caller's thread (well under a
millisecond for a typical schema, cached per spec), so an invalid schema, regex or
grammar is a ValueError at add_request. Compiling against the vocabulary (tens of ms for a
schema on a 49k vocabulary, and the tokenizer view, ~0.5 s, on first use) runs on one worker
thread and is cached per distinct spec: `submit` returns a Future at once, and the engine
never waits for it while other sequences have work. xgrammar was chosen over llguidance by
measurement (benchmarks/grammar_libraries.py).

Must never know sequences, the scheduler or logits: it hands out grammars.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr

from slipstream.loader.tokenizer import NO_TOKENIZER
from slipstream.structured.params import StructuredOutputsParams
from slipstream.structured.schema import check_schema

MAX_CACHED = 512  # distinct specs kept (grammars and compiled grammars); the oldest used goes first


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled against the model's vocabulary: immutable, shared by every sequence using it."""

    compiled: xgr.CompiledGrammar
    # int32 bitmask ANDed into every mask, or None. JSON with fixed separators never needs a raw
    # control byte (RFC 8259 forbids them in strings), but xgrammar 0.2.9's length-bounded
    # strings (maxLength) allow them; this keeps the output parseable.
    token_filter: torch.Tensor | None
    stop_token_ids: tuple[int, ...]


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._lock = threading.Lock()
        self._grammars: OrderedDict[tuple[str, str], xgr.Grammar] = OrderedDict()
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipstream-grammar")
        self._compiler: xgr.GrammarCompiler | None = None  # built on the worker, on first use
        self._json_filter: torch.Tensor | None = None

    def validate(self, spec: StructuredOutputsParams) -> xgr.Grammar:
        """The spec's grammar; ValueError naming the problem if it is invalid or cannot be enforced."""
        if self.tokenizer is None:
            raise ValueError(f"structured_outputs: {NO_TOKENIZER}, so its tokens cannot be matched against a grammar")
        with self._lock:
            grammar = _touch(self._grammars, spec.key)
        if grammar is None:
            grammar = _grammar(spec)
            with self._lock:
                _put(self._grammars, spec.key, grammar)
        return grammar

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """A Future of the spec's CompiledGrammar (done at once if it was compiled before)."""
        grammar = self.validate(spec)
        with self._lock:
            future = _touch(self._compiled, spec.key)
            if future is None:
                future = self._pool.submit(self._compile, grammar, spec.is_json)
                _put(self._compiled, spec.key, future)
        return future

    def _compile(self, grammar: xgr.Grammar, is_json: bool) -> CompiledGrammar:
        compiler = self._get_compiler()
        return CompiledGrammar(compiler.compile_grammar(grammar), self._json_filter if is_json else None,
                               tuple(self.stop_token_ids))

    def _get_compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._json_filter = _no_control_bytes(info, self.vocab_size, self.stop_token_ids)
            # one thread: the engine and the server need the other cores
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler


def _grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    kind, text = spec.key
    if kind == "json":
        check_schema(json.loads(text))
    try:
        if kind in ("json", "json_object"):
            # fixed separators (", " and ": "), no free whitespace: small models otherwise loop on blanks
            return xgr.Grammar.from_json_schema(text if kind == "json" else '{"type": "object"}',
                                                any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":  # JSON string literals are EBNF string literals
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in json.loads(text)))
        return xgr.Grammar.from_ebnf(text) if "::=" in text else xgr.Grammar.from_lark(text)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"structured_outputs.{kind}: {_library_message(e)}") from None


def _library_message(error: Exception) -> str:
    """xgrammar's message without its timestamp, C++ source location and assertion text."""
    line = next((s for s in str(error).splitlines() if s.strip()), str(error))
    line = re.sub(r"^\[[\d:.]+\]\s*\S+:\d+:\s*", "", line)
    return re.sub(r"^Check failed: \(.*?\) is false:\s*", "", line).strip()


def _no_control_bytes(info: xgr.TokenizerInfo, vocab_size: int, keep: list[int]) -> torch.Tensor:
    allowed = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
    for token_id, piece in enumerate(info.decoded_vocab[:vocab_size]):
        allowed[token_id] = not any(b < 0x20 for b in piece)
    allowed[keep] = True
    return torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32).copy())


def _touch(cache: OrderedDict, key):
    value = cache.get(key)
    if value is not None:
        cache.move_to_end(key)
    return value


def _put(cache: OrderedDict, key, value) -> None:
    cache[key] = value
    while len(cache) > MAX_CACHED:
        cache.popitem(last=False)
