"""The app, composed: lifespan (engine, scheduler, drain), middleware, error handlers, routers; and
``main``, which runs it under uvicorn. No torch here, and no endpoint either:

* ``api/generate.py``: ``POST /generate``;  ``api/openai/``: ``/v1/...``, one file per endpoint;
* ``api/probes.py``: ``GET /health``, ``/ready``, ``/metrics``;  ``api/tokenize.py``: ``/tokenize``, ``/detokenize``;
  ``api/admin.py``: ``POST /admin/reset_prefix_cache``;
* ``api/serving.py``: request -> running generation;  ``api/streaming.py``: generation -> answer or SSE;
* ``api/ops.py``: auth, limits, slow bodies, drain;  ``api/transport.py``: connection-level defences;
* ``api/errors.py``: the error shape, and the translation of domain errors into it.

Run:  python server.py            (reads the environment; see config.py)
      uvicorn server:app          (same app, built on first access)
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from api import admin, generate, openai, probes, tokenize
from api.errors import APIError, describe_unparsable_body, describe_validation
from api.ops import OPEN_PATHS, CORSFromConfig, Operations, OperationsMiddleware
from api.serving import Runtime
from api.transport import (
    AcceptErrorLog,
    DrainingServer,
    defend_uvicorn,
    loading_uvicorn_config,
    raise_file_limit,
    uvicorn_config,
)
from config import Config
from core.fair_queue import FairQueue
from engine import FakeEngine, InferenceEngine
from models.runtime import build_engine
from scheduler import Scheduler, engine_thread
from schemas import ErrorResponse

log = logging.getLogger("minibatch.server")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def create_app(
    config: Config | None = None, engine: InferenceEngine | None = None, thread: ThreadPoolExecutor | None = None
) -> FastAPI:
    """The ASGI app. ``config`` defaults to the environment; ``engine`` to ``load_engine(config)``, built on
    a new ``engine_thread()``; ``thread``: the engine thread that built ``engine``, which steps it from here."""

    startup = StartupError()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        with startup.recorded():  # a bad setting, a model that cannot load: one line under uvicorn too
            cfg = config or Config.from_env()
            loop = asyncio.get_running_loop()
            operations.config, operations.loop = cfg, loop
            AcceptErrorLog().install(loop)
            logging.getLogger("minibatch").setLevel(cfg.log_level.upper())
            if not logging.getLogger().handlers:  # e.g. under `uvicorn server:app`: our lines need a handler
                logging.basicConfig(format=LOG_FORMAT)
            executor = thread or engine_thread()
            eng = engine or await asyncio.wrap_future(executor.submit(load_engine, cfg))
        scheduler = Scheduler(eng, cfg.max_queue_depth, executor=executor, waiting=waiting_queue(cfg))
        scheduler.on_engine_call = operations.metrics.on_engine_call
        scheduler.on_resolved = operations.metrics.on_resolved
        scheduler.start()
        runtime = Runtime(cfg, eng, scheduler)
        app.state.server = runtime
        log.info("serving %s with %d slots", cfg.model_name, eng.capacity)
        try:
            yield
        finally:
            await operations.finish_drain()
            await scheduler.stop()  # anything still unfinished ends as aborted: "server is shutting down"
            executor.shutdown(wait=False, cancel_futures=True)
            runtime.close()
            app.state.server = None

    app = FastAPI(title="MiniBatch-LLM", version="0.2.0", lifespan=lifespan, strict_content_type=False)
    app.state.server = None  # the Runtime while the lifespan runs
    operations = Operations(config, lambda: app.state.server)
    app.state.ops = operations
    app.add_middleware(OperationsMiddleware, operations=operations)
    app.add_middleware(CORSFromConfig, operations=operations)
    app.add_middleware(OneLineStartupError, startup=startup)  # added last: outermost
    _add_error_handlers(app, operations)
    app.include_router(probes.router)
    app.include_router(generate.router)
    app.include_router(openai.router)
    app.include_router(tokenize.router)
    app.include_router(admin.router)
    app.openapi = _openapi_with_ops_errors(app)
    return app


class StartupError:
    """Why the lifespan's startup failed, in one line (``recorded`` keeps it, then lets the error go on)."""

    def __init__(self) -> None:
        self.reason: str | None = None

    @contextmanager
    def recorded(self) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            self.reason = _one_line(exc)
            raise


class OneLineStartupError:
    """Pure ASGI, outermost: under ``uvicorn server:app`` a startup that fails in the lifespan (a bad setting, a model
    that cannot load) is reported by Starlette as a traceback; uvicorn logs its message. This makes that message
    ``error: <why>``, the line ``python server.py`` prints for the same failure."""

    def __init__(self, app, startup: StartupError) -> None:
        self.app, self.startup = app, startup

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def send_one_line(message) -> None:
            if message["type"] == "lifespan.startup.failed" and self.startup.reason is not None:
                message = {**message, "message": f"error: {self.startup.reason}"}
            await send(message)

        await self.app(scope, receive, send_one_line)


