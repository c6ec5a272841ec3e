"""``POST /v1/chat/completions``: OpenAI chat request -> chat template -> Sequences (``n`` choices), answered whole
or as ``chat.completion.chunk`` events; tools (``guided/tools.py``) and ``response_format`` (``guided/grammars.py``)
become a grammar. Only translation lives here. No torch."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from api.errors import APIError, field_errors
from api.openai.fields import ERRORS, check_fields, check_n, choice_fields, include_usage, openai_usage
from api.openai.frames import ChatFrames
from api.openai.logprobs import chat_logprobs
from api.serving import (
    Runtime,
    attach_grammar,
    chat_prompt_ids,
    check_max_tokens,
    check_sequence_count,
    current_runtime,
    make_sequence,
    start_generations,
)
from api.streaming import json_answer, run_all, sse_response
from core.sequence import Sequence
from guided.grammars import response_format_grammar
from guided.tools import parse_tool_calls, tool_call_grammar, tool_mode
from schemas import ChatCompletionRequest

router = APIRouter(prefix="/v1")


@router.post("/chat/completions", responses=ERRORS)
async def chat_completions(req: ChatCompletionRequest, request: Request, runtime: Runtime = Depends(current_runtime)):
    name = check_fields(runtime, req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(422, "top_logprobs requires logprobs: true", param="top_logprobs")
    n = check_n(runtime, req)
    check_sequence_count(runtime, n)
    asked = req.max_completion_tokens or req.max_tokens
    if asked:
        check_max_tokens(runtime, asked, "max_completion_tokens")
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
    mode = check_tools(runtime, req, tools)
    with field_errors():
        grammar, grammar_param = response_format_grammar(req.response_format), "response_format"
        if mode not in (None, "none", "auto"):  # required or a named function: the answer is one call, always
            if grammar is not None:
                raise APIError(
                    400, "response_format cannot be combined with tool_choice " + repr(mode), param="tool_choice"
                )
            grammar, grammar_param = tool_call_grammar(tools, mode), "tools"
    prompt_ids = await chat_prompt_ids(runtime, [m.template_dict() for m in req.messages], tools)
    room = max(1, runtime.engine.max_context - len(prompt_ids))
    max_tokens = asked or min(room, runtime.config.max_new_tokens_limit)
    k = (req.top_logprobs or 0) if req.logprobs else None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    seqs = [
        make_sequence(
            runtime, prompt_ids, max_tokens, choice_fields(req, j), rid if n == 1 else f"{rid}-{j}", k, None, name
        )
        for j in range(n)
    ]
    await attach_grammar(runtime, seqs, grammar, grammar_param)
    gens = start_generations(runtime, seqs, req.stop, n, request)
    names = [t["function"]["name"] for t in tools or []] if mode not in (None, "none") else []
    if req.stream:
        frames = ChatFrames(runtime, rid, name, k is not None, include_usage(req), n=n, tool_names=names)
        return sse_response(gens, request, frames)
    done = await run_all(gens, request)
    texts = [gen.text for gen in gens]
    return await runtime.off_loop(chat_answer, runtime, rid, name, done, texts, names, k is not None, n)


def chat_answer(
    runtime: Runtime,
    rid: str,
    name: str,
    done: list[Sequence],
    texts: list[str],
    names: list[str],
    with_logprobs: bool,
    n: int,
) -> Response:
    """The whole ``chat.completion`` answer over the finished sequences, encoded (``json_answer``). Any thread."""
    answers = [chat_message(text, names, seq.finish_reason) for text, seq in zip(texts, done)]
    return json_answer(
        {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": name,
            "choices": [
                {
                    "index": j,
                    "message": message,
                    "logprobs": chat_logprobs(runtime, seq.output_logprobs) if with_logprobs else None,
                    "finish_reason": finish,
                }
                for j, (seq, (message, finish)) in enumerate(zip(done, answers))
            ],
            "usage": openai_usage(done, n),
        }
    )


def check_tools(runtime: Runtime, req: ChatCompletionRequest, tools: list[dict] | None) -> str | None:
    """The request's tool mode (``guided.tools.tool_mode``), after refusing (400) tools or tool messages sent
    to a model whose chat template cannot render them."""
    with field_errors():
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
    """The answer's ``message`` and ``finish_reason``: tool calls when the text is one (``guided/tools.py``)."""
    calls = parse_tool_calls(text, tool_names) if tool_names else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
