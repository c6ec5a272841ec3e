"""HTTP pieces shared by server.py (/generate) and openai_api.py (/v1): errors in OpenAI's
shape, request -> Sequence validation, SSE framing, disconnect detection. No torch."""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from config import Config
from engine import InferenceEngine
from generation import Generation, wait_for_disconnect
from sampling import SamplingParams
from scheduler import QueueFullError, Scheduler
from schemas import ErrorResponse, SamplingFields, Usage
from sequence import Sequence, SequenceStatus


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


def describe_validation(exc: RequestValidationError) -> str:
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


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
