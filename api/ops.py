"""Operations around the API: auth, request limits, readiness and graceful drain. No torch.

``OperationsMiddleware`` is pure ASGI (not ``BaseHTTPMiddleware``, which buffers streams and hides
client disconnects). For every HTTP request, in this order:

1. ``API_KEY`` set and the path is not open (``/health``, ``/ready``, ``/metrics``):
   ``Authorization: Bearer <key>`` compared with ``hmac.compare_digest``, else 401;
2. draining for shutdown: 503 (open paths still answer);
3. the body: larger than ``MAX_BODY_BYTES``, from Content-Length or while it streams in (chunked):
   413; not complete within ``BODY_TIMEOUT_S``: 408; not UTF-8: 422; SIGTERM while it trickles
   in: 503. It is read here, bounded, and handed to the app whole; after it, ``receive`` is the
   server's again, so the app still sees the client disconnect;
4. more than ``MAX_CONCURRENT_REQUESTS`` requests in flight (open paths not counted): 429. A request
   counts from the moment its body has arrived, so slow bodies cannot hold the slots.

Errors use the API's body (``api.errors.error_body``). ``Operations`` also owns the drain: on SIGTERM
(``server.main`` forwards it) new requests get 503 and ``/ready`` 503 at once; in-flight requests
get ``DRAIN_TIMEOUT_S`` to finish, then whatever is left is aborted with "server is shutting down".
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.middleware.cors import CORSMiddleware

from api.errors import error_body
from api.metrics import ServerMetrics, logfmt
from config import Config

if TYPE_CHECKING:
    from api.serving import Runtime

log = logging.getLogger("minibatch.ops")

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


def lora_state(runtime: Runtime) -> dict | None:
    """The LoRA adapters' state for /metrics (vLLM's ``lora_requests_info``): MAX_LORAS, the adapters loaded, and
    those the running and the waiting sequences chose, by name; None when LoRA is off."""
    loras = runtime.engine.loras
    if loras is None:
        return None
    names = {a.lora_id: a.name for a in loras.served.values()}

    def chosen(seqs) -> list[str]:
        return sorted({names[s.lora_id] for s in seqs if s.lora_id in names})

    running = chosen(runtime.scheduler.running.values())
    return {
        "max_lora": loras.max_loras,
        "loaded": len(names),
        "running": running,
        "waiting": chosen(runtime.scheduler.waiting),
    }


class Operations:
    """Per-app operational state: config (once known), metrics, requests in flight, drain."""

    def __init__(self, config: Config | None, get_runtime: Callable[[], Runtime | None]) -> None:
        self.config = config
        self.get_runtime = get_runtime
        self.in_flight = 0  # HTTP requests past the checks and not yet answered (open paths excluded)
        self.draining = False
        self.drain_started = asyncio.Event()  # wakes requests still waiting for their body
        self.loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self.metrics = ServerMetrics(self.live)

    # --- readiness -------------------------------------------------------------------------------
    def readiness(self) -> str:
        """``ready``, ``loading`` (model not loaded), ``draining``, or ``dead`` (the engine loop stopped)."""
        runtime = self.get_runtime()
        if runtime is None:
            return "loading"
        if self.draining:
            return "draining"
        if not runtime.scheduler.alive:
            return "dead"
        return "ready"

    def live(self) -> dict[str, object]:
        runtime = self.get_runtime()
        values: dict[str, float] = {
            "num_requests_in_flight": self.in_flight,
            "ready": float(self.readiness() == "ready"),
            "draining": float(self.draining),
        }
        if runtime is not None:
            capacity = runtime.engine.capacity
            stats = runtime.engine.stats()
            blocks, free = stats.get("kv_blocks", 0), stats.get("kv_free_blocks", 0)
            values.update(
                num_requests_running=len(runtime.scheduler.running),
                num_requests_waiting=len(runtime.scheduler.waiting),
                kv_cache_usage_perc=(blocks - free) / blocks if blocks else 0.0,
                kv_cache_free_blocks=free,
                kv_cache_blocks=blocks,
                num_requests_prefilling=stats.get("num_prefilling", 0),
                batch_capacity=capacity,
                failed_admits=runtime.scheduler.failed_admits,
                failed_steps=runtime.scheduler.failed_steps,
                num_preemptions=runtime.scheduler.num_preemptions,
                kv_cache_cached_blocks=stats.get("kv_cached_blocks", 0),
                kv_cache_dtype=getattr(runtime.engine, "kv_cache_dtype", "none"),
                kv_cache_bytes=getattr(runtime.engine, "kv_pool_bytes", 0),
                prefix_cache_queries=stats.get("prefix_cache_queries", 0),
                prefix_cache_hits=stats.get("prefix_cache_hits", 0),
                prefill_tokens_computed=stats.get("prefill_tokens_computed", 0),
                spec=runtime.engine.planner.spec,
                lora=lora_state(runtime),
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
        self.drain_started.set()
        runtime = self.get_runtime()
        timeout = self.config.drain_timeout_s if self.config is not None else 0.0
        log.info(
            "%s",
            logfmt(
                "drain_started",
                in_flight=self.in_flight,
                unfinished=runtime.scheduler.num_unfinished if runtime else 0,
                timeout_s=timeout,
            ),
        )
        if runtime is not None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain(runtime, timeout), name="drain")

    async def _drain(self, runtime: Runtime, timeout: float) -> None:
        start = time.perf_counter()
        deadline = start + timeout
        drained_logged = False
        while time.perf_counter() < deadline:  # a watchdog until the lifespan's shutdown cancels it
            if runtime.scheduler.num_unfinished == 0 and not drained_logged:
                log.info("%s", logfmt("drain_idle", after_s=round(time.perf_counter() - start, 3)))
                drained_logged = True
            elif runtime.scheduler.num_unfinished:
                drained_logged = False
            await asyncio.sleep(0.05)
        left = runtime.scheduler.num_unfinished
        if left:
            log.warning("%s", logfmt("drain_timeout", aborting=left, timeout_s=timeout))
            await runtime.scheduler.stop()  # resolves every one as aborted: "server is shutting down"

    async def finish_drain(self) -> None:
        """The lifespan's shutdown: stop the watchdog (the caller stops the scheduler, aborting leftovers)."""
        self.draining = True
        self.drain_started.set()
        if self._drain_task is not None:
            self._drain_task.cancel()
            try:
                await self._drain_task
            except asyncio.CancelledError:
                pass
            self._drain_task = None


Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class OperationsMiddleware:
    """The checks above, in that order, before the app sees a request (see the module docstring)."""

    def __init__(self, app, operations: Operations) -> None:
        self.app = app
        self.operations = operations

    async def __call__(self, scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ops, cfg = self.operations, self.operations.config
        open_path = scope["path"] in OPEN_PATHS
        headers = _headers(scope)
        if (
            cfg is not None
            and cfg.api_key
            and not open_path
            and not _authorized(headers.get(b"authorization"), cfg.api_key)
        ):
            await self._reject(
                send,
                401,
                "missing or invalid API key (send Authorization: Bearer <key>)",
                "authentication_error",
                "auth",
                extra=[(b"www-authenticate", b"Bearer")],
            )
            return
        if b"content-length" in headers and b"transfer-encoding" in headers:  # (the h11 protocol refuses it first)
            await self._reject(
                send,
                400,
                "a request may not carry both Content-Length and Transfer-Encoding (RFC 9112 section 6.3)",
                "invalid_request_error",
                "validation",
                extra=[(b"connection", b"close")],
            )
            return
        if ops.draining and not open_path:
            await self._shutting_down(send)
            return
        if cfg is not None and (b"content-length" in headers or b"transfer-encoding" in headers):
            body = await self._body(headers, receive, send, cfg)
            if body is None:  # answered (or the client left)
                return
            receive = replay_body(body, receive)
        limit = cfg.max_concurrent_requests if cfg is not None else 0
        if limit and not open_path and ops.in_flight >= limit:
            await self._reject(
                send,
                429,
                f"too many requests in flight ({limit}, MAX_CONCURRENT_REQUESTS); retry later",
                "rate_limit_error",
                "too_many_connections",
                extra=[(b"retry-after", b"1")],
            )
            return
        if not open_path:
            ops.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if not open_path:
                ops.in_flight -= 1

    async def _body(self, headers: dict[bytes, bytes], receive: Receive, send: Send, cfg: Config) -> bytes | None:
        """The whole request body, checked; or None once an error is answered (or the client left)."""
        max_body = cfg.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await self._reject(send, 400, "invalid Content-Length header", "invalid_request_error", "validation")
                return None
            if size > max_body:
                await self._too_large(send, max_body)
                return None
        reading = asyncio.ensure_future(_read_body(receive, max_body))
        draining = asyncio.ensure_future(self.operations.drain_started.wait())
        done, _ = await asyncio.wait(
            {reading, draining}, timeout=cfg.body_timeout_s or None, return_when=asyncio.FIRST_COMPLETED
        )
        draining.cancel()
        if reading not in done:
            reading.cancel()
            if draining in done:
                await self._shutting_down(send)
            else:
                await self._reject(
                    send,
                    408,
                    f"request body not received within {cfg.body_timeout_s:g}s (BODY_TIMEOUT_S)",
                    "invalid_request_error",
                    "body_timeout",
                )
            return None
        body = reading.result()
        if body is _TOO_LARGE:
            await self._too_large(send, max_body)
            return None
        if body is not None and (problem := encoding_problem(body)):
            await self._reject(send, 422, problem, "invalid_request_error", "validation")
            return None
        return body

    async def _shutting_down(self, send: Send) -> None:
        await self._reject(
            send, 503, "server is shutting down", "unavailable", "draining", extra=[(b"retry-after", b"1")]
        )

    async def _too_large(self, send: Send, limit: int) -> None:
        await self._reject(
            send,
            413,
            f"request body is larger than {limit} bytes (MAX_BODY_BYTES)",
            "invalid_request_error",
            "too_large",
        )

    async def _reject(
        self,
        send: Send,
        status: int,
        message: str,
        kind: str,
        reason: str,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self.operations.metrics.rejected(reason)
        log.info("%s", logfmt("request_rejected", status=status, reason=reason))
        await send_error(send, status, message, kind, extra)


async def send_error(
    send: Send, status: int, message: str, kind: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
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


def encoding_problem(body: bytes) -> str | None:
    """Why ``body`` is not UTF-8 JSON text, or None. JSON between systems is UTF-8 (RFC 8259);
    Python's parser would also take UTF-16 and UTF-32, which we refuse rather than guess."""
    if not body:
        return None
    encoding = json.detect_encoding(body)
    if encoding not in ("utf-8", "utf-8-sig"):  # a UTF-8 byte-order mark is tolerated
        return f"request body must be JSON encoded as UTF-8 (this one looks like {encoding})"
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return "malformed JSON body: not valid UTF-8"
    return None


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


def replay_body(body: bytes, receive: Receive) -> Receive:
    """``receive`` for an app, given a body already read whole: the body first, then ``receive``'s messages."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class CORSFromConfig:
    """Starlette's ``CORSMiddleware`` with ``CORS_ALLOW_ORIGINS``, outside everything else, so preflight
    requests need no API key and error answers (401, 429, ...) carry the CORS headers too. The config is
    only known once the lifespan has started (``uvicorn server:app`` reads it there), so the inner
    middleware is built on the first HTTP request; with no origins configured requests pass straight through."""

    def __init__(self, app, operations: Operations) -> None:
        self.app = app
        self.operations = operations
        self.cors = None

    async def __call__(self, scope, receive: Receive, send: Send) -> None:
        cfg = self.operations.config
        if scope["type"] != "http" or cfg is None or not cfg.cors_origins:
            await self.app(scope, receive, send)
            return
        if self.cors is None:
            self.cors = CORSMiddleware(
                self.app,
                allow_origins=cfg.cors_origins,
                allow_methods=["GET", "POST"],
                allow_headers=["*"],  # OpenAI's JS client sends its own x-stainless-* headers
                expose_headers=["Retry-After"],
                max_age=600,
            )
        await self.cors(scope, receive, send)
