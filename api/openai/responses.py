"""``POST /v1/responses``: OpenAI's Responses API over the chat path. ``input`` (a text, or message, function_call and
function_call_output items) and ``instructions`` become a conversation, ``text.format`` a grammar, function
``tools`` and ``tool_choice`` the chat endpoint's tool calling (``chat.prepare_chat``); the answer is a ``response``
object with ``message`` and ``function_call`` output items, or the Responses event stream (``ResponsesFrames``).

Stateless: nothing is stored. ``store`` is accepted (true is OpenAI's default) and the answer says ``"store":
false``; ``previous_response_id`` and ``conversation`` get a 400 that says to send the whole conversation. Only
translation lives here. No torch."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import ValidationError

from api.errors import APIError, error_code, field_errors
from api.openai.chat import prepare_chat
from api.openai.fields import ERRORS, check_fields, openai_usage
from api.serving import (
    Runtime,
    attach_grammar,
    check_max_tokens,
    current_runtime,
    make_sequence,
    start_generations,
)
from api.streaming import Frames, json_answer, run_all, sse, sse_response
from core.generation import Chunk
from core.sequence import Sequence
from guided.grammars import response_format_grammar
from guided.tools import ToolCalling, history_tool_calls
from schemas import ResponsesRequest, Tool

router = APIRouter(prefix="/v1")

TEXT_PARTS = ("input_text", "output_text", "text")  # content part types that are text


@router.post("/responses", responses=ERRORS)
async def responses(req: ResponsesRequest, request: Request, runtime: Runtime = Depends(current_runtime)):
    name = check_fields(runtime, req)
    if req.max_output_tokens:
        check_max_tokens(runtime, req.max_output_tokens, "max_output_tokens")
    messages = input_messages(req.input, req.instructions)
    tools = function_tools(req.tools)
    with field_errors():
        grammar = response_format_grammar(text_format(req.text))
    choice = tool_choice(req.tool_choice)
    setup = await prepare_chat(runtime, messages, tools, choice, grammar, "text.format", "input")
    room = max(1, runtime.engine.max_context - len(setup.prompt_ids))
    max_tokens = req.max_output_tokens or min(room, runtime.config.max_new_tokens_limit)
    rid = f"resp_{uuid.uuid4().hex}"
    seq = make_sequence(runtime, setup.prompt_ids, max_tokens, req, rid, model=name)
    await attach_grammar(runtime, [seq], setup.grammar, setup.grammar_param)
    gens = start_generations(runtime, [seq], req.stop, 1, request)
    shape = ResponseShape(rid, name, req, runtime.fingerprint)
    if req.stream:
        return sse_response(gens, request, ResponsesFrames(shape, setup.tools))
    (done,) = await run_all(gens, request)
    return await runtime.off_loop(whole_response, shape, done, gens[0].text, setup.tools)


# --- the request, translated -------------------------------------------------------------------------------------
def input_messages(items: str | list[dict], instructions: str | None) -> list[dict]:
    """``instructions`` and ``input`` as chat-template messages: a text is one user message; message items keep
    their role, a ``function_call`` item joins the assistant turn before it (or opens one) as a ``tool_calls``
    entry, a ``function_call_output`` item is a ``tool`` message. 400 naming the item for anything else."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    400,
                    f"a message's role must be user, system, developer or assistant (got {role!r})",
                    param=f"{where}.role",
                )
            messages.append({"role": role, "content": item_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            fields = [_string(item, key, where) for key in ("call_id", "name", "arguments")]
            call = {"id": fields[0], "type": "function", "function": {"name": fields[1], "arguments": fields[2]}}
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item_text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output})
        else:
            raise APIError(
                400,
                f"input items of type {kind!r} are not supported (message, function_call, function_call_output)",
                param=f"{where}.type",
            )
    for message in messages:
        if "tool_calls" in message:
            message["tool_calls"] = history_tool_calls(message["tool_calls"])
    return messages


