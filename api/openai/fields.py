"""What /v1/completions and /v1/chat/completions share on the request side: the fields check (unsupported and unknown
fields), ``n``, each choice's seed, usage over the choices, and the endpoints' error responses. No torch."""

from __future__ import annotations

import hashlib
import logging

from api.errors import APIError
from api.openai.models import check_model
from api.serving import Runtime
from api.streaming import usage
from core.sequence import Sequence
from schemas import ErrorResponse, OpenAIFields, OpenAIUsage

log = logging.getLogger("minibatch.api")
ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 422, 500, 503, 504)}  # a route's error answers


_logged_unknown: set[str] = set()


def check_fields(runtime: Runtime, req: OpenAIFields) -> str:
    """The model name, after refusing (400) what the request asks for that is not implemented, and
    logging (once per name) fields OpenAI does not define, which are ignored."""
    name = check_model(runtime, req.model)
    found = req.unsupported()
    if found is not None:
        param, message = found
        raise APIError(400, message, param=param)
    log_unknown(req.unknown_fields())
    return name


def log_unknown(fields: list[str]) -> None:
    """Log (once per name) request fields OpenAI does not define, which are ignored."""
    new = [f for f in fields if f not in _logged_unknown]
    if new and len(_logged_unknown) < 1000:  # bounded: clients choose these names
        _logged_unknown.update(new)
        log.warning("ignoring request fields OpenAI's API does not define: %s", ", ".join(f[:64] for f in new[:20]))


def check_n(runtime: Runtime, req: OpenAIFields) -> int:
    """The choices per prompt (``n``; 422 beyond MAX_N). They share the prompt: queued together as a group, the
    first prefills it and the others fork its KV blocks (``serving.start_generations``). With greedy sampling
    they are equal."""
    n = req.n or 1
    limit = runtime.config.max_n
    if n > limit:
        raise APIError(422, f"n must be in [1, {limit}] (got {n}; MAX_N)", param="n")
    return n


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice ``i``'s seed: choice 0 keeps the request's (so ``n: 1`` with that seed is choice 0), choice i > 0
    draws from its own stream, a 63-bit hash of (seed, i); None stays None (unseeded)."""
    if seed is None or i == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def choice_fields(req: OpenAIFields, i: int) -> OpenAIFields:
    """The request as choice ``i`` samples it: the same fields, its own seed."""
    return req if i == 0 or req.seed is None else req.model_copy(update={"seed": choice_seed(req.seed, i)})


def openai_usage(seqs: list[Sequence], n: int = 1, count_output: bool = True) -> dict:
    """Usage over a request's choices (prompt-major, ``n`` per prompt): each prompt counted once, as OpenAI
    counts it, every choice's completion tokens, and ``prompt_tokens_details.cached_tokens``: the prompt
    tokens the first choice of each prompt found in the prefix cache."""
    firsts = seqs[::n]
    summed = usage(*seqs, count_output=count_output)
    prompt = sum(seq.prompt_len for seq in firsts)
    return OpenAIUsage(
        prompt_tokens=prompt,
        completion_tokens=summed.completion_tokens,
        total_tokens=prompt + summed.completion_tokens,
        prompt_tokens_details={"cached_tokens": sum(seq.num_cached_tokens or 0 for seq in firsts)},
    ).model_dump()


def include_usage(req: OpenAIFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)
