"""Connection-level defences for ``python server.py``: what uvicorn runs with, below the app. No torch.

* ``HeaderTimeoutProtocol``: uvicorn's h11 protocol, plus a deadline for a request's head. uvicorn
  times out idle keep-alive connections only after a response; a fresh connection that sends
  nothing, or trickles headers a byte at a time (slowloris), would stay open forever and hold a
  file descriptor and a ``limit_concurrency`` place.
* ``raise_file_limit``: the soft RLIMIT_NOFILE up to the hard limit (often 1024 vs 1M+).
* ``AcceptErrorLog``: at the file limit, asyncio logs "socket.accept() out of system resource"
  once per refused connection in the backlog, thousands of lines a second: one line per interval.
* ``DrainingServer``: uvicorn whose first SIGTERM/SIGINT also starts the app's drain.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from api.ops import Operations
from config import Config

log = logging.getLogger("minibatch.transport")


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """An H11Protocol that closes a connection whose request head is not complete ``seconds`` after
    it opened or after its previous response."""

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_request():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self._in_request() and not self.transport.is_closing():
                self._arm()  # the next request's head gets the same deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(seconds, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self._in_request() and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


def raise_file_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard limit; return (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # e.g. an unlimited hard limit the kernel will not take
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft, hard


class AcceptErrorLog:
    """A loop exception handler that lets one "socket.accept() out of system resource" through per
    ``interval`` seconds, with the number held back since; everything else goes to the default."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self.held_back = 0
        self._last = float("-inf")

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.set_exception_handler(self)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") != self.MESSAGE:
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self._last < self.interval:
            self.held_back += 1
            return
        self._last = now
        exc = context.get("exception")
        log.error(
            "%s (%s): new connections wait in the backlog until descriptors free up; "
            "%d such errors in the last %.0fs not logged",
            self.MESSAGE,
            exc,
            self.held_back,
            self.interval,
        )
        self.held_back = 0


class DrainingServer(uvicorn.Server):
    """uvicorn, plus: the first SIGTERM/SIGINT also starts the app's drain (503 for new requests,
    in-flight ones get DRAIN_TIMEOUT_S, then are aborted). uvicorn itself stops listening and waits
    for open connections before the lifespan's shutdown, so the drain must start here."""

    def __init__(self, config: uvicorn.Config, operations: Operations) -> None:
        super().__init__(config)
        self.operations = operations

    def handle_exit(self, sig, frame) -> None:
        self.operations.request_drain()
        super().handle_exit(sig, frame)


def uvicorn_config(app, config: Config) -> uvicorn.Config:
    """uvicorn's settings from ours. The asyncio loop, not uvloop even where it is installed: the
    accept-error handling and the limits above are the ones tested."""
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level.lower(),
        loop="asyncio",
        http=header_timeout_protocol(config.header_timeout_s),
        limit_concurrency=config.limit_concurrency or None,
        timeout_keep_alive=config.timeout_keep_alive_s,
        h11_max_incomplete_event_size=config.max_header_bytes,
        timeout_graceful_shutdown=config.drain_timeout_s + 5,  # backstop: cancel what the drain could not end
    )
