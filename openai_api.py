"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Only translation lives here: OpenAI request -> Sequence (through ``serving.make_sequence``),
Generation output -> OpenAI response or ``chat.completion.chunk`` / ``text_completion``
server-sent events (through ``streaming.py``). Errors use OpenAI's body shape. No torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
import uuid
from contextlib import contextmanager

from fastapi import APIRouter, Depends, Request

from api_errors import APIError
from generation import Chunk
from schemas import ChatCompletionRequest, CompletionRequest, ErrorResponse, OpenAIFields, OpenAIUsage
from sequence import Sequence
from serving import (
    Runtime,
    check_max_tokens,
    check_token_ids,
    current_runtime,
    detokenize,
    make_sequence,
    render_chat,
    start_generations,
    tokenize,
)
from streaming import Frames, run_all, sse_response, usage
from structured_output import attach_grammar, response_format_grammar
from tool_calls import may_be_tool_call, parse_tool_calls, tool_call_grammar, tool_mode

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
    # max_tokens 0 with echo scores the prompt without generating (evaluation harnesses' loglikelihood):
    # one token is generated, as every admission does, and dropped from the answer.
    score_only = req.max_tokens == 0
    if score_only and not req.echo:
        raise APIError(422, "max_tokens 0 needs echo: true (it returns the prompt, scored)", param="max_tokens")
    max_tokens = 1 if score_only else check_max_tokens(runtime, req.max_tokens or 16, "max_tokens")
    prompt_k = req.logprobs if req.echo else None  # echo + logprobs: the prompt's logprobs too
    n = check_n(runtime, req)
    prompts = await completion_prompts(runtime, req.prompt, req.echo)
    rid = f"cmpl-{uuid.uuid4().hex}"
    seqs = []
    for i, (ids, _) in enumerate(prompts):  # every prompt is checked before any is queued
        with prompt_errors(i, len(prompts)):
            for j in range(n):  # choice index i * n + j, as OpenAI and vLLM number them
                seq_id = rid if len(prompts) * n == 1 else f"{rid}-{i * n + j}"  # a label for the logs
                fields = choice_fields(req, j)
                seqs.append(make_sequence(runtime, ids, max_tokens, fields, seq_id, req.logprobs, prompt_k))
    if not score_only:
        await attach_grammar(runtime, seqs, response_format_grammar(req.response_format), "response_format")
    gens = start_generations(runtime, seqs, req.stop, n)
    echoes = [text for _, text in prompts for _ in range(n)]
    if req.stream:
        frames = CompletionFrames(
            runtime, rid, name, echoes, seqs, req.logprobs is not None, include_usage(req), score_only=score_only, n=n
        )
        return sse_response(gens, request, frames)
    done = await run_all(gens, request)
    choices = []
    for i, (gen, seq, echo) in enumerate(zip(gens, done, echoes)):
        text = echo if score_only else echo + gen.text
        lps = None
        if req.logprobs is not None:
            lps = completion_logprobs(runtime, [] if score_only else seq.output_logprobs, len(echo))
            if prompt_k is not None:
                lps = join_logprobs(prompt_logprobs(runtime, seq), lps)
        finish = "length" if score_only else seq.finish_reason  # the budget, 0, was reached
        choices.append({"index": i, "text": text, "logprobs": lps, "finish_reason": finish})
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": name,
        "choices": choices,
        "usage": openai_usage(done, n, count_output=not score_only),
    }


async def completion_prompts(runtime: Runtime, prompt, echo: bool) -> list[tuple[list[int], str]]:
    """Each prompt of a completions request as (token ids, the text ``echo`` prepends: "" without it).
    ``prompt`` is a text, a list of texts, a list of token ids or a list of such lists (OpenAI's four
    forms). Every prompt is checked (count first, then each one, tokenized concurrently off the
    loop); the first bad one, in order, fails the whole request before anything is queued."""
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


