"""HTTP request and response bodies (pydantic 2). Strict types: "5" is not an integer here."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def _valid_unicode(value):
    """Reject strings that cannot be UTF-8 encoded (unpaired surrogates), also inside lists."""
    for text in value if isinstance(value, list) else [value]:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("must be valid Unicode (no unpaired surrogates)") from None
    return value


class SpeculativeFields(BaseModel):
    """A request's speculative decoding (docs/speculative.md); what it leaves out is the server's default
    (SPECULATIVE_METHOD, NUM_SPECULATIVE_TOKENS, PROMPT_LOOKUP_MIN / _MAX). It never changes the output, only how
    many tokens a step may emit."""

    model_config = ConfigDict(extra="forbid", strict=True)

    method: Literal["off", "ngram", "draft_model"] | None = None
    num_speculative_tokens: int | None = Field(default=None, ge=1, le=16)
    prompt_lookup_min: int | None = Field(default=None, ge=1, le=32)
    prompt_lookup_max: int | None = Field(default=None, ge=1, le=32)
    draft_model: str | None = Field(default=None, min_length=1, max_length=256, description="method draft_model")


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
    speculative: SpeculativeFields | None = None
    logit_bias: dict[str, float] | None = Field(
        default=None, description="token id (as a string) -> bias in [-100, 100] added to its logit; at most 300"
    )

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value):
        """Keys are token ids written in decimal ("50256"); the vocabulary bound is the server's check."""
        if not value:
            return value
        if len(value) > 300:
            raise ValueError(f"at most 300 entries (got {len(value)})")
        seen = set()
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"keys must be token ids (non-negative integers), got {key[:20]!r}")
            if not -100 <= bias <= 100 or bias != bias:
                raise ValueError(f"values must be in [-100, 100], got {bias} for token {key}")
            if int(key) in seen:
                raise ValueError(f"token id {int(key)} appears twice")
            seen.add(int(key))
        return value

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
    model: str | None = Field(
        default=None, min_length=1, max_length=256, description="a LoRA adapter's name, or the base model's"
    )
    prompt: str | list[int] = Field(min_length=1, description="text, or token ids (fed as they are)")
    # The upper bound is MAX_NEW_TOKENS_LIMIT, checked by the server (it is configuration).
    max_new_tokens: int = Field(default=16, ge=1)
    stream: bool = False
    prompt_logprobs: int | None = Field(
        default=None, ge=0, le=20, description="each prompt token's logprob and the top k (at most MAX_LOGPROBS)"
    )
    # Structured output (at most one): the text is constrained to the grammar (docs/api.md, "Structured output").
    json_schema: dict | bool | None = Field(default=None, description="the output is JSON valid under this schema")
    regex: str | None = Field(default=None, min_length=1, description="the output matches this regex")
    choice: list[str] | None = Field(default=None, min_length=1, max_length=256, description="the output is one of")

    @model_validator(mode="after")
    def _one_grammar(self):
        if sum(x is not None for x in (self.json_schema, self.regex, self.choice)) > 1:
            raise ValueError("give at most one of `json_schema`, `regex` and `choice`")
        return self

    @field_validator("prompt", "request_id")
    @classmethod
    def _unicode(cls, value):
        return _valid_unicode(value)


class LoadLoraAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body): serve the PEFT adapter in directory ``lora_path`` as
    ``lora_name``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = Field(default=False, description="replace a loaded adapter of this name (not supported)")


class UnloadLoraAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = Field(default=None, description="vLLM's id of the adapter: ignored, the name decides")


class StreamOptions(BaseModel):
    # include_obfuscation (OpenAI pads stream events against side channels) does not change the text.
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


# --- what a /v1 request may carry ------------------------------------------------------------------
# Every field of OpenAI's request types is declared: implemented (typed fields below), ignored because it
# cannot change the output (IGNORED_FIELDS), or not implemented here (REFUSED_FIELDS: a value that means
# "not used" is accepted, anything else gets a 400 naming the field, from ``unsupported()``). Fields
# OpenAI does not define are ignored (clients send new ones; see ``unknown_fields()``), and logged.
IGNORED_FIELDS = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "parallel_tool_calls",  # auto may answer several calls; required/named answers one
)


def _unused(value) -> bool:
    return value is None or value == [] or value == {} or value == ""


