"""The OpenAI routes' logic: request -> SamplingParams and engine prompts -> response or SSE chunks.

A request is validated and queued in full (every prompt of a list) before the response
starts, so every error is a 4xx with OpenAI's error JSON. The server's limits are checked
first; prompts and chat templates are tokenized on the engine's input thread. Streams turn
cumulative engine outputs into deltas; text that could be the start of a stop string is
held back until it is known not to be one, so the streamed text always equals the final
text. A client that goes away aborts its requests at once.

This module must never touch the engine directly: everything goes through AsyncLLMEngine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from slipstream.engine.async_engine import AsyncLLMEngine, EngineDeadError, OutputStream
from slipstream.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from slipstream.sampling_params import SamplingParams
from slipstream.server import protocol as p
from slipstream.server.errors import APIError, error_body
from slipstream.server.fields import check_fields
from slipstream.server.response_format import renamed, structured_outputs
from slipstream.server.tool_deltas import ToolCallStream
from slipstream.server.tools import ToolPlan, output_constraint, render_history, renders_tools, tool_plan
from slipstream.structured.params import StructuredOutputsParams
from slipstream.server.limits import ServerLimits

Prompt = str | list[int]
MIN_LOGPROB = -9999.0  # JSON has no -inf


class ClientDisconnected(Exception):
    pass


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, limits: ServerLimits):
        self.engine = engine
        self.model_name = model_name
        self.limits = limits
        self.processor = engine.processor
        self.tokenizer = self.processor.tokenizer
        self.max_model_len = self.processor.max_model_len

    # --- /v1/completions ---------------------------------------------------------------
    async def completion(self, req: p.CompletionRequest, raw: Request) -> Response:
        self._check_request(req)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = _completion_prompts(req.prompt)
        _checked(self.limits.check_prompts, len(prompts))
        echo_logprobs = req.logprobs if req.echo else None
        scoring = bool(req.echo) and 0 in (req.max_tokens, req.max_completion_tokens)
        if scoring:  # score the prompt only (vLLM's echo with max_tokens=0): sample one token, send none
            req = req.model_copy(update={"max_tokens": 1, "max_completion_tokens": None})
        structured, field = structured_outputs(req)
        params = self._params(req, default_max_tokens=16, logprobs=req.logprobs, prompt_logprobs=echo_logprobs,
                              structured=structured)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream, ids = await self._start(request_id, prompts, params, req.cache_salt, field)
        if req.stream:
            events = self._completion_events(request_id, stream, ids, req, params, scoring)
            return _sse(stream, events, _include_usage(req))
        finals = await _collect(stream, raw)
        if scoring:
            finals = {r: _prompt_only(out) for r, out in finals.items()}
        choices = []
        for i, request in enumerate(ids):
            out = finals[request]
            for o in out.outputs:
                choice = _ChoiceStream()
                choices.append(self._completion_choice(i * params.n + o.index, out, o, choice, req, choice.advance(o)))
        return _json(p.CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                          usage=_usage(finals.values())))

    async def _completion_events(self, request_id: str, stream: OutputStream, ids: list[str],
                                 req: p.CompletionRequest, params: SamplingParams,
                                 scoring: bool = False) -> AsyncIterator[BaseModel]:
        created, index = int(time.time()), {r: i for i, r in enumerate(ids)}
        choices: dict[tuple[int, int], _ChoiceStream] = {}
        finals: dict[str, RequestOutput] = {}
        async for out in stream:
            out = _prompt_only(out) if scoring else out
            i = index[out.request_id]
            for o in out.outputs:
                choice = choices.setdefault((i, o.index), _ChoiceStream(holdback=_holdback(params)))
                delta = choice.advance(o)
                if delta is not None:
                    c = self._completion_choice(i * params.n + o.index, out, o, choice, req, delta)
                    yield p.CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[c])
            if out.finished:
                finals[out.request_id] = out
        if _include_usage(req):
            yield p.CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                       usage=_usage(finals.values()))

    def _completion_choice(self, index: int, out: RequestOutput, o: CompletionOutput, choice: _ChoiceStream,
                           req: p.CompletionRequest, delta: tuple[str, int, int]) -> p.CompletionChoice:
        """One choice (or a chunk of it); `delta` = (text, first token, end token) from choice.advance."""
        text, start, end = delta
        logprobs = p.CompletionLogprobs() if req.logprobs is not None else None
        if req.echo and not choice.echoed:
            choice.echoed = True
            prompt_text = self._prompt_text(out)
            text = prompt_text + text
            if logprobs is not None:
                choice.text_offset = self._add_completion_logprobs(
                    logprobs, out.prompt_token_ids, out.prompt_logprobs or [None] * len(out.prompt_token_ids),
                    req.logprobs, choice.text_offset)
        if logprobs is not None:
            choice.text_offset = self._add_completion_logprobs(
                logprobs, o.token_ids[start:end], (o.logprobs or [])[start:end], req.logprobs, choice.text_offset)
        finish = o.finish_reason if choice.finished else None
        return p.CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)

    def _add_completion_logprobs(self, into: p.CompletionLogprobs, token_ids: list[int],
                                 logprobs: list[TokenLogprobs | None], num_top: int, offset: int) -> int:
        for token_id, entries in zip(token_ids, logprobs):
            token = self._token(token_id, entries)
            into.tokens.append(token)
            into.text_offset.append(offset)
            offset += len(token)
            if entries is None:  # the first prompt token has no logprob
                into.token_logprobs.append(None)
                into.top_logprobs.append(None)
                continue
            into.token_logprobs.append(_clamp(entries[token_id].logprob))
            top = [(t, lp) for t, lp in entries.items() if lp.rank <= num_top or t == token_id]
            into.top_logprobs.append({self._token(t, entries): _clamp(lp.logprob) for t, lp in top})
        return offset

    # --- /v1/chat/completions ----------------------------------------------------------
    async def chat(self, req: p.ChatCompletionRequest, raw: Request) -> Response:
        self._check_request(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        plan = tool_plan(req, getattr(self.tokenizer, "chat_template", None))
        structured, field = output_constraint(req, plan)
        params = self._params(req, default_max_tokens=None, logprobs=num_logprobs, structured=structured)
        prompt = await self.chat_prompt(req.messages, req.add_generation_prompt is not False, plan)
        if params.max_tokens is None:
            params = self._with_max_tokens(params, self._room_after(prompt))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream, ids = await self._start(request_id, [prompt], params, req.cache_salt, field)
        if req.stream:
            return _sse(stream, self._chat_events(request_id, stream, req, params, plan), _include_usage(req))
        out = (await _collect(stream, raw))[ids[0]]
        choices = [p.ChatChoice(index=o.index, logprobs=self._chat_logprobs(o.token_ids, o.logprobs, num_logprobs),
                                **_reply(o.text, o.finish_reason, plan)) for o in out.outputs]
        return _json(p.ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                              usage=_usage([out])))

    async def _chat_events(self, request_id: str, stream: OutputStream, req: p.ChatCompletionRequest,
                           params: SamplingParams, plan: ToolPlan | None) -> AsyncIterator[BaseModel]:
        created = int(time.time())

        def chunk(choices, usage=None):
            return p.ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices,
                                         usage=usage)

        for i in range(params.n):
            yield chunk([p.ChatStreamChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))])
        choices = [_ChoiceStream(holdback=_holdback(params)) for _ in range(params.n)]
        calls = [ToolCallStream(plan) if plan is not None else None for _ in range(params.n)]
        final = None
        async for out in stream:
            for o in out.outputs:
                choice = choices[o.index]
                delta = choice.advance(o)
                if delta is None:
                    continue
                text, start, end = delta
                logprobs = self._chat_logprobs(o.token_ids[start:end], (o.logprobs or [])[start:end], params.logprobs)
                finish = o.finish_reason if choice.finished else None
                if calls[o.index] is None:
                    yield chunk([p.ChatStreamChoice(index=o.index, delta=p.DeltaMessage(content=text),
                                                    logprobs=logprobs, finish_reason=finish)])
                    continue
                content, tool_deltas = calls[o.index].feed(text, choice.finished)
                for tool_delta in tool_deltas:
                    yield chunk([p.ChatStreamChoice(index=o.index, delta=p.DeltaMessage(tool_calls=[tool_delta]))])
                if content or logprobs or finish:
                    finish = "tool_calls" if calls[o.index].calls and finish == "stop" else finish
                    yield chunk([p.ChatStreamChoice(index=o.index, delta=p.DeltaMessage(content=content or None),
                                                    logprobs=logprobs, finish_reason=finish)])
            final = out
        if _include_usage(req):
            yield chunk([], _usage([final]))

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
                       num_top: int | None) -> p.ChatLogprobs | None:
        if num_top is None or logprobs is None:
            return None
        content = []
        for token_id, entries in zip(token_ids, logprobs):
            top = sorted(((t, lp) for t, lp in entries.items() if lp.rank <= num_top), key=lambda e: e[1].rank)
            content.append(p.ChatTokenLogprob(
                **self._top_logprob(token_id, entries[token_id]),
                top_logprobs=[p.TopLogprob(**self._top_logprob(t, lp)) for t, lp in top[:num_top]]))
        return p.ChatLogprobs(content=content)

    def _top_logprob(self, token_id: int, lp: Logprob) -> dict:
        token = self._token(token_id, {token_id: lp})
        return {"token": token, "logprob": _clamp(lp.logprob), "bytes": list(token.encode("utf-8", "replace"))}

    async def chat_prompt(self, messages: list[p.ChatMessage], add_generation_prompt: bool,
                          plan: ToolPlan | None = None) -> list[int]:
        """Token ids of a conversation, rendered exactly as LLM.chat renders it (with tools: server/tools.py)."""
        if not messages:
            raise APIError(400, "messages is empty; it must contain at least one message", param="messages")
        native = renders_tools(getattr(self.tokenizer, "chat_template", None))
        rendered = render_history([_message(i, m) for i, m in enumerate(messages)], plan, native)
        try:
            return await self.engine.run_input(self.processor.render_chat, rendered, add_generation_prompt,
                                               plan.template_tools() if plan is not None else None)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

    # --- /tokenize, /detokenize, /v1/models --------------------------------------------
    async def tokenize(self, req: p.TokenizeRequest) -> dict:
        check_fields(req)
        self._check_model(req.model)
        self._require_tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "pass exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            tokens = await self.chat_prompt(req.messages, req.add_generation_prompt is not False)
        else:
            tokens = await self.engine.run_input(self._tokenize, req.prompt, req.add_special_tokens is not False)
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}

    async def detokenize(self, req: p.DetokenizeRequest) -> dict:
        check_fields(req)
        self._check_model(req.model)
        self._require_tokenizer()
        return {"prompt": await self.engine.run_input(self._detokenize, req.tokens)}

    def models(self) -> p.ModelList:
        card = p.ModelCard(id=self.model_name, root=self.engine.engine.config.model, max_model_len=self.max_model_len)
        return p.ModelList(data=[card])

    def _detokenize(self, token_ids: list[int]) -> str:
        self._check_token_ids(token_ids, "tokens")
        return self.tokenizer.decode(token_ids)

    def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            self.processor.check_text_length(len(text))
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    # --- shared ------------------------------------------------------------------------
    def _check_request(self, req: p.SamplingFields) -> None:
        """What every generation request must satisfy before any of it is processed."""
        check_fields(req)
        self._check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        _checked(self.limits.check_stop, req.stop)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(400, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _room_after(self, prompt: list[int]) -> int:
        """Chat's default max_tokens: whatever fits after the prompt, in the context and in the KV cache."""
        stats = self.engine.stats()
        return max(1, min(self.max_model_len, stats["num_blocks"] * stats["block_size"]) - len(prompt))

    @staticmethod
    def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
        try:
            return dataclasses.replace(params, max_tokens=max_tokens)
        except ValueError as e:
            raise APIError.bad_request(e) from None

    def _check_token_ids(self, token_ids: list[int], param: str) -> None:
        try:
            self.processor.check_token_ids(token_ids, param)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise APIError(400, f"model {self.model_name!r} has no tokenizer; only token-id prompts work")
        return self.tokenizer

    def _params(self, req: p.SamplingFields, default_max_tokens: int | None, logprobs: int | None,
                prompt_logprobs: int | None = None,
                structured: StructuredOutputsParams | None = None) -> SamplingParams:
        max_tokens = next((v for v in (req.max_completion_tokens, req.max_tokens) if v is not None), default_max_tokens)
        optional = dict(n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                        repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens, seed=req.seed,
                        stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                        logit_bias=_token_keys(req.logit_bias), allowed_token_ids=req.allowed_token_ids,
                        skip_special_tokens=req.skip_special_tokens,
                        include_stop_str_in_output=req.include_stop_str_in_output)
        kwargs = {k: v for k, v in optional.items() if v is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                  structured_outputs=structured, **kwargs)
        except ValueError as e:
            raise APIError.bad_request(e) from None

    async def _start(self, request_id: str, prompts: list[Prompt], params: SamplingParams, cache_salt: str | None,
                     structured_field: str | None = None) -> tuple[OutputStream, list[str]]:
        """Queue every prompt, or none: an invalid one aborts those already queued.

        The engine judges grammars; its complaint names `structured_field`, the field the client set.
        """
        arrival = time.monotonic()
        stream = self.engine.open_stream()
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        try:
            for engine_id, prompt in zip(ids, prompts):
                await self.engine.add_request(engine_id, prompt, params, arrival, cache_salt, stream)
        except ValueError as e:
            stream.close()
            raise renamed(e, structured_field) or APIError.bad_request(e, default_param="prompt") from None
        except BaseException:
            stream.close()
            raise
        return stream, ids

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

    def _token(self, token_id: int, entries: TokenLogprobs | None) -> str:
        entry = entries.get(token_id) if entries else None
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        if self.tokenizer is not None:
            return self.tokenizer.decode([token_id])
        return f"token_id:{token_id}"