@router.post("/chat/completions", responses=_ERRORS)
async def chat_completions(req: ChatCompletionRequest, request: Request, runtime: Runtime = Depends(current_runtime)):
    name = check_fields(runtime, req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(422, "top_logprobs requires logprobs: true", param="top_logprobs")
    n = check_n(runtime, req)
    asked = req.max_completion_tokens or req.max_tokens
    if asked:
        check_max_tokens(runtime, asked, "max_completion_tokens")
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
    mode = check_tools(runtime, req, tools)
    grammar, grammar_param = response_format_grammar(req.response_format), "response_format"
    if mode not in (None, "none", "auto"):  # required or a named function: the answer is one call, always
        if grammar is not None:
            raise APIError(
                400, "response_format cannot be combined with tool_choice " + repr(mode), param="tool_choice"
            )
        grammar, grammar_param = tool_call_grammar(tools, mode), "tools"
    prompt_text = await render_chat(runtime, [m.template_dict() for m in req.messages], tools)
    prompt_ids = await tokenize(runtime, prompt_text, add_special_tokens=False)  # the template holds them
    room = max(1, runtime.engine.max_context - len(prompt_ids))
    max_tokens = asked or min(room, runtime.config.max_new_tokens_limit)
    k = (req.top_logprobs or 0) if req.logprobs else None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    seqs = [
        make_sequence(runtime, prompt_ids, max_tokens, choice_fields(req, j), rid if n == 1 else f"{rid}-{j}", k)
        for j in range(n)
    ]
    await attach_grammar(runtime, seqs, grammar, grammar_param)
    gens = start_generations(runtime, seqs, req.stop, n)
    names = [t["function"]["name"] for t in tools or []] if mode not in (None, "none") else []
    if req.stream:
        frames = ChatFrames(runtime, rid, name, k is not None, include_usage(req), n=n, tool_names=names)
        return sse_response(gens, request, frames)
    done = await run_all(gens, request)
    answers = [chat_message(gen.text, names, seq.finish_reason) for gen, seq in zip(gens, done)]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": name,
        "choices": [
            {
                "index": j,
                "message": message,
                "logprobs": chat_logprobs(runtime, seq.output_logprobs) if k is not None else None,
                "finish_reason": finish,
            }
            for j, (seq, (message, finish)) in enumerate(zip(done, answers))
        ],
        "usage": openai_usage(done, n),
    }


def check_tools(runtime: Runtime, req: ChatCompletionRequest, tools: list[dict] | None) -> str | None:
    """The request's tool mode (``tool_calls.tool_mode``), after refusing (400) tools or tool messages sent
    to a model whose chat template cannot render them."""
    mode = tool_mode(tools, req.tool_choice)
    if runtime.engine.supports_tools():
        return mode
    if tools:
        raise APIError(
            400,
            f"`tools`: the chat template of model {runtime.config.model_name!r} does not render tools",
            param="tools",
        )
    for i, message in enumerate(req.messages):
        if message.uses_tools:
            param = f"messages.{i}.role" if message.role == "tool" else f"messages.{i}.tool_calls"
            message = "`tool_calls` and `tool` messages in the history need a chat template that renders tools"
            raise APIError(400, f"{message} (model {runtime.config.model_name!r})", param=param)
    return mode


def chat_message(text: str, tool_names: list[str], finish: str | None) -> tuple[dict, str | None]:
    """The answer's ``message`` and ``finish_reason``: tool calls when the text is one (``tool_calls.py``)."""
    calls = parse_tool_calls(text, tool_names) if tool_names else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"


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


# --- stream frames -------------------------------------------------------------------------------
class OpenAIFrames(Frames):
    """What both /v1 streams share: every event carries id/object/created/model and one choice (its
    ``index``: the prompt's); each choice closes with a ``finish_reason`` event; once all have, a
    usage event (summed), if asked."""

    object = ""
    count_output = True  # usage counts the generated tokens (not for a prompt scored with max_tokens 0)

    def __init__(
        self, runtime: Runtime, request_id: str, model: str, wants_logprobs: bool, with_usage: bool, n: int = 1
    ) -> None:
        self.runtime = runtime
        self.wants_logprobs = wants_logprobs
        self.with_usage = with_usage
        self.n = n  # choices per prompt
        self.base = {"id": request_id, "object": self.object, "created": int(time.time()), "model": model}

    def choice(self, i: int, text: str, chunk: Chunk | None, finish: str | None) -> dict:
        raise NotImplementedError

    def text(self, i: int, chunk: Chunk) -> dict | None:
        if not (chunk.text or chunk.logprobs):  # tokens with no text of their own still carry their logprobs
            return None
        return {**self.base, "choices": [self.choice(i, chunk.text, chunk, None)]}

    def closing(self, i: int, seq: Sequence, rest: str) -> list[dict]:
        return [{**self.base, "choices": [self.choice(i, rest, None, seq.finish_reason)]}]

    def finale(self, seqs: list[Sequence]) -> list[dict]:
        if not self.with_usage:
            return []
        return [{**self.base, "choices": [], "usage": openai_usage(seqs, self.n, self.count_output)}]


