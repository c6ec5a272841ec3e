"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Only translation lives here: OpenAI request -> Sequence (through ``server.make_sequence``),
Generation output -> OpenAI response or ``chat.completion.chunk`` / ``text_completion``
server-sent events. Errors use OpenAI's body shape. No torch.
"""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Request

from engine import ChatTemplateError
from ops import check_prompt_chars
from generation import Chunk, Generation
from schemas import ChatCompletionRequest, CompletionRequest, ErrorResponse, OpenAIFields
from http_common import (
    APIError,
    ServerState,
    check_finished,
    disconnect_future,
    error_body,
    error_response,
    failure,
    make_sequence,
    sse,
    sse_response,
    start_generation,
    usage,
)

_CREATED = int(time.time())
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 422, 500, 503, 504)}


def openai_router(state: Callable[[], ServerState]) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models() -> dict:
        st = state()
        return {
            "object": "list",
            "data": [{
                "id": st.config.model_name, "object": "model", "created": _CREATED, "owned_by": "minibatch-llm",
                "max_model_len": st.engine.max_context,
            }],
        }

    @router.post("/completions", responses=_ERRORS)
    async def completions(req: CompletionRequest, request: Request):
        st = state()
        name = check_model(st, req.model)
        if req.echo and req.logprobs is not None:
            raise APIError(422, "echo together with logprobs is not supported", param="echo")
        if isinstance(req.prompt, list) and isinstance(req.prompt[0], int):
            prompt_ids = check_token_ids(st, req.prompt)
            prompt_text = st.engine.decode(prompt_ids)
        else:
            prompt_text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
            prompt_ids = st.engine.encode(check_prompt_chars(st, prompt_text))
        max_tokens = check_max_tokens(st, req.max_tokens or 16, "max_tokens")
        rid = f"cmpl-{uuid.uuid4().hex}"
        gen = start_generation(st, make_sequence(st, prompt_ids, max_tokens, req, rid, req.logprobs), req.stop)
        echo = prompt_text if req.echo else ""
        if req.stream:
            return sse_response(completion_events(st, gen, request, name, echo, include_usage(req)))
        done = await gen.result(disconnect_future(request))
        if done is None:
            return error_response(499, "client disconnected", "cancelled")
        check_finished(done)
        gen.final_text()
        logprobs = completion_logprobs(st, done.output_logprobs, len(echo)) if req.logprobs is not None else None
        return {
            "id": rid, "object": "text_completion", "created": int(time.time()), "model": name,
            "choices": [{"index": 0, "text": echo + gen.text, "logprobs": logprobs, "finish_reason": done.finish_reason}],
            "usage": usage(done).model_dump(),
        }

    @router.post("/chat/completions", responses=_ERRORS)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        st = state()
        name = check_model(st, req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt_text = st.engine.apply_chat_template(messages)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        prompt_ids = st.engine.encode(check_prompt_chars(st, prompt_text), add_special_tokens=False)  # the template holds them
        room = max(1, st.engine.max_context - len(prompt_ids))
        asked = req.max_completion_tokens or req.max_tokens
        max_tokens = check_max_tokens(st, asked, "max_completion_tokens") if asked else min(room, st.config.max_new_tokens_limit)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(422, "top_logprobs requires logprobs: true", param="top_logprobs")
        k = (req.top_logprobs or 0) if req.logprobs else None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = start_generation(st, make_sequence(st, prompt_ids, max_tokens, req, rid, k), req.stop)
        if req.stream:
            return sse_response(chat_events(st, gen, request, name, include_usage(req)))
        done = await gen.result(disconnect_future(request))
        if done is None:
            return error_response(499, "client disconnected", "cancelled")
        check_finished(done)
        gen.final_text()
        return {
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": name,
            "choices": [{
                "index": 0, "message": {"role": "assistant", "content": gen.text},
                "logprobs": chat_logprobs(st, done.output_logprobs) if k is not None else None,
                "finish_reason": done.finish_reason,
            }],
            "usage": usage(done).model_dump(),
        }

    return router


# --- request checks ------------------------------------------------------------------------------
def check_model(st: ServerState, model: str | None) -> str:
    name = st.config.model_name
    if model is not None and model != name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{name}`", param="model")
    return name


def check_max_tokens(st: ServerState, n: int, param: str) -> int:
    limit = st.config.max_new_tokens_limit
    if not 1 <= n <= limit:
        raise APIError(422, f"{param} must be in [1, {limit}] (got {n})", param=param)
    return n


def check_token_ids(st: ServerState, ids: list[int]) -> list[int]:
    vocab = st.engine.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(422, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
    return ids


def include_usage(req: OpenAIFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


# --- logprobs in OpenAI's two formats ------------------------------------------------------------
def completion_logprobs(st: ServerState, lps: list, text_offset: int) -> dict:
    """Legacy completions format: parallel lists of tokens, logprobs, top alternatives, offsets."""
    tokens = [st.engine.decode([lp.token_id]) for lp in lps]
    offsets = []
    for tok in tokens:
        offsets.append(text_offset)
        text_offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{st.engine.decode([t]): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(st: ServerState, lps: list) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = st.engine.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
    ]}


# --- streams -------------------------------------------------------------------------------------
async def openai_events(
    st: ServerState, gen: Generation, request: Request, frame: Callable[[str, Chunk | None, str | None], dict],
    first: dict | None, with_usage: bool, base: dict,
) -> AsyncIterator[str]:
    """The SSE skeleton both endpoints share: optional first frame, a frame per text chunk, a
    final frame with finish_reason, an optional usage frame, then [DONE]; errors as OpenAI error bodies."""
    disconnected = disconnect_future(request)
    try:
        if first is not None:
            yield sse({**base, "choices": [first]})
        async for chunk in gen.stream(disconnected):
            if chunk.text or chunk.logprobs:  # tokens with no text of their own still carry their logprobs
                yield sse({**base, "choices": [frame(chunk.text, chunk, None)]})
        if disconnected.done():
            return
        error = failure(gen.seq)
        if error is not None:
            yield sse(error_body(error.status, error.message, error.kind))
        else:
            yield sse({**base, "choices": [frame(gen.final_text(), None, gen.seq.finish_reason)]})
            if with_usage:
                yield sse({**base, "choices": [], "usage": usage(gen.seq).model_dump()})
        yield sse("[DONE]")
    finally:
        disconnected.cancel()


def completion_events(st, gen: Generation, request: Request, name: str, echo: str, with_usage: bool):
    base = {"id": gen.seq.request_id, "object": "text_completion", "created": int(time.time()), "model": name}
    wants_logprobs = gen.seq.logprobs is not None
    offset = len(echo)  # text_offset counts from the start of the whole text, as in the non-streamed answer

    def frame(text: str, chunk: Chunk | None, finish: str | None) -> dict:
        nonlocal offset
        lp = None
        if wants_logprobs and chunk is not None:
            lp = completion_logprobs(st, chunk.logprobs, offset)
            offset += sum(len(tok) for tok in lp["tokens"])
        return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}

    first = {"index": 0, "text": echo, "logprobs": None, "finish_reason": None} if echo else None
    return openai_events(st, gen, request, frame, first, with_usage, base)


def chat_events(st, gen: Generation, request: Request, name: str, with_usage: bool):
    base = {"id": gen.seq.request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": name}
    wants_logprobs = gen.seq.logprobs is not None

    def frame(text: str, chunk: Chunk | None, finish: str | None) -> dict:
        lp = chat_logprobs(st, chunk.logprobs) if wants_logprobs and chunk is not None else None
        delta = {"content": text} if text or finish is None else {}
        return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}

    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return openai_events(st, gen, request, frame, first, with_usage, base)
