"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer over HTTP, in vLLM's
request and response shapes (a client counts tokens, or checks what a chat template makes of its
messages, before sending). Behind ``API_KEY`` like the generating endpoints; the tokenizer runs in
the tokenizer pool, off the event loop (``api/serving.py``). No torch."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from api.errors import APIError
from api.openai.models import check_model
from api.serving import Runtime, chat_prompt_ids, current_runtime, detokenize, render_chat, tokenize
from schemas import DetokenizeRequest, DetokenizeResponse, ErrorResponse, TokenizeRequest, TokenizeResponse

router = APIRouter()
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 422, 503)}


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
async def tokenize_endpoint(req: TokenizeRequest, runtime: Runtime = Depends(current_runtime)) -> TokenizeResponse:
    check_model(runtime, req.model)
    if req.messages is not None:
        if not req.add_generation_prompt:
            raise APIError(400, "`add_generation_prompt: false` is not supported", param="add_generation_prompt")
        for i, message in enumerate(req.messages):
            found = message.unsupported(f"messages.{i}")
            if found is not None:
                raise APIError(400, found[1], param=found[0])
        messages = [m.template_dict() for m in req.messages]
        if req.add_special_tokens:  # the tokenizer's BOS/EOS around the rendered text (false by default)
            prompt = await render_chat(runtime, messages)
            ids = await tokenize(runtime, prompt.text, add_special_tokens=True)
        else:  # what /v1/chat/completions feeds the model
            ids = await chat_prompt_ids(runtime, messages)
    else:
        ids = await tokenize(runtime, req.prompt, add_special_tokens=req.add_special_tokens is not False)
    strs = await runtime.off_loop(_token_strs, runtime, ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=runtime.engine.max_context, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
async def detokenize_endpoint(
    req: DetokenizeRequest, runtime: Runtime = Depends(current_runtime)
) -> DetokenizeResponse:
    check_model(runtime, req.model)
    vocab = runtime.engine.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(422, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=await detokenize(runtime, req.tokens))


def _token_strs(runtime: Runtime, ids: list[int]) -> list[str]:
    """Each token's own text (a token that is part of a multi-byte character decodes to U+FFFD)."""
    return [runtime.token_text(t) for t in ids]
