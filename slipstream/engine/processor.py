"""InputProcessor: what a user sends -> validated token ids and fully resolved SamplingParams.

Owns tokenization, chat-template rendering, the token-id range checks of prompts and of
the parameters that name tokens, and the resolution of max_tokens against the context and
the KV cache. A request that can never run is rejected here, before anything is queued,
and as cheaply as possible: a text is measured in characters before it is tokenized (no
token is longer than the vocabulary's longest, so a text longer than max_model_len of
those cannot fit), a list of token ids by its length before its ids are checked.
Tokenizing is the costly part, so the server calls this from its input thread, never from
the engine thread. Must never know the scheduler, the KV manager or the model.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from slipstream.loader.tokenizer import NO_TOKENIZER
from slipstream.sampling_params import SamplingParams


class ProcessedPrompt(NamedTuple):
    text: str | None  # the prompt as given, if it was a text
    token_ids: list[int]
    params: SamplingParams  # max_tokens resolved


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, num_blocks: int, block_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_blocks, self.block_size = num_blocks, block_size  # the whole KV cache
        # vocabulary strings are at least as long as the text they decode to (byte-level BPE
        # spells each byte as one character); normalizers that delete characters are not modelled
        self.longest_token = max(map(len, tokenizer.get_vocab()), default=1) if tokenizer is not None else 1

    def process(self, prompt: str | list[int], params: SamplingParams) -> ProcessedPrompt:
        text, token_ids = self._tokenize(prompt)
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            self.check_token_ids(list(getattr(params, name) or []), name)
        return ProcessedPrompt(text, token_ids, self._resolve_max_tokens(params, len(token_ids)))

    def check_text_length(self, num_chars: int, what: str = "prompt") -> None:
        """Reject a text that cannot fit in max_model_len tokens, whatever its tokenization."""
        limit = (self.max_model_len - 1) * self.longest_token
        if num_chars > limit:
            raise ValueError(f"{what} has {num_chars} characters; max_model_len is {self.max_model_len} tokens and "
                             f"no token is longer than {self.longest_token} characters, so at most {limit} can fit")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation through the model's chat template (`tools` for templates that take them)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use a plain prompt")
        # Before rendering (a template is Python, ~15 us a message): every message renders to at
        # least one token (its turn markup) and its content's characters. Then the rendered
        # text, markup included, before tokenizing.
        if len(messages) >= self.max_model_len:
            raise ValueError(f"messages: {len(messages)} messages cannot fit in max_model_len ({self.max_model_len}) "
                             "tokens; each takes at least one")
        self.check_text_length(sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)),
                               "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template is code run on the user's messages
            raise ValueError(f"messages could not be rendered with the chat template: {e}") from e
        self.check_text_length(len(text), "messages (rendered with the chat template)")
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def check_token_ids(self, token_ids: list[int], what: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what}: token id(s) {bad[:5]} out of range; allowed: 0..{self.vocab_size - 1}")

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{NO_TOKENIZER}; pass the prompt as a list of token ids")
            self.check_text_length(len(prompt))
            token_ids, text = self.tokenizer(prompt).input_ids, prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids, text = list(prompt), None
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty; it must contain at least one token")
        self._check_prompt_length(len(token_ids))
        self.check_token_ids(token_ids, "prompt")
        return text, token_ids

    def _check_prompt_length(self, prompt_len: int) -> None:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise ValueError(f"prompt has {prompt_len} tokens; max_model_len is {limit}, so at most {limit - 1} fit")

    def _resolve_max_tokens(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        limit, capacity = self.max_model_len, self.num_blocks * self.block_size
        max_tokens = params.max_tokens or min(limit, capacity) - prompt_len  # None: as much as can ever fit
        if prompt_len + max_tokens > limit:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} "
                             f"exceeds max_model_len ({limit})")
        if prompt_len + max_tokens > capacity:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) can never fit in the KV cache "
                             f"({self.num_blocks} blocks = {capacity} tokens); raise kv_cache_memory")
        return params if params.max_tokens == max_tokens else dataclasses.replace(params, max_tokens=max_tokens)
