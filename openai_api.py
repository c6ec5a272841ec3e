"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Only translation lives here: OpenAI request -> Sequence (through ``serving.make_sequence``),
Generation output -> OpenAI response or ``chat.completion.chunk`` / ``text_completion``
server-sent events (through ``streaming.py``). Errors use OpenAI's body shape. No torch.
"""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import APIRouter, Depends, Request

from api_errors import APIError
from generation import Chunk
from schemas import ChatCompletionRequest, CompletionRequest, ErrorResponse, OpenAIFields
from sequence import Sequence
from serving import (
    Runtime,
    check_max_tokens,
    check_token_ids,
    current_runtime,
    detokenize,
    make_sequence,
    render_chat,
    start_generation,
    tokenize,
)
from streaming import Frames, run_to_completion, sse_response, usage

log = logging.getLogger("minibatch.api")
_CREATED = int(time.time())
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 422, 500, 503, 504)}

router = APIRouter(prefix="/v1")


@router.get("/models")
async def models(runtime: Runtime = Depends(current_runtime)) -> dict:
    return {
        "object": "list",
        "data": [
            {
                "id": runtime.config.model_name,
                "object": "model",
                "created": _CREATED,
                "owned_by": "minibatch-llm",
                "max_model_len": runtime.engine.max_context,
            }
        ],
    }


@router.post("/completions", responses=_ERRORS)
async def completions(req: CompletionRequest, request: Request, runtime: Runtime = Depends(current_runtime)):
    name = check_fields(runtime, req)
    if req.echo and req.logprobs is not None:
        raise APIError(422, "echo together with logprobs is not supported", param="echo")
    max_tokens = check_max_tokens(runtime, req.max_tokens or 16, "max_tokens")
    if isinstance(req.prompt, list) and isinstance(req.prompt[0], int):
        prompt_ids = check_token_ids(runtime, req.prompt)
        prompt_text = await detokenize(runtime, prompt_ids) if req.echo else ""
    else:
        prompt_text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
        prompt_ids = await tokenize(runtime, prompt_text)
    rid = f"cmpl-{uuid.uuid4().hex}"
    gen = start_generation(runtime, make_sequence(runtime, prompt_ids, max_tokens, req, rid, req.logprobs), req.stop)
    echo = prompt_text if req.echo else ""
    if req.stream:
        return sse_response(gen, request, CompletionFrames(runtime, gen.seq, name, echo, include_usage(req)))
    done = await run_to_completion(gen, request)
    logprobs = completion_logprobs(runtime, done.output_logprobs, len(echo)) if req.logprobs is not None else None
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": name,
        "choices": [{"index": 0, "text": echo + gen.text, "logprobs": logprobs, "finish_reason": done.finish_reason}],
        "usage": usage(done).model_dump(),
    }


@router.post("/chat/completions", responses=_ERRORS)
async def chat_completions(req: ChatCompletionRequest, request: Request, runtime: Runtime = Depends(current_runtime)):
    name = check_fields(runtime, req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(422, "top_logprobs requires logprobs: true", param="top_logprobs")
    asked = req.max_completion_tokens or req.max_tokens
    if asked:
        check_max_tokens(runtime, asked, "max_completion_tokens")
    prompt_text = await render_chat(runtime, [m.template_dict() for m in req.messages])
    prompt_ids = await tokenize(runtime, prompt_text, add_special_tokens=False)  # the template holds them
    room = max(1, runtime.engine.max_context - len(prompt_ids))
    max_tokens = asked or min(room, runtime.config.max_new_tokens_limit)
    k = (req.top_logprobs or 0) if req.logprobs else None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    gen = start_generation(runtime, make_sequence(runtime, prompt_ids, max_tokens, req, rid, k), req.stop)
    if req.stream:
        return sse_response(gen, request, ChatFrames(runtime, gen.seq, name, include_usage(req)))
    done = await run_to_completion(gen, request)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": gen.text},
                "logprobs": chat_logprobs(runtime, done.output_logprobs) if k is not None else None,
                "finish_reason": done.finish_reason,
            }
        ],
        "usage": usage(done).model_dump(),
    }


# --- request checks ------------------------------------------------------------------------------
_logged_unknown: set[str] = set()


def check_fields(runtime: Runtime, req: OpenAIFields) -> str:
    """The model name, after refusing (400) what the request asks for that is not implemented, and
    logging (once per name) fields OpenAI does not define, which are ignored."""
    name = check_model(runtime, req.model)
    found = req.unsupported()
    if found is not None:
        param, message = found
        raise APIError(400, message, param=param)
    new = [f for f in req.unknown_fields() if f not in _logged_unknown]
    if new and len(_logged_unknown) < 1000:  # bounded: clients choose these names
        _logged_unknown.update(new)
        log.warning("ignoring request fields OpenAI's API does not define: %s", ", ".join(f[:64] for f in new[:20]))
    return name


def check_model(runtime: Runtime, model: str | None) -> str:
    name = runtime.config.model_name
    if model is not None and model != name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{name}`", param="model")
    return name


def include_usage(req: OpenAIFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


# --- logprobs in OpenAI's two formats ------------------------------------------------------------
def completion_logprobs(runtime: Runtime, lps: list, text_offset: int) -> dict:
    """Legacy completions format: parallel lists of tokens, logprobs, top alternatives, offsets."""
    decode = runtime.engine.decode
    tokens = [decode([lp.token_id]) for lp in lps]
    offsets = []
    for tok in tokens:
        offsets.append(text_offset)
        text_offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{decode([t]): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(runtime: Runtime, lps: list) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = runtime.engine.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]
    }


# --- stream frames -------------------------------------------------------------------------------
class OpenAIFrames(Frames):
    """What both /v1 streams share: every event carries id/object/created/model, one choice; the
    closing events are the final choice (finish_reason set) and, if asked, a usage event."""

    object = ""

    def __init__(self, runtime: Runtime, seq: Sequence, model: str, with_usage: bool) -> None:
        self.runtime = runtime
        self.wants_logprobs = seq.logprobs is not None
        self.with_usage = with_usage
        self.base = {"id": seq.request_id, "object": self.object, "created": int(time.time()), "model": model}

    def choice(self, text: str, chunk: Chunk | None, finish: str | None) -> dict:
        raise NotImplementedError

    def text(self, chunk: Chunk) -> dict | None:
        if not (chunk.text or chunk.logprobs):  # tokens with no text of their own still carry their logprobs
            return None
        return {**self.base, "choices": [self.choice(chunk.text, chunk, None)]}

    def closing(self, seq: Sequence, rest: str) -> list[dict]:
        events = [{**self.base, "choices": [self.choice(rest, None, seq.finish_reason)]}]
        if self.with_usage:
            events.append({**self.base, "choices": [], "usage": usage(seq).model_dump()})
        return events


class CompletionFrames(OpenAIFrames):
    object = "text_completion"

    def __init__(self, runtime: Runtime, seq: Sequence, model: str, echo: str, with_usage: bool) -> None:
        super().__init__(runtime, seq, model, with_usage)
        self.echo = echo
        self.offset = len(echo)  # text_offset counts from the start of the whole text, as in the non-streamed answer

    def opening(self) -> list[dict]:
        if not self.echo:
            return []
        return [{**self.base, "choices": [{"index": 0, "text": self.echo, "logprobs": None, "finish_reason": None}]}]

    def choice(self, text: str, chunk: Chunk | None, finish: str | None) -> dict:
        lp = None
        if self.wants_logprobs and chunk is not None:
            lp = completion_logprobs(self.runtime, chunk.logprobs, self.offset)
            self.offset += sum(len(tok) for tok in lp["tokens"])
        return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}


class ChatFrames(OpenAIFrames):
    object = "chat.completion.chunk"

    def opening(self) -> list[dict]:
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [{**self.base, "choices": [first]}]

    def choice(self, text: str, chunk: Chunk | None, finish: str | None) -> dict:
        lp = chat_logprobs(self.runtime, chunk.logprobs) if self.wants_logprobs and chunk is not None else None
        delta = {"content": text} if text or finish is None else {}
        return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
