"""LLM: the offline Python API (vLLM's shape) on top of LLMEngine."""
from __future__ import annotations

import itertools
import time

from tqdm import tqdm

from slipstream.config import EngineConfig
from slipstream.engine.engine import LLMEngine
from slipstream.outputs import RequestOutput
from slipstream.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = "smollm2-135m", **kwargs):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict:
        return self.engine.stats()

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(str(next(self._ids)))
                self.engine.add_request(ids[-1], prompt, p)
        except Exception:
            for request_id in ids:  # leave the engine as it was
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.processor.render_chat(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, num_tokens = time.monotonic(), 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    num_tokens += sum(len(o.token_ids) for o in out.outputs)
                    bar.update(1)
                    bar.set_postfix_str(f"output {num_tokens / (time.monotonic() - start):.1f} tok/s")
        bar.close()
        return [finished[i] for i in ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those")
    return list(prompts)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts; pass one, or one per prompt")
    return list(params)
