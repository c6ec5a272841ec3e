"""Operations around the API: auth, request limits, readiness and graceful drain. No torch.

``OpsMiddleware`` is pure ASGI (not ``BaseHTTPMiddleware``, which buffers streams and hides
client disconnects). For every HTTP request, in this order:

1. ``API_KEY`` set and the path is not open (``/health``, ``/ready``, ``/metrics``):
   ``Authorization: Bearer <key>`` compared with ``hmac.compare_digest``, else 401;
2. draining for shutdown: 503 (open paths still answer);
3. more than ``MAX_CONCURRENT_REQUESTS`` requests in flight (open paths not counted): 429;
4. body larger than ``MAX_BODY_BYTES``, from Content-Length or while it streams in (chunked): 413.
   The body is read here, bounded, and handed to the app whole; after it, ``receive`` is the
   server's again, so the app still sees the client disconnect.

Errors use the API's body (``http_common.error_body``). ``Ops`` also owns the drain: on SIGTERM
(``server.main`` forwards it) new requests get 503 and ``/ready`` 503 at once; in-flight requests
get ``DRAIN_TIMEOUT_S`` to finish, then whatever is left is aborted with "server is shutting down".
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Awaitable, Callable

from config import Config
from http_common import APIError, ServerState, error_body
from metrics import ServerMetrics, logfmt

log = logging.getLogger("minibatch.ops")

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


class Ops:
    """Per-app operational state: config (once known), metrics, requests in flight, drain."""

    def __init__(self, config: Config | None, get_state: Callable[[], ServerState | None]) -> None:
        self.config = config
        self.get_state = get_state
        self.in_flight = 0  # HTTP requests past the checks and not yet answered (open paths excluded)
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self.metrics = ServerMetrics(self.live)

    # --- readiness -------------------------------------------------------------------------------
    def readiness(self) -> str:
        """``ready``, ``loading`` (model not loaded), ``draining``, or ``dead`` (the engine loop stopped)."""
        st = self.get_state()
        if st is None:
            return "loading"
        if self.draining:
            return "draining"
        if not st.scheduler.alive:
            return "dead"
        return "ready"

    def live(self) -> dict[str, float]:
        st = self.get_state()
        values: dict[str, float] = {
            "num_requests_in_flight": self.in_flight,
            "ready": float(self.readiness() == "ready"),
            "draining": float(self.draining),
        }
        if st is not None:
            capacity = st.engine.capacity
            values.update(
                num_requests_running=len(st.scheduler.running),
                num_requests_waiting=len(st.scheduler.waiting),
                kv_cache_usage_perc=st.engine.num_active() / capacity if capacity else 0.0,
                batch_capacity=capacity,
                failed_admits=st.scheduler.failed_admits,
                failed_steps=st.scheduler.failed_steps,
            )
        return values

    # --- drain -----------------------------------------------------------------------------------
    def request_drain(self) -> None:
        """Start draining; safe to call from a signal handler or another thread."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.begin_drain)

    def begin_drain(self) -> None:
        """On the event loop: refuse new requests from now on; abort leftovers after DRAIN_TIMEOUT_S."""
        if self.draining:
            return
        self.draining = True
        st = self.get_state()
        timeout = self.config.drain_timeout_s if self.config is not None else 0.0
        log.info("%s", logfmt("drain_started", in_flight=self.in_flight,
                              unfinished=st.scheduler.num_unfinished if st else 0, timeout_s=timeout))
        if st is not None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain(st, timeout), name="drain")

    async def _drain(self, st: ServerState, timeout: float) -> None:
        start = time.perf_counter()
        deadline = start + timeout
        drained_logged = False
        while time.perf_counter() < deadline:  # a watchdog until the lifespan's shutdown cancels it
            if st.scheduler.num_unfinished == 0 and not drained_logged:
                log.info("%s", logfmt("drain_idle", after_s=round(time.perf_counter() - start, 3)))
                drained_logged = True
            elif st.scheduler.num_unfinished:
                drained_logged = False
            await asyncio.sleep(0.05)
        left = st.scheduler.num_unfinished
        if left:
            log.warning("%s", logfmt("drain_timeout", aborting=left, timeout_s=timeout))
            await st.scheduler.stop()  # resolves every one as aborted: "server is shutting down"

    async def finish_drain(self) -> None:
        """The lifespan's shutdown: stop the watchdog (the caller stops the scheduler, aborting leftovers)."""
        self.draining = True
        if self._drain_task is not None:
            self._drain_task.cancel()
            try:
                await self._drain_task
            except asyncio.CancelledError:
                pass
            self._drain_task = None


