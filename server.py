"""HTTP front end: translates requests into sequences for the scheduler and back. No torch here.

Run:  python server.py            (reads the environment; see config.py)
      uvicorn server:app          (same app object)
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from config import Config
from engine import InferenceEngine, build_engine
from scheduler import QueueFullError, Scheduler
from schemas import ErrorResponse, GenerateRequest, GenerateResponse, HealthResponse, Metrics, Usage
from sequence import Sequence, SequenceStatus

log = logging.getLogger("minibatch.server")


class APIError(Exception):
    """An error answer: HTTP status, message, and an error type for the body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    body = ErrorResponse(error={"message": message, "type": kind, "code": status})
    return JSONResponse(body.model_dump(), status_code=status)


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

    app = FastAPI(title="MiniBatch-LLM", version="0.1.0", lifespan=lifespan, strict_content_type=False)
    app.state.server = None

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.kind)

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
        responses={code: {"model": ErrorResponse} for code in (400, 422, 500, 503)},
    )
    async def generate(req: GenerateRequest) -> GenerateResponse:
        st = state()
        seq = make_sequence(st, req)
        try:
            future = st.scheduler.submit(seq)
        except QueueFullError as exc:
            raise APIError(503, str(exc), "overloaded") from None
        try:
            done = await asyncio.shield(future)
        except asyncio.CancelledError:  # the client went away: free its slot
            st.scheduler.abort(seq.seq_id)
            raise
        return to_response(st, done)

    return app


def make_sequence(st: ServerState, req: GenerateRequest) -> Sequence:
    """Validate a request against the config and the model; build its Sequence."""
    limit = st.config.max_new_tokens_limit
    if req.max_new_tokens > limit:
        raise APIError(422, f"max_new_tokens must be in [1, {limit}] (got {req.max_new_tokens})")
    if req.temperature != 0:
        raise APIError(400, "sampling is not supported yet: temperature must be 0 (greedy)")
    seq = Sequence(
        prompt_token_ids=st.engine.encode(req.prompt),
        max_new_tokens=req.max_new_tokens,
        request_id=req.request_id or f"req-{uuid.uuid4().hex}",
    )
    reason = st.engine.check_admissible(seq)
    if reason:
        raise APIError(422, reason)
    return seq


def to_response(st: ServerState, seq: Sequence) -> GenerateResponse:
    if seq.status is SequenceStatus.FINISHED_ERROR:
        raise APIError(500, f"generation failed: {seq.error}", "server_error")
    if seq.status is SequenceStatus.FINISHED_ABORTED:
        raise APIError(503, f"request aborted: {seq.error or 'cancelled'}", "unavailable")
    completion = len(seq.output_token_ids)
    return GenerateResponse(
        request_id=seq.request_id,
        text=st.engine.decode(seq.output_token_ids),
        token_ids=seq.output_token_ids,
        finish_reason=seq.finish_reason,
        usage=Usage(prompt_tokens=seq.prompt_len, completion_tokens=completion, total_tokens=seq.prompt_len + completion),
        metrics=Metrics(**seq.metrics_ms()),
    )


app = create_app()


def main() -> None:
    import uvicorn

    config = Config.from_env()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(config), host=config.host, port=config.port)


if __name__ == "__main__":
    main()
