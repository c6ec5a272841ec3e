"""HTTP front end: translates requests into sequences for the scheduler and back. No torch here.

Run:  python server.py            (reads the environment; see config.py)
      uvicorn server:app          (same app object)

Endpoints: ``POST /generate`` (our API, optionally streamed as server-sent events),
``GET /health``, and the OpenAI-compatible ``/v1/...`` routes from ``openai_api.py``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from config import Config
from engine import InferenceEngine, build_engine
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
from scheduler import Scheduler
from schemas import ErrorResponse, GenerateRequest, GenerateResponse, HealthResponse, Metrics

log = logging.getLogger("minibatch.server")


def create_app(config: Config | None = None, engine: InferenceEngine | None = None) -> FastAPI:
    """The ASGI app. ``config`` defaults to the environment; ``engine`` to ``build_engine(config)``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        cfg = config or Config.from_env()
        eng = engine or await asyncio.to_thread(build_engine, cfg)
        scheduler = Scheduler(eng, cfg.max_queue_depth)
        scheduler.start()
        app.state.server = ServerState(cfg, eng, scheduler)
        log.info("serving %s with %d slots", eng.model_name, eng.capacity)
        try:
            yield
        finally:
            await scheduler.stop()
            app.state.server = None

    app = FastAPI(title="MiniBatch-LLM", version="0.2.0", lifespan=lifespan, strict_content_type=False)
    app.state.server = None

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, describe_validation(exc), "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    def state() -> ServerState:
        st: ServerState | None = app.state.server
        if st is None or not st.scheduler.alive:
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
            st, st.engine.encode(req.prompt), req.max_new_tokens, req, request_id=req.request_id or f"req-{uuid.uuid4().hex}"
        )
        gen = start_generation(st, seq, req.stop)
        if req.stream:
            return sse_response(generate_events(st, gen, request), gen)
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
    return app


async def generate_events(st: ServerState, gen: Generation, request: Request) -> AsyncIterator[str]:
    """/generate as server-sent events: one per step that produces text, then the final event."""
    disconnected = disconnect_future(request)
    seq = gen.seq
    try:
        async for chunk in gen.stream(disconnected):
            if chunk.text:
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(config), host=config.host, port=config.port)


if __name__ == "__main__":
    main()
