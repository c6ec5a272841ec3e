"""HTTP front end: translates requests into sequences for the scheduler and back. No torch here.

Run:  python server.py            (reads the environment; see config.py)
      uvicorn server:app          (same app object)

Endpoints: ``POST /generate`` (our API, optionally streamed as server-sent events),
``GET /health`` (liveness), ``GET /ready`` (readiness), ``GET /metrics`` (Prometheus), and the
OpenAI-compatible ``/v1/...`` routes from ``openai_api.py``. Auth, limits and the graceful drain
live in ``ops.py``, metrics in ``metrics.py``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import metrics
from config import Config
from engine import FakeEngine, InferenceEngine, build_engine
from generation import Generation
from http_common import (
    APIError,
    ServerState,
    describe_validation,
    check_finished,
    disconnect_future,
    error_body,
    error_response,
    failure,
    make_sequence,
    sse,
    sse_response,
    start_generation,
    usage,
)
from openai_api import openai_router
from ops import OPEN_PATHS, Ops, OpsMiddleware, check_prompt_chars
from scheduler import Scheduler
from schemas import ErrorResponse, GenerateRequest, GenerateResponse, HealthResponse, Metrics

log = logging.getLogger("minibatch.server")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ReadyResponse(BaseModel):
    status: Literal["ready", "loading", "draining", "dead"]


def create_app(config: Config | None = None, engine: InferenceEngine | None = None) -> FastAPI:
    """The ASGI app. ``config`` defaults to the environment; ``engine`` to ``build_engine(config)``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        cfg = config or Config.from_env()
        ops.config = cfg
        ops.loop = asyncio.get_running_loop()
        logging.getLogger("minibatch").setLevel(cfg.log_level.upper())
        if not logging.getLogger().handlers:  # e.g. under `uvicorn server:app`: our lines need a handler
            logging.basicConfig(format=LOG_FORMAT)
        eng = engine or await asyncio.to_thread(build_engine, cfg)
        if engine is None and isinstance(eng, FakeEngine):
            apply_fake_knobs(eng, cfg)
        scheduler = Scheduler(eng, cfg.max_queue_depth)
        scheduler.on_engine_call = ops.metrics.on_engine_call
        scheduler.on_resolved = ops.metrics.on_resolved
        scheduler.start()
        app.state.server = ServerState(cfg, eng, scheduler)
        log.info("serving %s with %d slots", eng.model_name, eng.capacity)
        try:
            yield
        finally:
            await ops.finish_drain()
            await scheduler.stop()  # anything still unfinished ends as aborted: "server is shutting down"
            app.state.server = None

    app = FastAPI(title="MiniBatch-LLM", version="0.2.0", lifespan=lifespan, strict_content_type=False)
    app.state.server = None
    ops = Ops(config, lambda: app.state.server)
    app.state.ops = ops
    app.add_middleware(OpsMiddleware, ops=ops)

    def rejected(status: int, kind: str, exc: Exception | None = None) -> None:
        """Count an error answer in minibatch:request_rejected_total (finished sequences count elsewhere)."""
        reason = getattr(exc, "reject_reason", None)
        if reason is None:
            if kind == "overloaded":
                reason = "queue_full"
            elif 400 <= status < 500 and status != 499:
                reason = "validation"
        if reason is not None:
            ops.metrics.rejected(reason)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        rejected(exc.status, exc.kind, exc)
        return error_response(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        rejected(422, "invalid_request_error")
        return error_response(422, describe_validation(exc), "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        rejected(exc.status_code, "invalid_request_error")
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # FastAPI's answer to a body that is not even text (invalid UTF-8): malformed JSON, like the rest.
            return error_response(422, "malformed JSON body: not valid UTF-8", "invalid_request_error")
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    def state() -> ServerState:
        st: ServerState | None = app.state.server
        if st is None or not st.scheduler.alive:
            ops.metrics.rejected("not_ready")
            raise APIError(503, "server is not ready", "unavailable")
        return st

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def health() -> JSONResponse:
        st: ServerState | None = app.state.server
        if st is None:
            return JSONResponse(HealthResponse(status="loading").model_dump(), status_code=503)
        body = HealthResponse(
            status="ok" if st.scheduler.alive else "dead",
            model=st.engine.model_name,
            capacity=st.engine.capacity,
            running=len(st.scheduler.running),
            waiting=len(st.scheduler.waiting),
            engine=st.engine.stats(),
        )
        return JSONResponse(body.model_dump(), status_code=200 if st.scheduler.alive else 503)

    @app.get("/ready", response_model=ReadyResponse, responses={503: {"model": ReadyResponse}})
    async def ready() -> JSONResponse:
        """Readiness: 200 only while the model is loaded, the engine loop runs and the server is not draining."""
        status = ops.readiness()
        return JSONResponse({"status": status}, status_code=200 if status == "ready" else 503)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics_endpoint() -> Response:
        """Prometheus text format (0.0.4). Open like /health: counts and latencies only, no request content."""
        return Response(ops.metrics.render(), media_type=metrics.CONTENT_TYPE)

    @app.post(
        "/generate",
        response_model=GenerateResponse,
        responses={code: {"model": ErrorResponse} for code in (422, 500, 503, 504)},
    )
    async def generate(req: GenerateRequest, request: Request):
        st = state()
        limit = st.config.max_new_tokens_limit
        if req.max_new_tokens > limit:
            raise APIError(422, f"max_new_tokens must be in [1, {limit}] (got {req.max_new_tokens})", param="max_new_tokens")
        seq = make_sequence(
            st, st.engine.encode(check_prompt_chars(st, req.prompt)), req.max_new_tokens, req, request_id=req.request_id or f"req-{uuid.uuid4().hex}"
        )
        gen = start_generation(st, seq, req.stop)
        if req.stream:
            return sse_response(generate_events(st, gen, request))
        done = await gen.result(disconnect_future(request))
        if done is None:
            return error_response(499, "client disconnected", "cancelled")
        check_finished(done)
        gen.final_text()
        return GenerateResponse(
            request_id=done.request_id,
            text=gen.text,
            token_ids=done.output_token_ids,
            finish_reason=done.finish_reason,
            usage=usage(done),
            metrics=Metrics(**done.metrics_ms()),
        )

    app.include_router(openai_router(state))
    app.openapi = _openapi_with_ops_errors(app)
    return app


def apply_fake_knobs(eng: FakeEngine, cfg: Config) -> None:
    """FAKE_STEP_DELAY_S and FAKE_STEP_FAULT_EVERY on a FakeEngine built from the config (tests, demos)."""
    eng.step_delay = cfg.fake_step_delay_s
    every = cfg.fake_step_fault_every
    if every:
        def fault(step_no: int) -> None:
            if step_no % every == 0:
                raise RuntimeError(f"injected fault at decode step {step_no} (FAKE_STEP_FAULT_EVERY={every})")

        eng.step_fault = fault


# One server-sent event (OpenAPI < 3.2: a text/event-stream "schema" describes each event). Its data is a
# JSON chunk, a JSON error body, or "[DONE]".
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}

_OPS_ERRORS = {
    "400": "invalid Content-Length header",
    "401": "missing or invalid API key (only when API_KEY is set)",
    "413": "request body larger than MAX_BODY_BYTES",
    "429": "more than MAX_CONCURRENT_REQUESTS requests in flight",
    "503": "server not ready, draining for shutdown, or overloaded",
}


def _openapi_with_ops_errors(app: FastAPI) -> Callable[[], dict]:
    """The generated schema plus what the middleware may answer on every non-probe route, and the
    text/event-stream alternative of the streaming endpoints' 200."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = FastAPI.openapi(app)
        error_ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for path, item in schema.get("paths", {}).items():
            if path in OPEN_PATHS:
                continue
            for method, op in item.items():
                responses = op.setdefault("responses", {})
                for code, description in _OPS_ERRORS.items():
                    responses.setdefault(code, {"description": description, "content": error_ref})
                ok = responses.get("200", {}).get("content")
                if method == "post" and ok is not None:
                    ok.setdefault("text/event-stream", {"schema": _SSE_EVENT})
        schema.setdefault("components", {}).setdefault("schemas", {}).setdefault(
            "ErrorResponse", ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        )
        return schema

    return openapi


async def generate_events(st: ServerState, gen: Generation, request: Request) -> AsyncIterator[str]:
    """/generate as server-sent events: one per step that produces text, then the final event."""
    disconnected = disconnect_future(request)
    seq = gen.seq
    try:
        async for chunk in gen.stream(disconnected):
            if chunk.text or chunk.token_ids:  # a token with no text of its own (EOS) still counts
                yield sse({"request_id": seq.request_id, "text": chunk.text, "token_ids": chunk.token_ids})
        if disconnected.done():
            return
        error = failure(seq)
        if error is not None:
            yield sse(error_body(error.status, error.message, error.kind))
            return
        yield sse({
            "request_id": seq.request_id, "text": gen.final_text(), "token_ids": [],
            "finish_reason": seq.finish_reason, "usage": usage(seq).model_dump(), "metrics": seq.metrics_ms(),
        })
        yield sse("[DONE]")
    finally:
        disconnected.cancel()


app = create_app()


def main() -> None:
    import uvicorn

    config = Config.from_env()
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    app = create_app(config)
    ops: Ops = app.state.ops

    class DrainingServer(uvicorn.Server):
        """uvicorn, plus: the first SIGTERM/SIGINT also starts the app's drain (503 for new requests,
        in-flight ones get DRAIN_TIMEOUT_S, then are aborted). uvicorn itself stops listening and waits
        for open connections before the lifespan's shutdown, so the drain must start here."""

        def handle_exit(self, sig, frame) -> None:
            ops.request_drain()
            super().handle_exit(sig, frame)

    server = DrainingServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level.lower(),
        timeout_graceful_shutdown=config.drain_timeout_s + 5,  # backstop: cancel what the drain could not end
    ))
    # uvicorn restores the previous SIGTERM handler after its graceful shutdown and re-raises the signal:
    # the shutdown is done by then, so the previous handler is a no-op and the process exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()


if __name__ == "__main__":
    main()