class CompletionFrames(OpenAIFrames):
    object = "text_completion"

    def __init__(
        self,
        runtime: Runtime,
        request_id: str,
        model: str,
        echoes: list[str],
        seqs: list[Sequence],
        wants_logprobs: bool,
        with_usage: bool,
        score_only: bool = False,
        n: int = 1,
    ) -> None:
        super().__init__(runtime, request_id, model, wants_logprobs, with_usage, n)
        self.echoes, self.seqs = echoes, seqs
        self.score_only = score_only  # max_tokens 0: the one generated token is not part of the answer
        self.count_output = not score_only
        # text_offset counts from the start of each choice's whole text, as in the non-streamed answer
        self.offsets = [len(echo) for echo in echoes]
        # With logprobs, an echo carries the prompt's logprobs, known once the prompt's prefill has run: it
        # goes out with that choice's first event instead of before everything.
        self.pending = [bool(echo) and wants_logprobs for echo in echoes]

    def opening(self) -> list[dict]:
        return [
            {**self.base, "choices": [{"index": i, "text": echo, "logprobs": None, "finish_reason": None}]}
            for i, echo in enumerate(self.echoes)
            if echo and not self.pending[i]
        ]

    def text(self, i: int, chunk: Chunk) -> dict | None:
        if self.score_only:
            chunk = Chunk("")
        head, head_lp = self._held_echo(i)
        if not (head or chunk.text or chunk.logprobs):
            return None
        return {**self.base, "choices": [self.choice(i, chunk.text, chunk, None, head, head_lp)]}

    def closing(self, i: int, seq: Sequence, rest: str) -> list[dict]:
        head, head_lp = self._held_echo(i)
        text, finish = ("", "length") if self.score_only else (rest, seq.finish_reason)
        return [{**self.base, "choices": [self.choice(i, text, None, finish, head, head_lp)]}]

    def _held_echo(self, i: int) -> tuple[str, dict | None]:
        """Choice i's held-back echo and its prompt logprobs, the first time it is asked for."""
        if not self.pending[i]:
            return "", None
        self.pending[i] = False
        return self.echoes[i], prompt_logprobs(self.runtime, self.seqs[i])

    def choice(
        self, i: int, text: str, chunk: Chunk | None, finish: str | None, head: str = "", head_lp: dict | None = None
    ) -> dict:
        lp = None
        if self.wants_logprobs and chunk is not None:
            lp = completion_logprobs(self.runtime, chunk.logprobs, self.offsets[i])
            self.offsets[i] += sum(len(tok) for tok in lp["tokens"])
        if head_lp is not None:
            lp = join_logprobs(head_lp, lp or completion_logprobs(self.runtime, [], 0))
        return {"index": i, "text": head + text, "logprobs": lp, "finish_reason": finish}


class ChatFrames(OpenAIFrames):
    """With tools (``tool_names``), text that may be a tool call is held back: once it cannot be one it goes out
    as content; if the answer is one, its calls go out at the end as ``delta.tool_calls`` (per call, the id
    and name, then the arguments), with finish_reason "tool_calls". Logprobs of held-back tokens go out
    with empty deltas as they come."""

    object = "chat.completion.chunk"

    def __init__(self, *args, tool_names: list[str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tool_names = tool_names or []
        # Per choice, the text held back while it may still be a tool call; a choice not in it streams content.
        self.held: dict[int, str] = {i: "" for i in range(self.n)} if self.tool_names else {}

    def text(self, i: int, chunk: Chunk) -> dict | None:
        if i not in self.held:
            return super().text(i, chunk)
        self.held[i] += chunk.text
        if may_be_tool_call(self.held[i]):
            lp = chat_logprobs(self.runtime, chunk.logprobs) if self.wants_logprobs and chunk.logprobs else None
            if lp is None:
                return None
            return {**self.base, "choices": [{"index": i, "delta": {}, "logprobs": lp, "finish_reason": None}]}
        return super().text(i, dataclasses.replace(chunk, text=self.held.pop(i)))

    def closing(self, i: int, seq: Sequence, rest: str) -> list[dict]:
        if i not in self.held:
            return super().closing(i, seq, rest)
        text = self.held.pop(i) + rest
        calls = parse_tool_calls(text, self.tool_names)
        if calls is None:
            return super().closing(i, seq, text)
        events = []
        for j, call in enumerate(calls):
            head = {"index": j, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"]}}
            args = {"index": j, "function": {"arguments": call["function"]["arguments"]}}
            for delta in (head, args):
                choice = {"index": i, "delta": {"tool_calls": [delta]}, "logprobs": None, "finish_reason": None}
                events.append({**self.base, "choices": [choice]})
        end = {"index": i, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
        return [*events, {**self.base, "choices": [end]}]

    def opening(self) -> list[dict]:
        """The role frame of every choice."""
        role = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [{**self.base, "choices": [{"index": i, **role}]} for i in range(self.n)]

    def choice(self, i: int, text: str, chunk: Chunk | None, finish: str | None) -> dict:
        lp = chat_logprobs(self.runtime, chunk.logprobs) if self.wants_logprobs and chunk is not None else None
        delta = {"content": text} if text or finish is None else {}
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