@dataclass
class _ChoiceStream:
    """What of one choice has been sent; text that may begin a stop string is held back."""

    sent_text: int = 0
    sent_tokens: int = 0
    finished: bool = False
    holdback: int = 0
    echoed: bool = False
    text_offset: int = 0

    def advance(self, o: CompletionOutput) -> tuple[str, int, int] | None:
        """(new text, first new token, end token) since the last call; None if nothing to send."""
        if self.finished:
            return None
        done = o.finish_reason is not None
        end = len(o.text) if done else max(self.sent_text, len(o.text) - self.holdback)
        text, start = o.text[self.sent_text:end], self.sent_tokens
        self.sent_text, self.sent_tokens, self.finished = end, len(o.token_ids), done
        if not text and start == self.sent_tokens and not done:
            return None
        return text, start, self.sent_tokens


def _checked(check, *args) -> None:
    """Run a check whose ValueError names the field first; as a 400."""
    try:
        check(*args)
    except ValueError as e:
        raise APIError.bad_request(e) from None


def _reply(text: str, finish_reason: str | None, plan: ToolPlan | None) -> dict:
    """A chat choice's message and finish_reason: tool calls where the reply parses as calls."""
    calls = plan.parse(text) if plan is not None else None
    if calls is None:
        return {"message": p.ChatResponseMessage(content=text), "finish_reason": finish_reason}
    return {"message": p.ChatResponseMessage(content=None, tool_calls=calls),
            "finish_reason": "tool_calls" if finish_reason == "stop" else finish_reason}


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """`out` without its sampled token: echo with max_tokens=0 scores the prompt and generates nothing."""
    empty = [dataclasses.replace(o, text="", token_ids=[], cumulative_logprob=None,
                                 logprobs=[] if o.logprobs is not None else None) for o in out.outputs]
    return dataclasses.replace(out, outputs=empty)


