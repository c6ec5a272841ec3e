"""Error answers in OpenAI's shape, for every endpoint: ``APIError``, the body, and the translation of
validation, routing and body-parsing failures, of the domain errors of the modules below the API
(``field_errors``: a ``guided.errors.GuidedError`` names a request field) and of sequences that did not end
normally. Only ``api/`` raises ``APIError``. No torch."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from core.sequence import Sequence, SequenceStatus
from guided.errors import GuidedError
from models.lora import LoraError
from schemas import ErrorResponse

log = logging.getLogger("minibatch.api")

# What a client is told when the engine fails under its request. Stable: the exception's own text
# (a tensor shape, a CUDA message, a file path) goes to the log, never to a client.
ENGINE_FAILURE = "the engine failed while running this request; details are in the server log"


class APIError(Exception):
    """An error answer: HTTP status, message, error type and parameter for the body, and ``reason``,
    the ``minibatch:request_rejected_total`` label it counts under (None: the status's default; "": not counted there,
    e.g. a sequence that ran and failed, counted by its finish reason instead). ``headers`` go out with the answer."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        reason: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.reason = reason if reason is not None else default_reason(status)
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.kind, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def default_reason(status: int) -> str | None:
    """The rejection label of a client error by status: unknown route or method, else bad input."""
    if status in (404, 405):
        return "not_found"
    if 400 <= status < 500 and status != 499:  # 499: the client left, nothing was refused
        return "validation"
    return None


# ``error.code`` as OpenAI sends it: a string naming the error, or null; ours names the HTTP status's meaning
# (the status itself is the answer's), and the two OpenAI codes clients test for by name.
ERROR_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    411: "length_required",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "invalid_value",
    429: "rate_limit_exceeded",
    431: "headers_too_large",
    499: "cancelled",
    500: "server_error",
    501: "not_implemented",
    502: "bad_gateway",
    503: "unavailable",
    504: "timeout",
}


def error_code(status: int, param: str | None = None) -> str | None:
    """The ``code`` of an error answer with HTTP ``status`` (``model_not_found`` for an unknown ``model``)."""
    if status == 404 and param == "model":
        return "model_not_found"
    return ERROR_CODES.get(status)


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    """OpenAI's error shape, used by every endpoint: ``code`` a string or null (``error_code``)."""
    detail = {"message": message, "type": kind, "param": param, "code": error_code(status, param)}
    return ErrorResponse(error=detail).model_dump()


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


def describe_unparsable_body(cause: BaseException | None) -> str:
    """FastAPI answers a body ``json.loads`` raised on (other than a syntax error) with a bare 400;
    say what the parser refused instead."""
    if isinstance(cause, UnicodeDecodeError):
        return "malformed JSON body: not valid UTF-8"
    if isinstance(cause, RecursionError):
        return "malformed JSON body: arrays or objects nested too deeply"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return "malformed JSON body: an integer with more than 4300 digits"
    return "malformed JSON body"


@contextmanager
def field_errors() -> Iterator[None]:
    """Around structured-output and tool-calling work on a request: a ``GuidedError`` is answered 400, naming the
    request field it is about."""
    try:
        yield
    except GuidedError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


@contextmanager
def lora_errors() -> Iterator[None]:
    """Around loading a LoRA adapter: a ``models.lora.LoraError`` (one that cannot be served, or a name taken) is
    answered 400 with its one line."""
    try:
        yield
    except LoraError as exc:
        raise APIError(400, str(exc), param="lora_path") from None


def sequence_error(seq: Sequence) -> APIError | None:
    """The error answer for a sequence that did not end normally (None if it did)."""
    if seq.status is SequenceStatus.FINISHED_ERROR:
        if seq.error_status != 500:  # the request's own fault (a grammar no answer can complete)
            return APIError(seq.error_status, seq.error or ENGINE_FAILURE, reason="")  # it ran: counted as "error"
        return APIError(500, f"generation failed: {seq.error or ENGINE_FAILURE}", "server_error")
    if seq.status is SequenceStatus.FINISHED_TIMEOUT:
        return APIError(504, f"request {seq.error}", "timeout", reason=None)
    if seq.status is SequenceStatus.FINISHED_ABORTED:
        return APIError(503, f"request aborted: {seq.error or 'cancelled'}", "unavailable", reason=None)
    return None
