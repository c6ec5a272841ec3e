"""The gateway: the Serve application's HTTP ingress, in front of the MiniBatch replicas.

Serve's proxy, calling a replica directly, answers a request whose replica dies under it with a plain-text
``500 Internal Server Error`` and cuts a stream without its final event. The gateway is a small deployment (no
model, 0 CPUs) that Serve's proxy calls instead; it reads the request and calls a replica through a
DeploymentHandle (``MiniBatchServer.handle_http``), so a replica's death reaches it as an exception it can answer:

* nothing sent to the client yet (a plain request, whose answer comes in one piece at the end, or a stream
  before its first event): the request is sent again, to another replica, up to ``replica_retries`` times. The
  client sees one answer; the lost replica's partial work is gone with it. Then, 503 in the API's error shape;
* a stream already under way: an error event (503, the API's error body) and ``data: [DONE]``, as the server
  ends a stream on an engine failure. Its events so far stay valid; it is not retried, as that would repeat them.

The response's ``http.response.start`` is held until its first body message, so "nothing sent" holds until a
token (or a stream's opening event) is on its way. The gateway also reads the body within the server's limits
(MAX_BODY_BYTES, BODY_TIMEOUT_S), and, for prefix-affinity routing, hashes the prompt's prefix into the key the
router (deploy/routing.py) routes on.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from api.errors import error_body
from api.ops import _TOO_LARGE, _read_body, send_error
from api.streaming import sse

from .routing import PREFIX_KEY

log = logging.getLogger("minibatch.gateway")

# What of the request's ASGI scope travels to the replica (all plain data; the rest is the proxy's).
FORWARDED_SCOPE = (
    "type",
    "asgi",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "root_path",
    "query_string",
    "headers",
    "client",
    "server",
)
REPLICA_DIED = "the replica serving this request died before completing it"


@dataclass(frozen=True)
class GatewaySettings:
    """From the server's config (at build time) and the app's ``args``."""

    max_body_bytes: int
    body_timeout_s: float
    replica_retries: int = 2  # resends of a request whose replica died before anything reached the client
    affinity_prefix_chars: int = 0  # > 0: prefix-affinity routing on the prompt's first characters


# --- the prefix key ---------------------------------------------------------------------------------------
def prompt_prefix(path: str, body: bytes) -> str | None:
    """The text whose start decides the replica under prefix affinity: a chat's system prompt (else its messages),
    or the prompt (the first one, if several; token ids as text). None: not a generation request, or no prompt."""
    if not path.endswith(("/generate", "/completions")):
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    if path.endswith("/chat/completions"):
        return chat_prefix(data.get("messages"))
    return prompt_text(data.get("prompt"))


def prompt_text(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return " ".join(map(str, prompt))
        return prompt_text(prompt[0])
    return None


def message_text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):  # content parts: their text
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def chat_prefix(messages: Any) -> str | None:
    """The system prompt, when the chat opens with one (every rendered prompt that shares it shares its start);
    else the messages in order."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return None
    if messages[0].get("role") in ("system", "developer"):
        return message_text(messages[0])
    return "".join(f"{m.get('role')}: {message_text(m)}\n" for m in messages)


