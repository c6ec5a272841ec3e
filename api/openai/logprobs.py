"""Logprobs in OpenAI's two formats: the legacy completions one (parallel lists of tokens, logprobs, top alternatives
and text offsets; the prompt's too, for ``echo``) and chat's (``content``: one entry per token, with its bytes). No
torch."""

from __future__ import annotations

from api.serving import Runtime
from core.sequence import Sequence


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


def prompt_logprobs(runtime: Runtime, seq: Sequence) -> dict:
    """The prompt's tokens in the legacy format, text offsets from 0; the first token's logprob and top
    alternatives are null (nothing precedes it), as OpenAI and vLLM answer."""
    rest = completion_logprobs(runtime, seq.prompt_logprobs[1:], 0)
    tokens = [runtime.engine.decode([seq.prompt_token_ids[0]]), *rest["tokens"]]
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": offsets,
    }


def join_logprobs(first: dict, then: dict) -> dict:
    return {key: first[key] + then[key] for key in first}


def chat_logprobs(runtime: Runtime, lps: list) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = runtime.engine.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]
    }