def item_text(content, where: str) -> str:
    """A message's (or a tool output's) content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise APIError(
                400, f"content parts of type {kind!r} are not supported (text only)", param=f"{where}.{j}.type"
            )
        texts.append(_string(part, "text", f"{where}.{j}"))
    return "".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"`{key}` must be a string", param=f"{where}.{key}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(422, "must be valid Unicode (no unpaired surrogates)", param=f"{where}.{key}") from None
    return value


def function_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' function tools (``{"type": "function", "name", "parameters", ...}``) in the chat endpoint's shape;
    400 naming any other tool type (hosted tools: web search, files, ...), 422 for a malformed function."""
    out = []
    for i, tool in enumerate(tools or []):
        if tool.get("type") != "function":
            raise APIError(
                400, f"tools of type {tool.get('type')!r} are not supported (function only)", param=f"tools.{i}.type"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        try:
            out.append(Tool.model_validate({"type": "function", "function": fn}).model_dump(exclude_none=True))
        except ValidationError as exc:
            raise APIError(422, f"tools.{i}: {exc.errors()[0]['msg']}", param=f"tools.{i}") from None
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise APIError(422, "function names must be unique", param="tools")
    return out or None


def tool_choice(choice):
    """Responses' ``tool_choice`` in the chat endpoint's shape (``{"type": "function", "name"}`` -> ``{"type":
    "function", "function": {"name"}}``); the chat checks do the rest."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def text_format(text: dict | None) -> dict | None:
    """``text.format`` as the chat endpoint's ``response_format`` (``json_schema``'s fields sit one level up here)."""
    if not text:
        return None
    unknown = set(text) - {"format", "verbosity"}
    if text.get("verbosity") is not None or unknown:
        param = "text.verbosity" if text.get("verbosity") is not None else f"text.{sorted(unknown)[0]}"
        raise APIError(400, f"`{param}` is not supported", param=param)
    fmt = text.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return fmt


# --- the answer --------------------------------------------------------------------------------------------------
class ResponseShape:
    """What every ``response`` object of one request carries beside its output, status and usage."""

    def __init__(self, rid: str, model: str, req: ResponsesRequest, fingerprint: str) -> None:
        self.rid, self.msg_id, self.created = rid, f"msg_{uuid.uuid4().hex}", int(time.time())
        self.echo = {
            "model": model,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": req.tools or [],
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "parallel_tool_calls": True,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "previous_response_id": None,
            "reasoning": None,
            "truncation": "disabled",
            "metadata": (req.model_extra or {}).get("metadata") or {},
            "store": False,  # nothing is stored, whatever the request said
            "system_fingerprint": fingerprint,
        }

    def response(self, status: str, output: list[dict], seq: Sequence | None = None, error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "output": output,
            "usage": response_usage(seq) if seq is not None else None,
            **self.echo,
        }

    def message(self, text: str, status: str) -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": [part]}


def function_call_item(call: dict, status: str) -> dict:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
        "status": status,
    }


def response_usage(seq: Sequence) -> dict:
    usage = openai_usage([seq])
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def outcome(text: str, seq: Sequence, tools: ToolCalling | None) -> tuple[list[dict] | None, str]:
    """The answer's tool calls (None: it is text) and the response's status: "incomplete" when the budget cut it."""
    calls, finish = tools.answer(text, seq.finish_reason) if tools else (None, seq.finish_reason)
    return calls, "incomplete" if finish == "length" else "completed"


def whole_response(shape: ResponseShape, seq: Sequence, text: str, tools: ToolCalling | None) -> Response:
    calls, status = outcome(text, seq, tools)
    output = [function_call_item(c, status) for c in calls] if calls is not None else [shape.message(text, status)]
    return json_answer(shape.response(status, output, seq))


class ResponsesFrames(Frames):
    """The Responses event stream: ``response.created``, ``response.in_progress``; the message item (``output_item
    .added``, ``content_part.added``, ``output_text.delta`` per text, then the ``.done`` events) or, for a tool call,
    per call ``output_item.added``, ``function_call_arguments.delta`` / ``.done``, ``output_item.done``; then
    ``response.completed`` (``response.incomplete`` when the budget cut it). Each event is named (``event:``) and
    numbered (``sequence_number``); no ``[DONE]``. A failure ends it with ``error`` and ``response.failed``. With
    tools, text that may be a call is held back until it cannot be one (as on chat)."""

    done_marker = None

    def __init__(self, shape: ResponseShape, tools: ToolCalling | None) -> None:
        self.shape, self.tools = shape, tools
        self.number = 0
        self.opened = False  # the message item was announced
        self.held: str | None = "" if tools else None  # text held back while it may be a call
        self.text_so_far = ""

    def encode(self, event: dict | str) -> str:
        if isinstance(event, str):
            return sse(event)
        event = {**event, "sequence_number": self.number}
        self.number += 1
        return f"event: {event['type']}\n" + sse(event)

    def opening(self) -> list[dict]:
        empty = self.shape.response("in_progress", [])
        return [{"type": "response.created", "response": empty}, {"type": "response.in_progress", "response": empty}]

    def text(self, i: int, chunk: Chunk) -> list[dict]:
        if self.held is not None:
            self.held += chunk.text
            if self.tools.may_be_call(self.held):
                return []
            chunk, self.held = Chunk(self.held), None
        return self._deltas(chunk.text)

    def _deltas(self, text: str) -> list[dict]:
        if not text:
            return []
        self.text_so_far += text
        return [*self._open(), {"type": "response.output_text.delta", **self._at(), "delta": text, "logprobs": []}]

    def _at(self) -> dict:
        return {"item_id": self.shape.msg_id, "output_index": 0, "content_index": 0}

    def _open(self) -> list[dict]:
        if self.opened:
            return []
        self.opened = True
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            {"type": "response.output_item.added", "output_index": 0, "item": self.shape.message("", "in_progress")},
            {"type": "response.content_part.added", **self._at(), "part": part},
        ]

    def closing(self, i: int, seq: Sequence, rest: str) -> list[dict]:
        if self.held is not None:  # never released: the whole answer is here
            new, whole, self.held = self.held + rest, self.held + rest, None
        else:
            new, whole = rest, self.text_so_far + rest
        calls, self.status = outcome(whole, seq, self.tools)
        self.seq = seq
        if calls is not None:
            self.output = [function_call_item(c, self.status) for c in calls]
            return [e for j, item in enumerate(self.output) for e in self._call_events(j, item)]
        events = [*self._deltas(new), *self._open()]  # an empty answer still opens (and closes) its message
        message = self.shape.message(whole, self.status)
        self.output = [message]
        return [
            *events,
            {"type": "response.output_text.done", **self._at(), "text": whole, "logprobs": []},
            {"type": "response.content_part.done", **self._at(), "part": message["content"][0]},
            {"type": "response.output_item.done", "output_index": 0, "item": message},
        ]

    @staticmethod
    def _call_events(j: int, item: dict) -> list[dict]:
        at = {"item_id": item["id"], "output_index": j}
        return [
            {
                "type": "response.output_item.added",
                "output_index": j,
                "item": {**item, "arguments": "", "status": "in_progress"},
            },
            {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
            {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]},
            {"type": "response.output_item.done", "output_index": j, "item": item},
        ]

    def finale(self, seqs: list[Sequence]) -> list[dict]:
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return [{"type": kind, "response": self.shape.response(self.status, self.output, self.seq)}]

    def failure(self, error: APIError) -> list[dict]:
        code = error_code(error.status, error.param)
        failed = self.shape.response("failed", [], error={"code": code or "server_error", "message": error.message})
        return [
            {"type": "error", "code": code, "message": error.message, "param": error.param},
            {"type": "response.failed", "response": failed},
        ]
