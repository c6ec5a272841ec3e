"""The open endpoints: ``GET /health`` (liveness), ``GET /ready`` (readiness), ``GET /metrics``
(Prometheus). They need no API key, so they show counts and the served model name only: never
request content, never ``MODEL_ID`` (a local path can name a user or a directory). No torch."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from api import metrics
from api.ops import Operations
from api.serving import Runtime
from schemas import HealthResponse, ReadyResponse

router = APIRouter()


@router.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
async def health(request: Request) -> JSONResponse:
    runtime: Runtime | None = request.app.state.server
    if runtime is None:
        return JSONResponse(HealthResponse(status="loading").model_dump(), status_code=503)
    alive = runtime.scheduler.alive
    body = HealthResponse(
        status="ok" if alive else "dead",
        model=runtime.config.model_name,
        capacity=runtime.engine.capacity,
        running=len(runtime.scheduler.running),
        waiting=len(runtime.scheduler.waiting),
        engine=runtime.engine.stats(),
    )
    return JSONResponse(body.model_dump(), status_code=200 if alive else 503)


@router.get("/ready", response_model=ReadyResponse, responses={503: {"model": ReadyResponse}})
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 only while the model is loaded, the engine loop runs and the server is not draining."""
    operations: Operations = request.app.state.ops
    status = operations.readiness()
    return JSONResponse({"status": status}, status_code=200 if status == "ready" else 503)


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics_endpoint(request: Request) -> Response:
    """Prometheus text format (0.0.4). Open like /health: counts and latencies only, no request content."""
    operations: Operations = request.app.state.ops
    return Response(operations.metrics.render(), media_type=metrics.CONTENT_TYPE)