# field -> (is the value one that means "not used"?, what to say when it is not)
REFUSED_FIELDS = {
    "suffix": (_unused, "`suffix` (insertion) is not supported"),
    "functions": (_unused, "`functions` (function calling) is not supported"),
    "function_call": (lambda v: _unused(v) or v == "none", "`function_call` is not supported"),
    # Implemented on /v1/chat/completions (typed fields there), refused on /v1/completions.
    "tools": (_unused, "`tools` (tool calling) is only supported on /v1/chat/completions"),
    "tool_choice": (lambda v: _unused(v) or v in ("none", "auto"), "`tool_choice` needs /v1/chat/completions"),
    "modalities": (lambda v: _unused(v) or v == ["text"], '`modalities` other than ["text"] are not supported'),
    "audio": (_unused, "`audio` output is not supported"),
    "prediction": (_unused, "`prediction` (predicted outputs) is not supported"),
    "web_search_options": (_unused, "`web_search_options` is not supported"),
    "reasoning_effort": (_unused, "`reasoning_effort` is not supported (the model does not reason)"),
    "verbosity": (_unused, "`verbosity` is not supported"),
    "moderation": (_unused, "`moderation` is not supported"),
}
_KNOWN_V1 = {
    *IGNORED_FIELDS,
    *REFUSED_FIELDS,
    "n",
    "best_of",
    "stream_options",
}


class V1Fields(SamplingFields):
    """A /v1 request: our sampling extensions, OpenAI's fields in three groups (``refused_fields``,
    ``known_fields``, the typed ones), and fields OpenAI does not define, kept aside (``model_extra``)."""

    model_config = ConfigDict(extra="allow", strict=True)
    refused_fields: ClassVar[dict] = REFUSED_FIELDS
    known_fields: ClassVar[set] = _KNOWN_V1

    def unsupported(self) -> tuple[str, str] | None:
        """The first field this request uses that the server does not implement: (name, message)."""
        extra = self.model_extra or {}
        for name, (unused, message) in self.refused_fields.items():
            if name in extra and not unused(extra[name]):
                return name, message
        return None

    def unknown_fields(self) -> list[str]:
        """Fields OpenAI's API does not define either: ignored (and logged by the caller)."""
        return sorted(set(self.model_extra or {}) - self.known_fields)


class OpenAIFields(V1Fields):
    """Fields common to /v1/completions and /v1/chat/completions (see REFUSED_FIELDS above)."""

    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, allow_inf_nan=False)  # OpenAI's default
    max_tokens: int | None = Field(default=None, ge=1)
    n: int | None = Field(default=None, ge=1, description="choices per prompt, at most MAX_N")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # {"type": "text" | "json_object" | "json_schema", ...}: checked and compiled by guided/grammars.py
    response_format: dict | None = None


class CompletionRequest(OpenAIFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a text, a list of texts, a list of token ids, or a list of token-id lists; "
        "several prompts give one choice each (at most MAX_PROMPTS_PER_REQUEST)"
    )
    max_tokens: int | None = Field(default=None, ge=0, description="0 (with echo): score the prompt, generate nothing")
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, description="only equal to n (no ranking of extra choices)")

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value):
        if value == "" or value == []:
            raise ValueError("must not be empty")
        if isinstance(value, list) and any(item == "" or item == [] for item in value):
            raise ValueError("every prompt in the list must be non-empty")
        return _valid_unicode(value)

    def unsupported(self) -> tuple[str, str] | None:
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of", f"`best_of` other than n is not supported (got {self.best_of}, n {self.n or 1})"
        return super().unsupported()


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(max_length=100_000, description="the arguments as JSON text")


class ToolCall(BaseModel):
    """A tool call in an assistant message of the history (as the API answered it)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = Field(default=None, description="a JSON schema of the arguments (an object)")
    strict: bool | None = None  # calls under tool_choice required/named always follow the schema


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class ContentPart(BaseModel):
    """One part of a message's content. Only text is implemented; the other OpenAI part types
    (``image_url``, ``input_audio``, ``file``, ``refusal``) are answered with a 400."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, max_length=256)  # given to the chat template
    # Tool calling history (tool_calls on an assistant message, tool messages); function calling (the
    # deprecated form) and audio are not implemented: non-null -> 400.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)
    function_call: dict | None = None
    audio: dict | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _content_required(self):
        if self.content is None and self.role != "assistant":  # OpenAI: only an assistant's may be absent
            raise ValueError(f"a `{self.role}` message needs `content`")
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content or [])

    def template_dict(self) -> dict:
        """What the chat template sees: role, content and, if given, name, tool_calls and tool_call_id."""
        out = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            from guided.tools import history_tool_calls

            out["tool_calls"] = history_tool_calls([c.model_dump() for c in self.tool_calls])
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    @property
    def uses_tools(self) -> bool:
        return self.role == "tool" or bool(self.tool_calls)

    def unsupported(self, where: str) -> tuple[str, str] | None:
        """The first thing in this message the server does not implement: (param, message)."""
        if self.role == "function":
            return f"{where}.role", "messages with role `function` are not supported (use `tools` and role `tool`)"
        if self.tool_calls and self.role != "assistant":
            return f"{where}.tool_calls", "only an assistant message may carry `tool_calls`"
        for name in ("function_call", "audio", "refusal"):
            if not _unused(getattr(self, name)):
                return f"{where}.{name}", f"`{name}` in a message is not supported"
        for j, part in enumerate(self.content if isinstance(self.content, list) else []):
            if part.type != "text":
                return f"{where}.content.{j}.type", f"content parts of type `{part.type}` are not supported (text only)"
            if part.text is None:
                return f"{where}.content.{j}.text", "a text content part needs `text`"
        return None