def check_prompt_chars(st: ServerState, text: str) -> str:
    """MAX_PROMPT_CHARS, checked before tokenizing (a huge prompt must not cost a tokenizer pass)."""
    limit = st.config.max_prompt_chars
    if limit and len(text) > limit:
        err = APIError(422, f"prompt is {len(text)} characters; the limit is {limit} (MAX_PROMPT_CHARS)", param="prompt")
        err.reject_reason = "too_large"  # type: ignore[attr-defined]
        raise err
    return text


Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class OpsMiddleware:
    def __init__(self, app, ops: Ops) -> None:
        self.app = app
        self.ops = ops

    async def __call__(self, scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ops, cfg = self.ops, self.ops.config
        open_path = scope["path"] in OPEN_PATHS
        headers = _headers(scope)
        if cfg is not None and cfg.api_key and not open_path and not _authorized(headers.get(b"authorization"), cfg.api_key):
            await self._reject(send, 401, "missing or invalid API key (send Authorization: Bearer <key>)",
                               "authentication_error", "auth", extra=[(b"www-authenticate", b"Bearer")])
            return
        if ops.draining and not open_path:
            await self._reject(send, 503, "server is shutting down", "unavailable", "draining",
                               extra=[(b"retry-after", b"1")])
            return
        limit = cfg.max_concurrent_requests if cfg is not None else 0
        if limit and not open_path and ops.in_flight >= limit:
            await self._reject(send, 429, f"too many requests in flight ({limit}, MAX_CONCURRENT_REQUESTS); retry later",
                               "rate_limit_error", "too_many_connections", extra=[(b"retry-after", b"1")])
            return
        if not open_path:
            ops.in_flight += 1
        try:
            max_body = cfg.max_body_bytes if cfg is not None else None
            if max_body is not None and (b"content-length" in headers or b"transfer-encoding" in headers):
                declared = headers.get(b"content-length")
                if declared is not None:
                    try:
                        size = int(declared)
                    except ValueError:
                        await self._reject(send, 400, "invalid Content-Length header", "invalid_request_error", "validation")
                        return
                    if size > max_body:
                        await self._too_large(send, max_body)
                        return
                body = await _read_body(receive, max_body)
                if body is None:  # the client left mid-body
                    return
                if body is _TOO_LARGE:
                    await self._too_large(send, max_body)
                    return
                receive = _replay(body, receive)
            await self.app(scope, receive, send)
        finally:
            if not open_path:
                ops.in_flight -= 1

    async def _too_large(self, send: Send, limit: int) -> None:
        await self._reject(send, 413, f"request body is larger than {limit} bytes (MAX_BODY_BYTES)",
                           "invalid_request_error", "too_large")

    async def _reject(self, send: Send, status: int, message: str, kind: str, reason: str,
                      extra: list[tuple[bytes, bytes]] | None = None) -> None:
        self.ops.metrics.rejected(reason)
        log.info("%s", logfmt("request_rejected", status=status, reason=reason))
        await send_error(send, status, message, kind, extra)


async def send_error(send: Send, status: int, message: str, kind: str,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(status, message, kind)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _headers(scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers", ())}


def _authorized(header: bytes | None, key: str) -> bool:
    if header is None:
        return False
    scheme, _, token = header.partition(b" ")
    # compare_digest on bytes of both: constant time in the token's content.
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode("utf-8"))


_TOO_LARGE = object()


async def _read_body(receive: Receive, limit: int):
    """The whole body, or ``_TOO_LARGE`` once it passes ``limit`` bytes, or None if the client left."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return _TOO_LARGE
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
