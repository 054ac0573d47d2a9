"""AsyncLLMEngine: an asyncio front over the synchronous LLMEngine, for the server.

The engine is not thread-safe, so exactly one thread, the engine thread started here,
ever calls it. Coroutines hand it work through a command queue (add, abort) and read
cumulative RequestOutputs back on their own event loop through an OutputStream. Owning
the engine from one thread is the lock: a mutex taken by request handlers would be
starved by the step loop, which re-takes it as soon as it lets go. Commands run between
steps, so an abort takes effect before the next step and frees the request's KV blocks.

Input processing (tokenizing, chat templates) runs on one input thread of its own, never
on the engine thread, whose every pause stalls all running requests, nor on the event
loop, which carries every stream: the engine thread only queues token ids. One thread, as
vLLM's server has, because a tokenizer is not safe to call from several at once.

This module must never block the event loop, and one request's bad input must never stop
the others: add_request validates on the input thread, and its error goes back to the caller.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import AsyncIterator, Callable, TypeVar

from slipstream.engine.engine import LLMEngine
from slipstream.outputs import RequestOutput
from slipstream.sampling_params import SamplingParams

logger = logging.getLogger("slipstream")

# A command for the engine thread, and the future its caller waits on (if any).
_Command = tuple[Callable[[], None], "concurrent.futures.Future | None"]
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or crashed); no request can run."""


class OutputStream:
    """Outputs of one or more engine requests, fed by the engine thread, read on an event loop.

    Iterating yields the newest cumulative RequestOutput of each request that progressed
    (a slow reader skips intermediate snapshots, never the final one) until every request
    added to the stream has finished. close() aborts the ones that have not.
    """

    def __init__(self, engine: "AsyncLLMEngine", loop: asyncio.AbstractEventLoop):
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.unfinished: set[str] = set()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self.unfinished:
            for out in await self._next_batch():
                if out.finished:
                    self.unfinished.discard(out.request_id)
                yield out

    async def _next_batch(self) -> list[RequestOutput]:
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        latest: dict[str, RequestOutput] = {}
        for item in items:
            if isinstance(item, BaseException):
                raise item
            latest.pop(item.request_id, None)  # re-insert: keep the order of the newest snapshots
            latest[item.request_id] = item
        return list(latest.values())

    def close(self) -> None:
        """Abort every request of this stream that has not finished (idempotent)."""
        for request_id in list(self.unfinished):
            self._engine.abort(request_id)
        self.unfinished.clear()


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, on_output: Callable[[RequestOutput], None] | None = None):
        self.engine = engine
        self.on_output = on_output  # called on the engine thread for every output (metrics)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._submit_lock = threading.Lock()  # orders "is it alive?" + submit against death
        self._streams: dict[str, OutputStream] = {}  # engine thread only
        self._stats = engine.stats()
        self._dead: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="slipstream-engine", daemon=True)
        self._inputs = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipstream-input")

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 30.0, reason: str = "the server is shutting down") -> None:
        """Stop the engine thread after its current step; pending requests get EngineDeadError(reason)."""
        self._stopping = True
        self._wakeup.set()
        self._inputs.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():  # else the thread is still inside a step that talks to the ranks
            self.engine.shutdown()
        self._die(EngineDeadError(reason))

    @property
    def processor(self):
        """The engine's InputProcessor (tokenizer, chat template, token-id checks); tokenize through run_input."""
        return self.engine.processor

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    # --- what coroutines call ----------------------------------------------------------
    def open_stream(self) -> OutputStream:
        """A stream for the outputs of one or more requests, read on the running event loop."""
        return OutputStream(self, asyncio.get_running_loop())

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          arrival_time: float | None = None, cache_salt: str | None = None,
                          stream: OutputStream | None = None) -> OutputStream:
        """Queue a request; raises the processor's or engine's ValueError if it is invalid or can never fit."""
        processed = await self.run_input(self.processor.process, prompt, params)
        stream = stream or self.open_stream()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(lambda: self._add(request_id, processed, arrival_time, cache_salt, stream, done), done)
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add, so it undoes it if the add went through
            raise
        stream.unfinished.add(request_id)
        return stream

    async def run_input(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the input thread: tokenizing and chat templates never block the engine or the event loop."""
        self._check_running()
        try:
            future = self._inputs.submit(fn, *args)
        except RuntimeError:  # the pool was shut down in between
            raise EngineDeadError("the engine is not running: shutting down") from None
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.cancelled() and not asyncio.current_task().cancelling():  # shutdown dropped it, not the caller
                raise EngineDeadError("the engine is not running: shutting down") from None
            raise

    def abort(self, request_id: str) -> None:
        """Abort a request before the next step; safe from any thread, a no-op once finished."""
        try:
            self._submit(lambda: self._abort(request_id))
        except EngineDeadError:
            pass

    def stats(self) -> dict:
        """engine.stats() as of the end of the engine thread's latest iteration."""
        return self._stats

    def _submit(self, command: Callable[[], None], done: concurrent.futures.Future | None = None) -> None:
        with self._submit_lock:
            self._check_running()
            self._commands.put((command, done))
        self._wakeup.set()

    def _check_running(self) -> None:
        if self._dead is not None or self._stopping:
            raise EngineDeadError(f"the engine is not running: {self._dead or 'shutting down'}")

    # --- the engine thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wakeup.clear()
                self._run_commands()
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                self._stats = self.engine.stats()  # before dispatch: a client that got a token sees it counted
                self._dispatch(outputs)
                if not self.engine.has_unfinished_requests() and self._commands.empty():
                    self._wakeup.wait()
        except BaseException as e:  # noqa: BLE001 - every waiting request must hear about it
            logger.exception("the engine thread stopped on an error")
            self._die(EngineDeadError(f"the engine stopped on an error: {e!r}"))

    def _run_commands(self) -> None:
        while True:
            try:
                command, _ = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _add(self, request_id, processed, arrival_time, cache_salt, stream, done) -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            self.engine.add_processed(request_id, processed, arrival_time=arrival_time, cache_salt=cache_salt)
        except Exception as e:  # noqa: BLE001 - the request's own error; the engine is unchanged
            done.set_exception(e)
            return
        self._streams[request_id] = stream
        done.set_result(None)

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort_request(request_id)
        if output is not None:
            self._dispatch([output])

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if self.on_output is not None:
                self.on_output(out)
            stream = self._streams.pop(out.request_id) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _die(self, error: EngineDeadError) -> None:
        with self._submit_lock:
            self._dead = self._dead or error
            commands = []
            while not self._commands.empty():
                commands.append(self._commands.get_nowait())
        streams = set(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream.put(error)
        for _, done in commands:  # adds that will never run
            if done is not None and done.set_running_or_notify_cancel():
                done.set_exception(error)
