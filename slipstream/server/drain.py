"""Graceful drain on SIGTERM / SIGINT: refuse what is new, finish what runs, end the rest cleanly.

On the first signal the server keeps listening but answers each new request with a 503
(/health too, so a load balancer takes it out of rotation; /metrics still answers), and the
requests in flight run on for up to `--shutdown-timeout` seconds. Those still running then
are ended by stopping the engine: a stream gets an error event and `data: [DONE]`, a
non-streamed request a 503. Only when every response is complete is uvicorn told to exit:
it closes the listener and the idle connections, the app's lifespan stops the engine
thread, and the process exits 0. A second signal cuts the wait short (the rest are ended
at once), a third exits without waiting for anything.

uvicorn's own graceful shutdown, which this replaces, closes the listener and then cancels
the connections still open after its timeout while the engine runs on, so a client saw its
stream cut mid-chunk, with no error event and no [DONE].

Must never know routes or the OpenAI protocol: it counts HTTP requests and asks its
caller to end those left.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import uvicorn

from slipstream.server.errors import APIError

logger = logging.getLogger("slipstream")

ALWAYS_SERVED = {"/metrics"}  # monitoring watches the drain
END_GRACE_S = 5.0  # for ended requests to send their error event and [DONE]
POLL_S = 0.05


def check_shutdown_timeout(seconds: float) -> None:
    if not seconds >= 0:  # NaN too
        raise ValueError(f"--shutdown-timeout {seconds!r} is invalid; it must be a number of seconds >= 0")


class Drain:
    """Requests in flight, and whether new ones are refused."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0
        self.hurry = False  # a second signal: stop waiting

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight (True), or until `timeout` or a hurry (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.in_flight and not self.hurry and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        return not self.in_flight


class DrainMiddleware:
    """Counts HTTP requests until their response is complete; 503 for new ones while draining."""

    def __init__(self, app, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain.draining and scope["path"] not in ALWAYS_SERVED:
            response = APIError(503, "the server is shutting down; send the request to another instance",
                                code="shutting_down").response(headers={"Connection": "close"})
            return await response(scope, receive, send)
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM / SIGINT drains first (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, end_requests: Callable[[str], Awaitable[None]],
                 shutdown_timeout: float):
        super().__init__(config)
        self.drain = drain
        self.end_requests = end_requests  # ends every request still running, with this reason
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._task: asyncio.Task | None = None  # keeps the drain alive until it is done

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # Runs as a Python signal handler on the loop's thread; not recorded in
        # _captured_signals, so uvicorn does not re-raise the signal after a clean exit.
        self._signals += 1
        if self._loop is None or self._signals >= 3:  # not started yet, or asked three times
            self.should_exit = self.force_exit = True
        elif self._signals == 1:
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            self.drain.hurry = True

    def _start_drain(self) -> None:
        self._task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        drain = self.drain
        drain.draining = True
        logger.info("shutting down: %d request(s) in flight get up to %.1f s to finish", drain.in_flight,
                    self.shutdown_timeout)
        try:
            if not await drain.wait_idle(self.shutdown_timeout):
                logger.warning("ending %d request(s) still running after the drain", drain.in_flight)
                await self.end_requests(f"the server is shutting down; the request did not finish within "
                                        f"the shutdown timeout ({self.shutdown_timeout:g} s)")
                drain.hurry = False
                await drain.wait_idle(END_GRACE_S)
        finally:
            self.should_exit = True


def serve(app, host: str, port: int, log_level: str, shutdown_timeout: float) -> None:
    """Run `app` (built by build_app) until a signal, then drain it."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=END_GRACE_S)
    DrainingServer(config, app.state.drain, app.state.end_requests, shutdown_timeout).run()
