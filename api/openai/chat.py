"""``POST /v1/chat/completions``: OpenAI chat request -> chat template -> Sequences (``n`` choices), answered whole
or as ``chat.completion.chunk`` events; tools (``guided/tools.py``) and ``response_format`` (``guided/grammars.py``)
become a grammar. Only translation lives here. No torch."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

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
from guided.tools import GENERIC, HERMES, ToolCalling, tool_mode
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
    messages = [m.template_dict() for m in req.messages]
    with field_errors():
        grammar = response_format_grammar(req.response_format)
    setup = await prepare_chat(runtime, messages, tools, req.tool_choice, grammar, "response_format", "messages")
    room = max(1, runtime.engine.max_context - len(setup.prompt_ids))
    max_tokens = asked or min(room, runtime.config.max_new_tokens_limit)
    k = (req.top_logprobs or 0) if req.logprobs else None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    seqs = [
        make_sequence(
            runtime, setup.prompt_ids, max_tokens, choice_fields(req, j), rid if n == 1 else f"{rid}-{j}", k, None, name
        )
        for j in range(n)
    ]
    await attach_grammar(runtime, seqs, setup.grammar, setup.grammar_param)
    gens = start_generations(runtime, seqs, req.stop, n, request)
    if req.stream:
        frames = ChatFrames(runtime, rid, name, k is not None, include_usage(req), n=n, tools=setup.tools)
        return sse_response(gens, request, frames)
    done = await run_all(gens, request)
    texts = [gen.text for gen in gens]
    return await runtime.off_loop(chat_answer, runtime, rid, name, done, texts, setup.tools, k is not None, n)


@dataclass
class ChatSetup:
    """A conversation ready to queue (what /v1/chat/completions and /v1/responses share): its prompt's token ids, the
    grammar its answers follow (None: free) and the request field that grammar came from, and its tool calling
    (None: no tools offered, or ``tool_choice: "none"``)."""

    prompt_ids: list[int]
    grammar: str | None
    grammar_param: str
    tools: ToolCalling | None


async def prepare_chat(
    runtime: Runtime,
    messages: list[dict],
    tools: list[dict] | None,
    tool_choice,
    grammar: str | None,
    grammar_param: str,
    history_param: str,
) -> ChatSetup:
    """Tools checked and placed (``tool_format``), the grammar of a forced call (``required`` or a named function:
    exactly one call; 400 beside another grammar), and the conversation rendered and tokenized. ``messages`` are
    chat-template dicts (role, content, tool_calls, tool_call_id); ``history_param`` names them in errors."""
    with field_errors():
        mode = tool_mode(tools, tool_choice)
    fmt = tool_format(runtime, messages, tools, history_param)
    forced = mode not in (None, "none", "auto")
    if forced:  # required or a named function: the answer is one call, always
        if grammar is not None:
            raise APIError(400, f"{grammar_param} cannot be combined with tool_choice {mode!r}", param="tool_choice")
        with field_errors():
            grammar, grammar_param = fmt.grammar(tools, mode), "tools"
    rendered, template_tools = fmt.render(messages, tools or []) if tools or fmt is GENERIC else (messages, None)
    prompt_ids = await chat_prompt_ids(runtime, rendered, template_tools or None)
    calling = None
    if mode not in (None, "none"):
        calling = ToolCalling(fmt, tuple(t["function"]["name"] for t in tools), forced)
    return ChatSetup(prompt_ids, grammar, grammar_param, calling)


def tool_format(runtime: Runtime, messages: list[dict], tools: list[dict] | None, history_param: str):
    """How this model takes tools: its chat template when it renders them (``HERMES``), else the generic format
    (``GENERIC``, GENERIC_TOOLS) or, with that off, a 400 for tools or tool turns in the history."""
    if runtime.engine.supports_tools():
        return HERMES
    if runtime.config.generic_tools:
        return GENERIC
    if tools:
        raise APIError(
            400,
            f"`tools`: the chat template of model {runtime.config.model_name!r} does not render tools "
            "(GENERIC_TOOLS=false)",
            param="tools",
        )
    for i, message in enumerate(messages):
        if message["role"] == "tool" or message.get("tool_calls"):
            param = f"{history_param}.{i}.role" if message["role"] == "tool" else f"{history_param}.{i}.tool_calls"
            text = "`tool_calls` and `tool` messages in the history need a chat template that renders tools"
            raise APIError(400, f"{text} (model {runtime.config.model_name!r}; GENERIC_TOOLS=false)", param=param)
    return HERMES  # nothing about tools in this request


def chat_answer(
    runtime: Runtime,
    rid: str,
    name: str,
    done: list[Sequence],
    texts: list[str],
    tools: ToolCalling | None,
    with_logprobs: bool,
    n: int,
) -> Response:
    """The whole ``chat.completion`` answer over the finished sequences, encoded (``json_answer``). Any thread."""
    answers = [chat_message(text, tools, seq.finish_reason) for text, seq in zip(texts, done)]
    return json_answer(
        {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": name,
            "system_fingerprint": runtime.fingerprint,
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


def chat_message(text: str, tools: ToolCalling | None, finish: str | None) -> tuple[dict, str | None]:
    """The answer's ``message`` and ``finish_reason``: tool calls when the text is one, or a forced call cut by
    the budget (``guided.tools.ToolCalling.answer``)."""
    calls, finish = tools.answer(text, finish) if tools else (None, finish)
    if calls is None:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": None, "tool_calls": calls}, finish
