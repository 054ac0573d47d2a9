"""Structured outputs: constrain a sequence's tokens to a JSON schema, a regex, a choice or a grammar.

params.py is what a request asks for (no library), grammars.py validates and compiles it
with xgrammar off the engine thread (cached per distinct spec), bitmask.py follows each
sequence's accepted tokens and masks its logits every step.
"""
from slipstream.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
