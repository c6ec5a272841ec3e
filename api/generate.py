"""``POST /generate``: our own API (text or token ids in, text and token ids out, optionally as server-sent
events). Only translation lives here; the path to a running generation is ``api/serving.py``'s,
the answer's is ``api/streaming.py``'s. No torch."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request

from api.errors import field_errors
from api.serving import (
    Runtime,
    attach_grammar,
    check_max_tokens,
    check_model,
    check_token_ids,
    current_runtime,
    make_sequence,
    start_generation,
    tokenize,
)
from api.streaming import Frames, run_to_completion, sse_response, usage
from core.generation import Chunk
from core.sequence import Sequence
from guided.grammars import generate_grammar
from schemas import ErrorResponse, GenerateRequest, GenerateResponse, Metrics

router = APIRouter()


@router.post(
    "/generate",
    response_model=GenerateResponse,
    response_model_exclude_none=True,  # prompt_logprobs only when asked for
    responses={code: {"model": ErrorResponse} for code in (400, 404, 422, 500, 503, 504)},
)
async def generate(req: GenerateRequest, request: Request, runtime: Runtime = Depends(current_runtime)):
    model = check_model(runtime, req.model)  # a LoRA adapter's name, or the base model's (None: the base)
    max_new_tokens = check_max_tokens(runtime, req.max_new_tokens, "max_new_tokens")
    if isinstance(req.prompt, list):
        prompt_ids = check_token_ids(runtime, req.prompt)
    else:
        prompt_ids = await tokenize(runtime, req.prompt)
    request_id = req.request_id or f"req-{uuid.uuid4().hex}"
    seq = make_sequence(
        runtime, prompt_ids, max_new_tokens, req, request_id, prompt_logprobs=req.prompt_logprobs, model=model
    )
    with field_errors():
        grammar, param = generate_grammar(req.json_schema, req.regex, req.choice)
    await attach_grammar(runtime, [seq], grammar, param)
    gen = start_generation(runtime, seq, req.stop, request)
    if req.stream:
        return sse_response([gen], request, GenerateFrames(request_id))
    done = await run_to_completion(gen, request)
    return GenerateResponse(
        request_id=done.request_id,
        text=gen.text,
        token_ids=done.output_token_ids,
        finish_reason=done.finish_reason,
        usage=usage(done),
        metrics=Metrics(**done.metrics_ms()),
        prompt_logprobs=prompt_logprobs(done),
    )


def prompt_logprobs(seq: Sequence) -> list[dict | None] | None:
    """The sequence's prompt logprobs in /generate's shape (None if it did not ask for them)."""
    if seq.prompt_logprobs_k is None:
        return None
    return [
        None
        if lp is None
        else {
            "token_id": lp.token_id,
            "logprob": lp.logprob,
            "top_logprobs": [{"token_id": t, "logprob": v} for t, v in lp.top],
        }
        for lp in seq.prompt_logprobs
    ]


class GenerateFrames(Frames):
    """An event per step that produces text or tokens, then one final event with the totals."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def text(self, i: int, chunk: Chunk) -> dict | None:
        if not (chunk.text or chunk.token_ids):  # a token with no text of its own (EOS) still counts
            return None
        return {"request_id": self.request_id, "text": chunk.text, "token_ids": chunk.token_ids}

    def closing(self, i: int, seq: Sequence, rest: str) -> list[dict]:
        return [
            {
                "request_id": self.request_id,
                "text": rest,
                "token_ids": [],
                "finish_reason": seq.finish_reason,
                "usage": usage(seq).model_dump(),
                "metrics": seq.metrics_ms(),
                **({"prompt_logprobs": prompt_logprobs(seq)} if seq.prompt_logprobs_k is not None else {}),
            }
        ]