class ChatCompletionRequest(OpenAIFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: str | dict | None = None

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, value):
        names = [t.function.name for t in value or []]
        if len(set(names)) != len(names):
            raise ValueError("function names must be unique")
        return value

    @field_validator("messages")
    @classmethod
    def _unicode_messages(cls, value):
        _valid_unicode([m.text() for m in value] + [m.name for m in value if m.name])
        return value

    def unsupported(self) -> tuple[str, str] | None:
        for i, message in enumerate(self.messages):
            found = message.unsupported(f"messages.{i}")
            if found is not None:
                return found
        return super().unsupported()


# /v1/responses: its own fields beside the sampling ones; it is stateless (api/openai/responses.py).
STATELESS = "this server is stateless: it stores no responses or conversations; send the whole conversation in `input`"
RESPONSES_REFUSED = {
    "previous_response_id": (_unused, f"`previous_response_id`: {STATELESS}"),
    "conversation": (_unused, f"`conversation`: {STATELESS}"),
    "background": (lambda v: _unused(v) or v is False, "`background` responses are not supported (nothing is stored)"),
    "prompt": (_unused, "`prompt` (stored prompt templates) is not supported"),
    "include": (_unused, "`include` is not supported (the answer carries no extra data)"),
    "reasoning": (lambda v: _unused(v) or v == {"effort": None}, "`reasoning` is not supported (no reasoning model)"),
    "truncation": (lambda v: _unused(v) or v == "disabled", '`truncation` other than "disabled" is not supported'),
    "max_tool_calls": (_unused, "`max_tool_calls` is not supported"),
    "top_logprobs": (lambda v: _unused(v) or v == 0, "`top_logprobs` is not supported on /v1/responses"),
    "context_management": (_unused, "`context_management` is not supported"),
}
_KNOWN_RESPONSES = {*IGNORED_FIELDS, *RESPONSES_REFUSED, "stream_options"}


class ResponsesRequest(V1Fields):
    """``POST /v1/responses``. ``input``, ``text``, ``tools`` and ``tool_choice`` are checked item by item where
    they are translated (api/openai/responses.py), so an error names the exact place (``input.3.call_id``)."""

    refused_fields: ClassVar[dict] = RESPONSES_REFUSED
    known_fields: ClassVar[set] = _KNOWN_RESPONSES

    model: str | None = None
    input: str | list[dict] = Field(description="a text (one user message), or input items")
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, allow_inf_nan=False)  # OpenAI's default
    text: dict | None = None
    tools: list[dict] | None = Field(default=None, max_length=128)
    tool_choice: str | dict | None = None
    stream: bool = False
    store: bool | None = None  # accepted (OpenAI's default is true); nothing is stored

    @field_validator("input", "instructions")
    @classmethod
    def _unicode(cls, value):
        if value == "" or value == []:
            raise ValueError("must not be empty")
        return _valid_unicode(value)


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``: one vector per input (api/openai/embeddings.py)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a text, a list of texts, a list of token ids, or a list of token-id lists"
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, description="only the model's own width")
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, value):
        if value == "" or value == []:
            raise ValueError("must not be empty")
        if isinstance(value, list) and any(item == "" or item == [] for item in value):
            raise ValueError("every input in the list must be non-empty")
        return _valid_unicode(value)


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): a ``prompt``, or chat ``messages`` rendered through the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = Field(
        default=None, description="default: true for a prompt, false for messages (the template holds them)"
    )
    add_generation_prompt: bool = Field(default=True, description="only true (the prompt ends where the answer begins)")
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        _valid_unicode([self.prompt or ""] + [m.text() for m in self.messages or []])
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens found in the prefix cache (not computed)


class OpenAIUsage(Usage):
    prompt_tokens_details: PromptTokensDetails


class Metrics(BaseModel):
    queue_wait_ms: float  # arrival -> admitted into the batch
    ttft_ms: float  # arrival -> first token
    generate_ms: float  # admitted -> finished
    e2e_ms: float  # arrival -> finished


class TokenLogprob(BaseModel):
    token_id: int
    logprob: float


class PromptTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]  # the k most likely tokens at this position, most likely first


class GenerateResponse(BaseModel):
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length"]
    usage: Usage
    metrics: Metrics
    # With prompt_logprobs: one entry per prompt token, the first null (nothing precedes it).
    prompt_logprobs: list[PromptTokenLogprob | None] | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None  # OpenAI's: a string naming the error, or null (api.errors.error_code)


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