def _holdback(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop_list), default=1) - 1


def _completion_prompts(prompt) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty; pass a string, a list of strings, token ids or lists of token ids",
                       param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _message(index: int, m: p.ChatMessage) -> dict:
    content = m.content
    if isinstance(content, list):
        for part in content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"messages.{index}.content: parts of type {part.type!r} are not supported; "
                                    "only {'type': 'text', 'text': ...}", param="messages")
        content = "".join(part.text for part in content)
    message = {"role": m.role, "content": content or ""}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _token_keys(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends logit_bias keys as strings of token ids."""
    if logit_bias is None:
        return None
    try:
        return {int(k): v for k, v in logit_bias.items()}
    except ValueError:
        raise APIError(400, f"logit_bias keys must be token ids, got {sorted(logit_bias)[:5]}",
                       param="logit_bias") from None


def _usage(outputs) -> p.UsageInfo:
    outputs = [o for o in outputs if o is not None]
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return p.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _include_usage(req: p.SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _clamp(logprob: float) -> float:
    return MIN_LOGPROB if math.isnan(logprob) else max(logprob, MIN_LOGPROB)


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


# --- running requests ------------------------------------------------------------------
async def _collect(stream: OutputStream, raw: Request) -> dict[str, RequestOutput]:
    """Final outputs by engine request id; aborts everything if the client goes away first."""
    async def final_outputs():
        return {out.request_id: out async for out in stream if out.finished}

    try:
        return await _unless_disconnected(raw, final_outputs())
    finally:
        stream.close()


async def _unless_disconnected(raw: Request, work):
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientDisconnected()


async def _wait_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _sse(stream: OutputStream, events: AsyncIterator[BaseModel], include_usage: bool) -> StreamingResponse:
    """Server-sent events; `usage` appears in chunks only when the client asked for it."""
    exclude = None if include_usage else {"usage"}

    async def body():
        try:
            async for event in events:
                yield f"data: {event.model_dump_json(exclude=exclude)}\n\n"
        except EngineDeadError as e:
            yield f"data: {json.dumps(error_body(503, str(e)))}\n\n"
        finally:
            stream.close()
        yield "data: [DONE]\n\n"

    # The background task runs even when the client disconnects before the body is done.
    return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(stream.close))

