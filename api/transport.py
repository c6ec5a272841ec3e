"""Connection-level defences, under ``python server.py`` and ``uvicorn server:app`` alike: what uvicorn runs with,
below the app. No torch.

* ``header_timeout_protocol``: uvicorn's h11 protocol, plus a deadline for a request's head (uvicorn times out idle
  keep-alive connections only after a response; a fresh connection that sends nothing, or trickles headers a byte at
  a time (slowloris), would stay open forever and hold a file descriptor and a ``limit_concurrency`` place), plus
  unambiguous framing: a request head with both Content-Length and Transfer-Encoding, more than one of either, or a
  Transfer-Encoding other than ``chunked`` gets one 400 and the connection is closed, before the app sees it (RFC
  9112 §6.3: behind a proxy that frames by the other header, the rest would be a smuggled request). h11 itself
  frames such a request by chunked and merges repeated equal Content-Lengths.
* ``raise_file_limit``: the soft RLIMIT_NOFILE up to the hard limit (often 1024 vs 1M+).
* ``AcceptErrorLog``: at the file limit, asyncio logs "socket.accept() out of system resource"
  once per refused connection in the backlog, thousands of lines a second: one line per interval.
* ``DrainingServer``: uvicorn whose first SIGTERM/SIGINT also starts the app's drain.
* ``uvicorn_config`` (``python server.py``) and ``defend_uvicorn`` (``uvicorn server:app``: the settings of the
  uvicorn that is importing the app, before it opens a socket) apply the same protocol and limits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import sys
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from api.errors import error_body
from api.ops import Operations
from config import Config

log = logging.getLogger("minibatch.transport")


def framing_problem(data: bytes, max_head_bytes: int = 0) -> str | None:
    """What is wrong with the request head at the start of ``data``: larger than ``max_head_bytes`` (0: no limit), or
    ambiguous to frame; None when nothing is (also while the head is not complete yet: h11 answers what it cannot
    parse). h11's own size limit applies only to a head that arrives in pieces."""
    end = data.find(b"\r\n\r\n")
    if max_head_bytes and (end + 4 if end >= 0 else len(data)) > max_head_bytes:
        return f"the request head is larger than {max_head_bytes} bytes (MAX_HEADER_BYTES)"
    if end < 0:
        return None
    lengths, encodings = [], []
    for line in data[:end].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            lengths.append(value.strip())
        elif name == b"transfer-encoding":
            encodings.append(value.strip().lower())
    if lengths and encodings:
        return "a request may not carry both Content-Length and Transfer-Encoding (RFC 9112 section 6.3)"
    if len(lengths) > 1 or any(b"," in v for v in lengths):
        return "a request carries one Content-Length header, with one value"
    if len(encodings) > 1 or (encodings and encodings[0] != b"chunked"):
        return "Transfer-Encoding must be a single `chunked`"
    return None


def header_timeout_protocol(seconds: float, max_head_bytes: int = 0) -> type[H11Protocol]:
    """An H11Protocol that closes a connection whose request head is not complete ``seconds`` after it opened or
    after its previous response, and refuses a head larger than ``max_head_bytes`` or whose framing is ambiguous
    (``framing_problem``)."""

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_request():
                self._disarm()

        def handle_events(self) -> None:
            # Between requests the next one's head is in h11's buffer (received now, or pipelined behind the last):
            # checked before h11 turns it into a request.
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                problem = framing_problem(self.conn.trailing_data[0], max_head_bytes)
                if problem is not None:
                    self._refuse(problem)
                    return
            super().handle_events()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self._in_request() and not self.transport.is_closing():
                self._arm()  # the next request's head gets the same deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _refuse(self, problem: str) -> None:
            """One 400 in the API's error shape, then the connection closes: nothing after the head is read."""
            log.warning("refused a request with ambiguous framing from %s: %s", _peer(self.client), problem)
            body = json.dumps(error_body(400, problem, "invalid_request_error")).encode()
            head = (
                f"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                "connection: close\r\n\r\n"
            )
            self._disarm()
            self.transport.write(head.encode() + body)
            self.transport.close()

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


def _peer(client) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown peer"


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
    """uvicorn's settings from ours (``python server.py``). The asyncio loop, not uvloop even where it is installed: the
    accept-error handling and the limits above are the ones tested."""
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level.lower(),
        loop="asyncio",
        http=header_timeout_protocol(config.header_timeout_s, config.max_header_bytes),
        limit_concurrency=config.limit_concurrency or None,
        timeout_keep_alive=config.timeout_keep_alive_s,
        h11_max_incomplete_event_size=config.max_header_bytes,
        timeout_graceful_shutdown=config.drain_timeout_s + 5,  # backstop: cancel what the drain could not end
    )


_UVICORN_DEFAULT_KEEP_ALIVE = 5


def loading_uvicorn_config() -> uvicorn.Config | None:
    """The ``uvicorn.Config`` whose ``load()`` is importing the app right now (``uvicorn server:app``), found on the
    call stack; None when the app is imported some other way."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name in ("load", "load_app") and isinstance(owner, uvicorn.Config):
            return owner
        frame = frame.f_back
    return None


def defend_uvicorn(uv: uvicorn.Config, config: Config) -> str:
    """Give the uvicorn that is loading the app (``loading_uvicorn_config``) our protocol and limits before it opens a
    socket: the h11 protocol with the head deadline and the framing checks, whichever it picked (httptools where
    installed, as ray[serve] installs it), and LIMIT_CONCURRENCY, MAX_HEADER_BYTES and TIMEOUT_KEEP_ALIVE_S where its
    command line left uvicorn's defaults. Returns what it did, for the startup log."""
    picked = uv.http if isinstance(uv.http, str) else getattr(uv.http, "__name__", "its protocol")
    # Both: uvicorn's CLI imports the app once before Config.load() (which resolves ``http`` into the class), and
    # the reloader's and the workers' processes import it inside load(), after that.
    if uv.h11_max_incomplete_event_size is None:
        uv.h11_max_incomplete_event_size = config.max_header_bytes
    head_limit = uv.h11_max_incomplete_event_size
    uv.http = uv.http_protocol_class = header_timeout_protocol(config.header_timeout_s, head_limit)
    if uv.limit_concurrency is None:
        uv.limit_concurrency = config.limit_concurrency or None
    if uv.timeout_keep_alive == _UVICORN_DEFAULT_KEEP_ALIVE:
        uv.timeout_keep_alive = config.timeout_keep_alive_s
    return (
        f"h11 with the header timeout and framing checks (for --http {picked}), limit_concurrency "
        f"{uv.limit_concurrency}, h11_max_incomplete_event_size {uv.h11_max_incomplete_event_size}, "
        f"timeout_keep_alive {uv.timeout_keep_alive}"
    )
