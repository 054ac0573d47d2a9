"""xgrammar against llguidance on SmolLM2's tokenizer: the measurements behind slipstream's choice.

For each library and each spec (JSON schemas of the shapes the structured-output tests use,
"any JSON object", a regex, a choice): the time to build its tokenizer view, the time to
compile a spec the first time and again (the serving case: many requests, few distinct
specs), the time to fill one row's token bitmask per step along a valid output, and
correctness: random walks through each mask's allowed tokens until the grammar ends (EOS
taken with probability 1/2 where allowed; otherwise, half of the time, a token without a
letter or digit, so that strings close and walks finish) must always parse and validate. Run: `python benchmarks/grammar_libraries.py [--walks 20]`.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from enum import Enum

import torch
from pydantic import BaseModel, Field

from slipstream.loader.registry import resolve_model_path
from slipstream.loader.tokenizer import load_tokenizer

VOCAB = 49152  # SmolLM2's LM head
MAX_WALK = 400


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    street: str = Field(max_length=40)
    city: str = Field(max_length=30)
    zip_code: int = Field(ge=10000, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=130)
    favourite: Color
    address: Address
    tags: list[str] = Field(max_length=4)
    nickname: str | None = None


SPECS = {
    "json_schema (nested, enum, bounds, array, optional)": ("json", Person.model_json_schema()),
    "json_object (any JSON object)": ("json_object", None),
    "regex": ("regex", r"\d{3}-\d{4} [A-Z][a-z]{2,8}"),
    "choice": ("choice", ["positive", "negative", "neutral"]),
}


def example(kind: str, spec) -> str:
    return {"json": json.dumps(Person(name="Ada", age=36, favourite=Color.green,
                           address=Address(street="1 Main St", city="Leeds", zip_code=12345),
                           tags=["x", "y"]).model_dump(mode="json")),
            "json_object": '{"a": [1, 2, {"b": null}], "c": "d"}',
            "regex": "555-1234 Leeds",
            "choice": "neutral"}[kind]


def valid(kind: str, spec, text: str) -> bool:
    try:
        if kind == "json":
            Person.model_validate_json(text)
        elif kind == "json_object":
            return isinstance(json.loads(text), dict)
        elif kind == "regex":
            return re.fullmatch(spec, text) is not None
        elif kind == "choice":
            return text in spec
        return True
    except ValueError:
        return False


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.bitmask = xgr.allocate_token_bitmask(1, VOCAB)

    def compile(self, kind: str, spec):
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(json.dumps(spec), any_whitespace=False)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(spec)
        return c.compile_regex("|".join(re.escape(s) for s in spec))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m) -> torch.Tensor:
        m.fill_next_token_bitmask(self.bitmask)
        return self.bitmask[0]

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def ended(self, m) -> bool:
        return m.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, VOCAB)

    def compile(self, kind: str, spec):
        M = self.ll.LLMatcher
        if kind == "json":
            grammar = M.grammar_from_json_schema(json.dumps(spec), defaults={"whitespace_flexible": False})
        elif kind == "json_object":
            grammar = M.grammar_from_json_schema('{"type": "object"}')
        elif kind == "regex":
            grammar = M.grammar_from_regex(spec)
        else:
            grammar = M.grammar_from_regex("|".join(re.escape(s) for s in spec))
        # llguidance has no compiled-grammar object: building the matcher is the compile step
        return M(self.tok, grammar)

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m) -> torch.Tensor:
        self.ll.torch.fill_next_token_bitmask(m, self.bitmask, 0)
        return self.bitmask[0]

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def ended(self, m) -> bool:
        return m.is_stopped()


def allowed(mask: torch.Tensor) -> torch.Tensor:
    bits = (mask.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:VOCAB].nonzero().flatten()


def measure(lib, tokenizer, eos: int, walks: int) -> dict:
    out = {}
    punctuation = torch.tensor([not any(ch.isalnum() for ch in tokenizer.decode([t])) for t in range(len(tokenizer))]
                               + [False] * (VOCAB - len(tokenizer)))
    for label, (kind, spec) in SPECS.items():
        t0 = time.perf_counter()
        compiled = lib.compile(kind, spec)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        lib.compile(kind, spec)
        again = time.perf_counter() - t0
        tokens = tokenizer(example(kind, spec), add_special_tokens=False).input_ids + [eos]
        m, times, ok = lib.matcher(compiled), [], True
        for token in tokens:
            t0 = time.perf_counter()
            mask = lib.fill(m)
            times.append(time.perf_counter() - t0)
            ok &= bool((mask[token // 32] >> (token % 32)) & 1)
            ok &= lib.accept(m, token)
        good = bad = unfinished = 0
        rng = random.Random(0)
        for _ in range(walks):
            m, walk = lib.matcher(compiled), []
            while len(walk) < MAX_WALK and not lib.ended(m):
                ids = allowed(lib.fill(m))
                marks = ids[punctuation[ids]].tolist()
                ids = ids.tolist()
                token = (eos if eos in ids and rng.random() < 0.5 else
                         rng.choice(marks) if marks and rng.random() < 0.5 else rng.choice(ids))
                if not lib.accept(m, token):
                    raise AssertionError(f"{lib.name} refused a token its own mask allowed")
                walk.append(token)
            if not lib.ended(m):
                unfinished += 1
                continue
            text = tokenizer.decode([t for t in walk if t != eos])
            good, bad = (good + 1, bad) if valid(kind, spec, text) else (good, bad + 1)
        out[label] = dict(cold_ms=1e3 * cold, again_ms=1e3 * again, mask_us=1e6 * statistics.median(times),
                          mask_max_us=1e6 * max(times), reference_ok=ok, valid=good, invalid=bad, unfinished=unfinished)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--walks", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m"))
    eos = tokenizer.eos_token_id
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        lib = cls(tokenizer)
        print(f"\n{cls.name}: tokenizer view {1e3 * (time.perf_counter() - t0):.0f} ms")
        print(f"{'spec':55s} {'cold ms':>8s} {'again ms':>9s} {'mask us':>8s} {'max us':>8s} ref  valid/invalid/unfinished")
        for label, r in measure(lib, tokenizer, eos, args.walks).items():
            print(f"{label:55s} {r['cold_ms']:8.1f} {r['again_ms']:9.2f} {r['mask_us']:8.0f} {r['mask_max_us']:8.0f} "
                  f"{'ok' if r['reference_ok'] else 'NO':4s} {r['valid']}/{r['invalid']}/{r['unfinished']}")


if __name__ == "__main__":
    main()
