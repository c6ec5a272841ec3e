"""Logprobs in OpenAI's two formats: the legacy completions one (parallel lists of tokens, logprobs, top alternatives
and text offsets; the prompt's too, for ``echo``) and chat's (``content``: one entry per token, with its bytes). No
torch.

An answer can name hundreds of thousands of tokens (MAX_LOGPROB_ENTRIES bounds it), mostly the same few thousand:
each token's text comes from ``Runtime.token_text`` (decoded once per server), and the handlers build whole answers
off the event loop (``api.streaming.json_answer``).
"""

from __future__ import annotations

from api.serving import Runtime
from core.sequence import Sequence


def completion_logprobs(runtime: Runtime, lps: list, text_offset: int) -> dict:
    """Legacy completions format: parallel lists of tokens, logprobs, top alternatives, offsets."""
    text = runtime.token_text
    tokens = [text(lp.token_id) for lp in lps]
    offsets = []
    for tok in tokens:
        offsets.append(text_offset)
        text_offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{text(t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def prompt_logprobs(runtime: Runtime, seq: Sequence) -> dict:
    """The prompt's tokens in the legacy format, text offsets from 0; the first token's logprob and top
    alternatives are null (nothing precedes it), as OpenAI and vLLM answer."""
    rest = completion_logprobs(runtime, seq.prompt_logprobs[1:], 0)
    tokens = [runtime.token_text(seq.prompt_token_ids[0]), *rest["tokens"]]
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
    text = runtime.token_text

    def entry(token_id: int, logprob: float) -> dict:
        token = text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]
    }
