"""HTTP front end: translates requests into sequences for the scheduler and back. No torch here.

Run:  python server.py            (reads the environment; see config.py)
      uvicorn server:app          (same app object)

Endpoints: ``POST /generate`` (our API, optionally streamed as server-sent events),
``GET /health``, and the OpenAI-compatible ``/v1/...`` routes from ``openai_api.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from config import Config
from engine import InferenceEngine, build_engine
from generation import Generation, wait_for_disconnect
from sampling import SamplingParams
from scheduler import QueueFullError, Scheduler
from schemas import ErrorResponse, GenerateRequest, GenerateResponse, HealthResponse, Metrics, SamplingFields, Usage
from sequence import Sequence, SequenceStatus

log = logging.getLogger("minibatch.server")


class APIError(Exception):
    """An error answer: HTTP status, message, and an error type for the body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    """OpenAI's error shape, used by every endpoint."""
    return ErrorResponse(error={"message": message, "type": kind, "param": param, "code": status}).model_dump()


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind, param), status_code=status)


def _describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if tuple(err.get("loc", ())) == ("body",) and err.get("type") == "model_attributes_type":
            parts.append("request body must be a JSON object (send Content-Type: application/json)")
            continue
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"malformed JSON body{': ' + str(detail) if detail else ''}")
            continue
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


class ServerState:
    """What the handlers need once the lifespan has started: config, engine, scheduler."""

    def __init__(self, config: Config, engine: InferenceEngine, scheduler: Scheduler) -> None:
        self.config, self.engine, self.scheduler = config, engine, scheduler


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
        return error_response(422, _describe_validation(exc), "invalid_request_error")

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

    from openai_api import openai_router  # imports this module's helpers

    app.include_router(openai_router(state))
    return app


# --- shared by /generate and the OpenAI routes -------------------------------------------------
def make_sequence(
    st: ServerState,
    prompt_ids: list[int],
    max_new_tokens: int,
    fields: SamplingFields,
    request_id: str,
    logprobs: int | None = None,
) -> Sequence:
    """Validate sampling and length against the config and the model; build the Sequence."""
    if logprobs is not None and logprobs > st.config.max_logprobs:
        raise APIError(422, f"logprobs must be in [0, {st.config.max_logprobs}] (got {logprobs})", param="logprobs")
    try:
        sampling = SamplingParams(
            temperature=fields.temperature, top_p=fields.top_p, top_k=fields.top_k, min_p=fields.min_p,
            repetition_penalty=fields.repetition_penalty, presence_penalty=fields.presence_penalty,
            frequency_penalty=fields.frequency_penalty, seed=fields.seed,
        )
    except ValueError as exc:
        raise APIError(422, str(exc)) from None
    now = time.perf_counter()
    cfg = st.config
    seq = Sequence(
        prompt_token_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        request_id=request_id,
        stop_token_ids=frozenset(fields.stop_token_ids or ()),
        ignore_eos=fields.ignore_eos,
        sampling=sampling,
        logprobs=logprobs,
        arrival_time=now,
        queue_deadline=now + cfg.max_queue_time_s if cfg.max_queue_time_s else None,
        deadline=now + cfg.request_timeout_s if cfg.request_timeout_s else None,
    )
    reason = st.engine.check_admissible(seq)
    if reason:
        raise APIError(422, reason, param="prompt")
    return seq


def start_generation(st: ServerState, seq: Sequence, stop: list[str] | None) -> Generation:
    gen = Generation(seq, st.engine, st.scheduler, stop)
    try:
        gen.start()
    except QueueFullError as exc:
        raise APIError(503, str(exc), "overloaded") from None
    return gen


def check_finished(seq: Sequence) -> None:
    """Raise the HTTP error for a sequence that did not end normally."""
    error = failure(seq)
    if error is not None:
        raise error


def failure(seq: Sequence) -> APIError | None:
    if seq.status is SequenceStatus.FINISHED_ERROR:
        return APIError(500, f"generation failed: {seq.error}", "server_error")
    if seq.status is SequenceStatus.FINISHED_TIMEOUT:
        return APIError(504, f"request {seq.error}", "timeout")
    if seq.status is SequenceStatus.FINISHED_ABORTED:
        return APIError(503, f"request aborted: {seq.error or 'cancelled'}", "unavailable")
    return None


def usage(seq: Sequence) -> Usage:
    n = len(seq.output_token_ids)
    return Usage(prompt_tokens=seq.prompt_len, completion_tokens=n, total_tokens=seq.prompt_len + n)


def disconnect_future(request: Request) -> asyncio.Future:
    """A task that completes when the client disconnects (cancelled by whoever stops caring)."""
    return asyncio.ensure_future(wait_for_disconnect(request.receive))


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[str], gen: Generation) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


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