def _add_error_handlers(app: FastAPI, operations: Operations) -> None:
    """Every error in the API's shape, counted in minibatch:request_rejected_total by its reason."""

    def answer(error: APIError) -> JSONResponse:
        if error.reason:
            operations.metrics.rejected(error.reason)
        return error.response()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(APIError(422, describe_validation(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # FastAPI's bare answer to a body json.loads raised on: say what the parser refused.
            return answer(APIError(422, describe_unparsable_body(exc.__cause__)))
        return answer(APIError(exc.status_code, str(exc.detail)))


def waiting_queue(config: Config) -> FairQueue:
    """The scheduler's queue under SCHEDULING_POLICY, each client's share of it MAX_CLIENT_QUEUE_SHARE (never less than
    MAX_SEQUENCES_PER_REQUEST: any one request fits)."""
    share = config.max_client_queue_share
    per_client = int(share * config.max_queue_depth)
    per_client = 0 if share >= 1 else max(per_client, min(config.max_sequences_per_request, config.max_queue_depth))
    return FairQueue(config.scheduling_policy, max_client_waiting=per_client)


def load_engine(config: Config) -> InferenceEngine:
    """The engine MODEL_ID names; a FakeEngine also gets FAKE_STEP_DELAY_S and FAKE_STEP_FAULT_EVERY."""
    engine = build_engine(config)
    if isinstance(engine, FakeEngine):
        engine.step_delay = config.fake_step_delay_s
        every = config.fake_step_fault_every
        if every:

            def fault(step_no: int) -> None:
                if step_no % every == 0:
                    raise RuntimeError(f"injected fault at decode step {step_no} (FAKE_STEP_FAULT_EVERY={every})")

            engine.step_fault = fault
    return engine


# One server-sent event (OpenAPI < 3.2: a text/event-stream "schema" describes each event). Its data is a
# JSON chunk, a JSON error body, or "[DONE]".
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}

_OPS_ERRORS = {
    "400": "invalid Content-Length header",
    "401": "missing or invalid API key (only when API_KEY is set)",
    "408": "request body not received within BODY_TIMEOUT_S",
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


def __getattr__(name: str):
    """``server.app`` for ``uvicorn server:app``, built on first access (``python server.py`` never
    touches it, so it builds its app once, in ``main``)."""
    if name == "app":
        app = globals()["app"] = app_for_uvicorn()
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def app_for_uvicorn() -> FastAPI:
    """The app ``uvicorn server:app`` imports, built as ``main`` builds it: the config and the engine first (a bad
    configuration or a model that cannot load ends the process with one line, ``error: <why>``, and exit status 1,
    before any socket is opened), then the transport defences (``api/transport.py``) onto the uvicorn that is
    importing it, so they hold under either way of running."""
    try:
        config = Config.from_env()
        thread = engine_thread()
        engine = thread.submit(load_engine, config).result()
    except Exception as exc:  # ConfigError, a model that cannot load: the message says which
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        raise SystemExit(1) from None
    uv = loading_uvicorn_config()
    if uv is not None:
        log.warning("uvicorn server:app: %s", defend_uvicorn(uv, config))
    else:
        log.warning("server.app built outside uvicorn's loader: python server.py's transport defences are not applied")
    raise_file_limit()
    freeze_startup_heap()
    return create_app(config, engine, thread)


def main() -> int:
    """Serve until SIGTERM/SIGINT. A bad configuration or a model that cannot load ends the process
    with one line, ``error: <why>``, and exit status 1 (before any socket is opened)."""
    try:
        config = Config.from_env()
        logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
        thread = engine_thread()
        engine = thread.submit(load_engine, config).result()
    except Exception as exc:  # ConfigError, a model that cannot load: the message says which
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 1
    freeze_startup_heap()
    soft, hard = raise_file_limit()
    log.info("open-file limit %d (hard %d)", soft, hard)
    app = create_app(config, engine, thread)
    server = DrainingServer(uvicorn_config(app, config), app.state.ops)
    # uvicorn restores the previous SIGTERM handler after its graceful shutdown and re-raises the signal:
    # the shutdown is done by then, so the previous handler is a no-op and the process exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    return 0 if server.started else 3  # 3: the lifespan's startup failed (uvicorn's own code for it)


def freeze_startup_heap() -> None:
    """Leave what startup built (the model, torch, the tokenizer: millions of objects) out of every later garbage
    collection: a full collection walks every tracked object while holding the GIL, and one over that heap stalled
    the event loop for 1-2 s while a large logprobs answer was being built (docs/operations.md "Reliability")."""
    gc.collect()
    gc.freeze()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 500 else text[:497] + "..."


if __name__ == "__main__":
    sys.exit(main())
