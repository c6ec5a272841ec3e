"""``POST /generate``: our own API (text in, text and token ids out, optionally as server-sent
events). Only translation lives here; the path to a running generation is ``serving.py``'s,
the answer's is ``streaming.py``'s. No torch."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request

from generation import Chunk
from schemas import ErrorResponse, GenerateRequest, GenerateResponse, Metrics
from sequence import Sequence
from serving import Runtime, check_max_tokens, current_runtime, make_sequence, start_generation, tokenize
from streaming import Frames, run_to_completion, sse_response, usage

router = APIRouter()


@router.post(
    "/generate",
    response_model=GenerateResponse,
    responses={code: {"model": ErrorResponse} for code in (422, 500, 503, 504)},
)
async def generate(req: GenerateRequest, request: Request, runtime: Runtime = Depends(current_runtime)):
    max_new_tokens = check_max_tokens(runtime, req.max_new_tokens, "max_new_tokens")
    prompt_ids = await tokenize(runtime, req.prompt)
    request_id = req.request_id or f"req-{uuid.uuid4().hex}"
    gen = start_generation(runtime, make_sequence(runtime, prompt_ids, max_new_tokens, req, request_id), req.stop)
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
    )


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
            }
        ]