def prefix_key(path: str, body: bytes, chars: int) -> str | None:
    """A short hash of the first ``chars`` characters of the request's prompt prefix (None: no prompt)."""
    text = prompt_prefix(path, body)
    if not text:
        return None
    return hashlib.blake2b(text[:chars].encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


# --- relaying a replica's answer --------------------------------------------------------------------------
class Relay:
    """Passes the replica's ASGI messages to the client, holding ``http.response.start`` until the first body
    message; ``forwarded`` says whether anything has reached the client."""

    def __init__(self, send) -> None:
        self.send = send
        self.held: dict | None = None
        self.forwarded = False
        self.event_stream = False

    async def message(self, message: dict) -> None:
        if message["type"] == "http.response.start" and not self.forwarded:
            self.held = message
            headers = dict(message.get("headers", ()))
            self.event_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            return
        if self.held is not None:
            message_start, self.held = self.held, None
            self.forwarded = True
            await self.send(message_start)
        self.forwarded = True
        await self.send(message)

    async def run(self, response) -> None:
        """Relay ``response`` (a streaming DeploymentResponseGenerator of message lists) to its end. Cancelling
        this (the client left) or an error cancels the replica's side too."""
        finished = False
        try:
            async for batch in response:
                for message in batch:
                    await self.message(message)
            finished = True
        finally:
            if not finished:
                response.cancel()
        if self.held is not None:  # a start without a body (not sent by our app, but legal ASGI)
            await self.message({"type": "http.response.body", "body": b""})

    async def fail(self, status: int, message: str, kind: str) -> bool:
        """Answer the failure in the API's shape: the error body if nothing was sent, an error event and
        ``[DONE]`` in a stream under way. False: neither is possible (a plain body half sent)."""
        if not self.forwarded:
            await send_error(self.send, status, message, kind, [(b"retry-after", b"1")] if status == 503 else None)
            return True
        if self.event_stream:
            tail = sse(error_body(status, message, kind)) + sse("[DONE]")
            await self.send({"type": "http.response.body", "body": tail.encode(), "more_body": False})
            return True
        return False


# --- the ASGI app ---------------------------------------------------------------------------------------
class GatewayApp:
    """The gateway's ASGI app: read the request, call a replica, relay its answer or answer its failure."""

    def __init__(self, model, settings: GatewaySettings) -> None:
        self.model = model.options(stream=True, method_name="handle_http")  # a DeploymentHandle
        self.settings = settings

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":  # the API has no websockets
            await send({"type": "websocket.close", "code": 1003})
            return
        request = await self.read_request(scope, receive, send)
        if request is None:
            return
        key = None
        if self.settings.affinity_prefix_chars > 0:
            key = prefix_key(scope["path"], request["body"], self.settings.affinity_prefix_chars)
        await self.forward(request, key, send)

    async def read_request(self, scope, receive, send) -> dict | None:
        """The request for the replica (scope fields and the whole body), or None once answered or abandoned.

        A body over MAX_BODY_BYTES is not read further: the replica gets the request with no body and a
        Content-Length just over the limit, so it refuses it as one server would (401 without a key, else 413)."""
        s = self.settings
        fields = {k: scope[k] for k in FORWARDED_SCOPE if k in scope}
        try:
            body = await asyncio.wait_for(_read_body(receive, s.max_body_bytes), s.body_timeout_s or None)
        except asyncio.TimeoutError:
            message = f"request body not received within {s.body_timeout_s:g}s (BODY_TIMEOUT_S)"
            await send_error(send, 408, message, "invalid_request_error")
            return None
        if body is None:  # the client left
            return None
        if body is _TOO_LARGE:
            framing = (b"content-length", b"transfer-encoding")
            headers = [(k, v) for k, v in fields.get("headers", ()) if k.lower() not in framing]
            fields["headers"] = [*headers, (b"content-length", str(s.max_body_bytes + 1).encode())]
            body = b""
        return {"scope": fields, "body": body}

    async def forward(self, request: dict, key: str | None, send) -> None:
        """Call a replica and relay its answer; resend while its replica died before anything reached the client."""
        retries = self.settings.replica_retries
        for attempt in range(retries + 1):
            relay = Relay(send)
            try:
                await relay.run(self.model.remote(request, **{PREFIX_KEY: key}))
                return
            except RayActorError as exc:
                if not relay.forwarded and attempt < retries:
                    log.warning(
                        "a replica died under a request before answering; resending it (%s)", type(exc).__name__
                    )
                    continue
                tried = "" if relay.forwarded else f" (tried on {attempt + 1} replicas)"
                status, message, kind = 503, f"{REPLICA_DIED}; the request was not completed{tried}", "unavailable"
            except (BackPressureError, DeploymentUnavailableError) as exc:
                status, message, kind = 503, f"no replica can take the request: {exc_message(exc)}", "overloaded"
            except Exception:
                log.exception("request failed between the gateway and its replica")
                status, message, kind = 500, "the request failed between the gateway and its replica", "server_error"
            if not await relay.fail(status, message, kind):
                raise RuntimeError("the replica failed after its answer had started; the connection is closed")
            return


def exc_message(exc: Exception) -> str:
    return str(getattr(exc, "message", "") or exc).splitlines()[0]


async def lifespan(receive, send) -> None:
    """The ASGI lifespan protocol, with nothing to start or stop."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
