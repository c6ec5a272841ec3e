"""HTTP request and response bodies (pydantic 2). Strict types: "5" is not an integer here."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


def _valid_unicode(value):
    """Reject strings that cannot be UTF-8 encoded (unpaired surrogates), also inside lists."""
    for text in value if isinstance(value, list) else [value]:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("must be valid Unicode (no unpaired surrogates)") from None
    return value


class SamplingFields(BaseModel):
    """Sampling and stopping fields shared by /generate and the OpenAI endpoints."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float = Field(default=0.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0, description="0 = off")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0, allow_inf_nan=False)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = Field(default=None, description="up to 8 stop strings; not returned")
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 8 or any(not 1 <= len(s) <= 256 for s in stops):
            raise ValueError("at most 8 stop strings of 1 to 256 characters")
        return _valid_unicode(stops)

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, value):
        if value and any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value


class GenerateRequest(SamplingFields):
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    prompt: str = Field(min_length=1)
    # The upper bound is MAX_NEW_TOKENS_LIMIT, checked by the server (it is configuration).
    max_new_tokens: int = Field(default=16, ge=1)
    stream: bool = False

    @field_validator("prompt", "request_id")
    @classmethod
    def _unicode(cls, value):
        return _valid_unicode(value)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class OpenAIFields(SamplingFields):
    """Fields common to /v1/completions and /v1/chat/completions. Unknown fields are ignored,
    as OpenAI clients send some we do not use; the ones that would change the answer are checked."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, allow_inf_nan=False)  # OpenAI's default
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=1, description="only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported")
        return value


class CompletionRequest(OpenAIFields):
    prompt: str | list[int] | list[str] = Field(description="text, a list of token ids, or a list with one text")
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value):
        if isinstance(value, list):
            if not value:
                raise ValueError("must not be empty")
            if isinstance(value[0], str) and len(value) != 1:
                raise ValueError("a list of texts must hold exactly one text (batched prompts are not supported)")
        elif value == "":
            raise ValueError("must not be empty")
        return _valid_unicode(value)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix is not supported")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(OpenAIFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("messages")
    @classmethod
    def _unicode_messages(cls, value):
        _valid_unicode([m.text() for m in value])
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
    param: str | None = None
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


class ReadyResponse(BaseModel):
    status: Literal["ready", "loading", "draining", "dead"]
