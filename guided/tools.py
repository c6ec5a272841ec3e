"""Tool calling on /v1/chat/completions and /v1/responses, request and answer side. No torch.

Two formats carry the tools to the model and its calls back (``ToolFormat``):

* ``HERMES``, where the chat template renders ``tools`` (Qwen's, SmolLM3's, Hermes' templates): the tools go to
  the template (``tools=``), and the model calls a tool by answering with one or more blocks::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

* ``GENERIC``, for any other model (a template that never reads ``tools``, such as SmolLM2-135M-Instruct's): the
  tools are described in a system preamble (``generic_preamble``) and the model calls one by answering with only
  the JSON object ``{"name": ..., "arguments": {...}}`` (or a list of them). The history's calls are rendered as that
  JSON in the assistant's turn and the tool results as user turns, so any template renders the conversation.

Either way an answer that is a call (every call naming a given function, with object arguments) becomes
``tool_calls`` with ``finish_reason: "tool_calls"``; anything else is content. ``tool_choice: "required"`` or a
named function constrains the answer to exactly one call through the structured-output grammar
(``ToolFormat.grammar``), its arguments under the function's ``parameters`` schema, so the call always parses; one
cut short by the token budget still comes back as ``tool_calls`` with the arguments so far and ``finish_reason:
"length"`` (OpenAI's answer; ``ToolCalling.answer``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from guided.errors import GuidedError
from guided.grammars import COMPACT_JSON, GrammarError, grammar_from

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# The start of one call as the grammar writes it (compact JSON, name first), possibly cut anywhere after the name.
_PARTIAL_CALL = re.compile(r'((?:[^"\\]|\\.)*)(")?(?:,"arguments":(.*))?', re.DOTALL)
_FENCE = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)


def tool_mode(tools: list[dict] | None, tool_choice: Any) -> str | None:
    """``tool_choice`` checked against ``tools``: None (no tools), "none", "auto", "required", or the name of the
    function that must be called. GuidedError naming ``tool_choice`` when it asks for a tool that is not there."""
    names = [t["function"]["name"] for t in tools or []]
    if tool_choice is None:
        return "auto" if names else None
    if tool_choice == "none":
        return "none" if names else None
    if tool_choice in ("auto", "required"):
        if not names:
            raise GuidedError(f'`tool_choice` "{tool_choice}" needs `tools`', param="tool_choice")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise GuidedError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in names:
        raise GuidedError(f"tool_choice names function {name!r}, which is not in `tools`", param="tool_choice")
    return name


def call_schema(tool: dict) -> dict:
    """The JSON schema of one call of ``tool``: its name, then arguments under its parameters' schema."""
    fn = tool["function"]
    return {
        "type": "object",
        "properties": {
            "name": {"const": fn["name"]},
            "arguments": fn.get("parameters") or {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _call(name: str, arguments: str) -> dict:
    """One entry of OpenAI's ``tool_calls`` (``arguments`` is JSON text)."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _checked_call(call: Any, names: list[str]) -> dict | None:
    """A parsed ``{"name", "arguments"}`` as a tool call, or None when it names no given function or its arguments
    are not an object."""
    if not (isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments"), dict)):
        return None
    return _call(call["name"], json.dumps(call["arguments"], ensure_ascii=False, separators=(",", ":")))


class ToolFormat:
    """How tools reach the model and how its calls come back (``HERMES``, ``GENERIC``)."""

    name = ""
    opening = ""  # what a forced call's text (the grammar's) has before its JSON

    def render(self, messages: list[dict], tools: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """The messages and the ``tools=`` the chat template is rendered with."""
        raise NotImplementedError

    def grammar(self, tools: list[dict], mode: str) -> str:
        """The grammar of an answer that is exactly one call: of the named function, or (``required``) of any of
        ``tools``. GuidedError naming ``tools`` when a function's parameters use an unsupported schema construct."""
        chosen = tools if mode == "required" else [t for t in tools if t["function"]["name"] == mode]
        schema = {"anyOf": [call_schema(t) for t in chosen]} if len(chosen) > 1 else call_schema(chosen[0])
        schema = {**schema, "x-guidance": COMPACT_JSON}
        try:
            return grammar_from("lark", self._lark(json.dumps(schema)))
        except GrammarError as exc:
            raise GuidedError(f"`tools`: {exc}", param="tools") from None

    def _lark(self, schema: str) -> str:
        return f"start: %json {schema}\n"

    def may_be_call(self, text: str) -> bool:
        """Whether ``text`` (an answer so far) could still turn out to be a call: a stream holds it back."""
        raise NotImplementedError

    def parse(self, text: str, names: list[str]) -> list[dict] | None:
        """The calls a whole answer makes (OpenAI's ``tool_calls``), or None when it is not a call."""
        raise NotImplementedError

    def partial(self, text: str, names: list[str]) -> list[dict] | None:
        """A forced call cut short (its text is the grammar's, exactly): its function (the name the text has whole,
        or the one name that what it has begins) and the arguments' JSON text so far; None when several names remain
        possible."""
        lead = self.opening + '{"name":"'
        if lead.startswith(text):  # cut before the name: it is known only when there is one
            named, closed, arguments = "", None, ""
        elif text.startswith(lead):
            match = _PARTIAL_CALL.match(text[len(lead) :])
            named, closed, arguments = match.group(1), match.group(2), match.group(3) or ""
        else:
            return None
        candidates = [n for n in names if (n == named if closed else n.startswith(named))]
        return [_call(candidates[0], arguments)] if len(candidates) == 1 else None


class HermesFormat(ToolFormat):
    name, opening = "hermes", TOOL_OPEN + "\n"

    def render(self, messages: list[dict], tools: list[dict]) -> tuple[list[dict], list[dict] | None]:
        return messages, tools

    def _lark(self, schema: str) -> str:
        return (
            f"start: {json.dumps(TOOL_OPEN + chr(10))} call {json.dumps(chr(10) + TOOL_CLOSE)}\ncall: %json {schema}\n"
        )

    def may_be_call(self, text: str) -> bool:
        head = text.lstrip()
        return head.startswith(TOOL_OPEN) or TOOL_OPEN.startswith(head)

    def parse(self, text: str, names: list[str]) -> list[dict] | None:
        if not text.lstrip().startswith(TOOL_OPEN):
            return None
        calls, at = [], 0
        for match in _BLOCK.finditer(text):
            if match.start() != at:
                return None
            at = match.end()
            try:
                call = _checked_call(json.loads(match.group(1)), names)
            except ValueError:
                return None
            if call is None:
                return None
            calls.append(call)
        if not calls or text[at:].strip():
            return None
        return calls


GENERIC_INSTRUCTIONS = (
    "To call a tool, answer with only a JSON object of the form "
    '{"name": <the tool\'s name>, "arguments": <an object of its arguments>} and nothing else. '
    "To answer without a tool, answer in plain text."
)


def generic_preamble(tools: list[dict]) -> str:
    """The system text that tells a model about ``tools`` in the generic format: one JSON line per tool."""
    lines = []
    for tool in tools:
        fn = tool["function"]
        entry = {"name": fn["name"], "description": fn.get("description") or "", "parameters": fn.get("parameters")}
        lines.append(json.dumps({k: v for k, v in entry.items() if v}, ensure_ascii=False))
    return "You can call these tools:\n" + "\n".join(lines) + "\n" + GENERIC_INSTRUCTIONS


class GenericFormat(ToolFormat):
    name = "generic"

    def render(self, messages: list[dict], tools: list[dict]) -> tuple[list[dict], list[dict] | None]:
        preamble = generic_preamble(tools) if tools else ""
        out: list[dict] = []
        names: dict[str, str] = {}  # call id -> function name, for the tool results
        for message in messages:
            role, content = message["role"], message.get("content") or ""
            if message.get("tool_calls"):
                calls = [
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                    for c in message["tool_calls"]
                ]
                names.update((c.get("id", ""), c["function"]["name"]) for c in message["tool_calls"])
                text = "\n".join(json.dumps(c, ensure_ascii=False) for c in calls)
                out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
            elif role == "tool":
                call_id = message.get("tool_call_id") or ""
                name = names.get(call_id, "")
                label = f"the tool call {call_id}" + (f" ({name})" if name else "")
                out.append({"role": "user", "content": f"Result of {label}:\n{content}"})
            else:
                out.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")})
        if preamble and out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}
        elif preamble:
            out.insert(0, {"role": "system", "content": preamble})
        return out, None

    def may_be_call(self, text: str) -> bool:
        head = text.lstrip()
        return not head or head[0] in "{[" or "```".startswith(head[:3])

    def parse(self, text: str, names: list[str]) -> list[dict] | None:
        fenced = _FENCE.fullmatch(text)
        try:
            value = json.loads(fenced.group(1) if fenced else text)
        except ValueError:
            return None
        calls = [_checked_call(c, names) for c in (value if isinstance(value, list) else [value])]
        return calls if calls and None not in calls else None


HERMES, GENERIC = HermesFormat(), GenericFormat()


@dataclass(frozen=True)
class ToolCalling:
    """One request's tool calling: its format, the functions' names and whether a call is forced (``required`` or a
    named function: the answer is constrained to one call)."""

    fmt: ToolFormat
    names: tuple[str, ...]
    forced: bool

    def answer(self, text: str, finish: str | None) -> tuple[list[dict] | None, str | None]:
        """A finished answer's calls and finish reason: (calls, "tool_calls") when the text is a call, (the cut call,
        "length") for a forced call cut by the budget, else (None, ``finish``): plain content."""
        calls = self.fmt.parse(text, list(self.names))
        if calls is not None:
            return calls, "tool_calls"
        if self.forced and finish == "length":
            cut = self.fmt.partial(text, list(self.names))
            if cut is not None:
                return cut, "length"
        return None, finish

    def may_be_call(self, text: str) -> bool:
        return self.fmt.may_be_call(text)


def history_tool_calls(calls: list[dict]) -> list[dict]:
    """An assistant message's ``tool_calls`` as chat templates expect them: ``arguments`` as a mapping."""
    out = []
    for call in calls:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except ValueError:
                pass  # a template may still print it as text
        out.append({**call, "function": fn})
    return out
