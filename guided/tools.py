"""Tool calling on /v1/chat/completions, request and answer side. No torch.

The tools go to the model through its chat template (``tools=``); a template that never reads ``tools``
cannot tell the model about them, so such a model refuses tool requests (400). The model calls a tool by
answering with one or more Hermes-style blocks (the format of Qwen's and SmolLM's tool templates)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

An answer that begins (after whitespace) with such a block, every block holding JSON with a known ``name``
and an object ``arguments``, becomes ``message.tool_calls`` with ``finish_reason: "tool_calls"``; anything
else is plain content. ``tool_choice: "required"`` or a named function constrains the answer to one such
block through the structured-output grammar (``tool_call_grammar``), so the call always parses.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from guided.errors import GuidedError
from guided.grammars import COMPACT_JSON, GrammarError, grammar_from

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


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


def tool_call_grammar(tools: list[dict], mode: str) -> str:
    """The grammar of an answer that is exactly one tool-call block: of the named function, or (``required``) of
    any of ``tools``. GuidedError naming ``tools`` when a function's parameters use an unsupported schema construct."""

    chosen = tools if mode == "required" else [t for t in tools if t["function"]["name"] == mode]
    schema = {"anyOf": [call_schema(t) for t in chosen]} if len(chosen) > 1 else call_schema(chosen[0])
    schema = {**schema, "x-guidance": COMPACT_JSON}
    lark = f"start: {json.dumps(TOOL_OPEN + chr(10))} call {json.dumps(chr(10) + TOOL_CLOSE)}\n"
    lark += f"call: %json {json.dumps(schema)}\n"
    try:
        return grammar_from("lark", lark)
    except GrammarError as exc:
        raise GuidedError(f"`tools`: {exc}", param="tools") from None


def may_be_tool_call(text: str) -> bool:
    """Whether ``text`` (an answer so far) could still turn out to be a tool call: a stream holds it back."""
    head = text.lstrip()
    return head.startswith(TOOL_OPEN) or TOOL_OPEN.startswith(head)


def parse_tool_calls(text: str, names: list[str]) -> list[dict] | None:
    """The tool calls an answer makes (OpenAI's ``message.tool_calls``), or None when it is not a tool call."""
    if not text.lstrip().startswith(TOOL_OPEN):
        return None
    calls, at = [], 0
    for match in _BLOCK.finditer(text):
        if match.start() != at:
            return None
        at = match.end()
        try:
            call = json.loads(match.group(1))
        except ValueError:
            return None
        if not (isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments"), dict)):
            return None
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)},
            }
        )
    if not calls or text[at:].strip():
        return None
    return calls


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
