"""``POST /v1/completions``: OpenAI's legacy completions (a text, texts, token ids or lists of them; ``n``
choices each; ``echo``, ``logprobs``, scoring a prompt with ``max_tokens: 0``), answered whole or as
``text_completion`` events. Only translation lives here. No torch."""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import contextmanager

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from api.errors import APIError, field_errors
from api.openai.fields import ERRORS, check_fields, check_n, choice_fields, include_usage, openai_usage
from api.openai.frames import CompletionFrames
from api.openai.logprobs import completion_logprobs, join_logprobs, prompt_logprobs
from api.serving import (
    Runtime,
    attach_grammar,
    check_max_tokens,
    check_sequence_count,
    check_token_ids,
    current_runtime,
    detokenize,
    make_sequence,
    start_generations,
    tokenize,
)
from api.streaming import json_answer, run_all, sse_response
from core.sequence import Sequence
from guided.grammars import response_format_grammar
from schemas import CompletionRequest

router = APIRouter(prefix="/v1")


@router.post("/completions", responses=ERRORS)
async def completions(req: CompletionRequest, request: Request, runtime: Runtime = Depends(current_runtime)):
    name = check_fields(runtime, req)
    # max_tokens 0 with echo scores the prompt without generating (evaluation harnesses' loglikelihood):
    # one token is generated, as every admission does, and dropped from the answer.
    score_only = req.max_tokens == 0
    if score_only and not req.echo:
        raise APIError(422, "max_tokens 0 needs echo: true (it returns the prompt, scored)", param="max_tokens")
    max_tokens = 1 if score_only else check_max_tokens(runtime, req.max_tokens or 16, "max_tokens")
    prompt_k = req.logprobs if req.echo else None  # echo + logprobs: the prompt's logprobs too
    n = check_n(runtime, req)
    prompts = await completion_prompts(runtime, req.prompt, req.echo, n)
    rid = f"cmpl-{uuid.uuid4().hex}"
    seqs = []
    for i, (ids, _) in enumerate(prompts):  # every prompt is checked before any is queued
        with prompt_errors(i, len(prompts)):
            for j in range(n):  # choice index i * n + j, as OpenAI and vLLM number them
                seq_id = rid if len(prompts) * n == 1 else f"{rid}-{i * n + j}"  # a label for the logs
                fields = choice_fields(req, j)
                seqs.append(make_sequence(runtime, ids, max_tokens, fields, seq_id, req.logprobs, prompt_k, name))
    if not score_only:
        with field_errors():
            grammar = response_format_grammar(req.response_format)
        await attach_grammar(runtime, seqs, grammar, "response_format")
    gens = start_generations(runtime, seqs, req.stop, n, request)
    echoes = [text for _, text in prompts for _ in range(n)]
    if req.stream:
        frames = CompletionFrames(
            runtime, rid, name, echoes, seqs, req.logprobs is not None, include_usage(req), score_only=score_only, n=n
        )
        return sse_response(gens, request, frames)
    done = await run_all(gens, request)
    texts = [gen.text for gen in gens]
    # Off the loop: a scored answer can name 500,000 tokens (MAX_LOGPROB_ENTRIES), ~13 MB of JSON.
    return await runtime.off_loop(completion_answer, runtime, req, rid, name, done, texts, echoes, n)


def completion_answer(
    runtime: Runtime,
    req: CompletionRequest,
    rid: str,
    name: str,
    done: list[Sequence],
    texts: list[str],
    echoes: list[str],
    n: int,
) -> Response:
    """The whole ``text_completion`` answer over the finished sequences, encoded (``json_answer``). Any thread."""
    score_only = req.max_tokens == 0
    choices = []
    for i, (seq, generated, echo) in enumerate(zip(done, texts, echoes)):
        text = echo if score_only else echo + generated
        lps = None
        if req.logprobs is not None:
            lps = completion_logprobs(runtime, [] if score_only else seq.output_logprobs, len(echo))
            if req.echo:
                lps = join_logprobs(prompt_logprobs(runtime, seq), lps)
        finish = "length" if score_only else seq.finish_reason  # the budget, 0, was reached
        choices.append({"index": i, "text": text, "logprobs": lps, "finish_reason": finish})
    return json_answer(
        {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
            "system_fingerprint": runtime.fingerprint,
            "choices": choices,
            "usage": openai_usage(done, n, count_output=not score_only),
        }
    )


async def completion_prompts(runtime: Runtime, prompt, echo: bool, n: int = 1) -> list[tuple[list[int], str]]:
    """Each prompt of a completions request as (token ids, the text ``echo`` prepends: "" without it).
    ``prompt`` is a text, a list of texts, a list of token ids or a list of such lists (OpenAI's four
    forms), ``n`` choices each. Every prompt is checked (the count first, and MAX_SEQUENCES_PER_REQUEST, then each
    one, tokenized concurrently off the loop); the first bad one, in order, fails the whole request before anything
    is queued."""
    several = not (isinstance(prompt, str) or isinstance(prompt[0], int))
    items = prompt if several else [prompt]
    limit = runtime.config.max_prompts_per_request
    if len(items) > limit:
        raise APIError(
            422,
            f"{len(items)} prompts in one request; the limit is {limit} (MAX_PROMPTS_PER_REQUEST)",
            param="prompt",
            reason="too_large",
        )
    check_sequence_count(runtime, len(items) * n, "prompt" if n == 1 else "n")

    async def one(i: int, item: str | list[int]) -> tuple[list[int], str]:
        with prompt_errors(i, len(items)):
            if isinstance(item, str):
                return await tokenize(runtime, item), (item if echo else "")
            ids = check_token_ids(runtime, item)
            return ids, (await detokenize(runtime, ids) if echo else "")

    results = await asyncio.gather(*(one(i, item) for i, item in enumerate(items)), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


@contextmanager
def prompt_errors(i: int, n: int):
    """With several prompts, an error about one says which (``prompt 2: ...``)."""
    try:
        yield
    except APIError as exc:
        if n > 1:
            exc.message = f"prompt {i}: {exc.message}"
        raise
