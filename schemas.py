"""HTTP request and response bodies (pydantic 2). Strict types: "5" is not an integer here."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    prompt: str = Field(min_length=1)
    # The upper bound is MAX_NEW_TOKENS_LIMIT, checked by the server (it is configuration).
    max_new_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)

    @field_validator("prompt", "request_id")
    @classmethod
    def _valid_unicode(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("must be valid Unicode (no unpaired surrogates)") from None
        return value


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Metrics(BaseModel):
    queue_wait_ms: float  # arrival -> admitted into the batch
    ttft_ms: float  # arrival -> first token
    generate_ms: float  # admitted -> finished
    e2e_ms: float  # arrival -> finished


class GenerateResponse(BaseModel):
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length"]
    usage: Usage
    metrics: Metrics


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail


class HealthResponse(BaseModel):
    status: Literal["ok", "loading", "dead"]
    model: str | None = None
    capacity: int | None = None
    running: int = 0
    waiting: int = 0
    engine: dict[str, int] = Field(default_factory=dict)
