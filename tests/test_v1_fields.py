"""Nothing on /v1 is silently ignored: every OpenAI request field is implemented, refused with a 400
naming it, or ignored because it cannot change the output (docs/api.md, "What /v1 does with each field").
Through the ASGI app on the FakeEngine (no torch); the ``openai`` client's view is in test_openai_api.py.
"""

from __future__ import annotations

import logging

import pytest

from conftest import RecordingEngine, assert_error, bounded, serving

CHAT = [{"role": "user", "content": "Hello there"}]
COMPLETION = ("/v1/completions", {"prompt": "fields", "max_tokens": 4})
CHAT_COMPLETION = ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})

# field -> a value that asks for something not implemented (tools are, on /v1/chat, and response_format with a model:
# the FakeEngine has no tokenizer to compile grammars against)
REFUSED = {
    "suffix": "the end",
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "required",
    "response_format": {"type": "json_object"},
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {"search_context_size": "low"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "moderation": {"model": "m"},
    "best_of": 3,
}
# field -> a value that means "not used": accepted, same answer as without it
NEUTRAL = {
    "suffix": "",
    "functions": [],
    "function_call": "none",
    "tools": [],
    "tool_choice": "none",
    "response_format": {"type": "text"},
    "modalities": ["text"],
    "audio": None,
    "prediction": None,
    "reasoning_effort": None,
    "n": 1,
    "best_of": 1,
    "logit_bias": {},
}
IGNORED = {
    "user": "u-1",
    "metadata": {"trace": "x"},
    "store": True,
    "service_tier": "auto",
    "safety_identifier": "s",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "parallel_tool_calls": False,
    "stream_options": {"include_usage": False, "include_obfuscation": True},
}


def endpoints_for(field: str):
    return [COMPLETION] if field in ("best_of", "tools") else [COMPLETION, CHAT_COMPLETION]


@pytest.mark.parametrize("field", list(REFUSED))
def test_unimplemented_fields_are_400_naming_the_field(field):
    async def body():
        async with serving() as c:
            for path, payload in endpoints_for(field):
                for stream in (False, True):
                    r = await c.post(path, json={**payload, field: REFUSED[field], "stream": stream})
                    err = assert_error(r, 400, "invalid_request_error", f"`{field}`")
                    assert err["param"] == field

    bounded(body)


def test_neutral_and_ignored_values_give_the_same_answer():
    async def body():
        async with serving() as c:
            for path, payload in (COMPLETION, CHAT_COMPLETION):
                plain = await c.post(path, json={**payload, "temperature": 0})
                assert plain.status_code == 200, plain.text
                fields = {**NEUTRAL, **IGNORED}
                if path == CHAT_COMPLETION[0]:
                    fields.pop("best_of")
                for name, value in fields.items():
                    r = await c.post(path, json={**payload, "temperature": 0, name: value})
                    assert r.status_code == 200, (name, r.text)
                    assert r.json()["choices"] == plain.json()["choices"], name
                    assert r.json()["usage"] == plain.json()["usage"], name

    bounded(body)


def test_unknown_fields_are_ignored_and_logged_once(caplog):
    async def body():
        async with serving() as c:
            for path, payload in (COMPLETION, CHAT_COMPLETION):
                plain = await c.post(path, json=payload)
                extra = await c.post(path, json={**payload, "frobnicate_v1": 1, "guided_json_x": {"a": 1}})
                assert extra.status_code == 200, extra.text
                assert extra.json()["choices"] == plain.json()["choices"]

    with caplog.at_level(logging.WARNING, logger="minibatch.api"):
        bounded(body)
    lines = [r.getMessage() for r in caplog.records if "does not define" in r.getMessage()]
    assert len(lines) == 1 and "frobnicate_v1" in lines[0] and "guided_json_x" in lines[0], lines


@pytest.mark.parametrize(
    "message, param, words",
    [
        ({"role": "function", "name": "f", "content": "42"}, "messages.1.role", "function"),
        ({"role": "assistant", "content": "", "refusal": "no"}, "messages.1.refusal", "refusal"),
        ({"role": "assistant", "audio": {"id": "a1"}}, "messages.1.audio", "audio"),
        (
            {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {}}]},
            "messages.1.content.1.type",
            "image_url",
        ),
        (
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
            "messages.1.content.0.type",
            "input_audio",
        ),
        ({"role": "user", "content": [{"type": "file", "file": {}}]}, "messages.1.content.0.type", "file"),
    ],
)
def test_unimplemented_message_parts_are_400(message, param, words):
    async def body():
        async with serving() as c:
            r = await c.post("/v1/chat/completions", json={"messages": [*CHAT, message], "max_tokens": 2})
            err = assert_error(r, 400, "invalid_request_error", words)
            assert err["param"] == param

    bounded(body)


def test_text_parts_and_message_names_reach_the_template():
    """Text parts are joined; a message's ``name`` goes to the chat template (which may use it)."""

    async def body():
        engine = RecordingEngine(capacity=4)
        async with serving(engine) as c:
            base = {"max_tokens": 4, "temperature": 0}
            plain = await c.post("/v1/chat/completions", json={**base, "messages": CHAT})
            parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
            one_message = [{"role": "user", "content": parts}]
            split = await c.post("/v1/chat/completions", json={**base, "messages": one_message})
            assert split.status_code == 200 and split.json()["choices"] == plain.json()["choices"]
            assert engine.seen == [{"role": "user", "content": "Hello there"}]
            named = await c.post("/v1/chat/completions", json={**base, "messages": [{**CHAT[0], "name": "ann"}]})
            assert named.status_code == 200, named.text
            assert engine.seen == [{"role": "user", "content": "Hello there", "name": "ann"}]

    bounded(body)


def test_tool_history_and_tools_reach_any_template_in_the_generic_format():
    """A template that does not render tools (the fake's) still gets the tools, as a system preamble, and the
    history's calls and results, as JSON in the assistant's turn and a user turn (guided/tools.py GENERIC)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]}]
    history.append({"role": "tool", "content": "42", "tool_call_id": "c1"})
    tool = {"type": "function", "function": {"name": "f", "description": "F.", "parameters": {"type": "object"}}}

    async def body():
        engine = RecordingEngine(capacity=4)
        async with serving(engine) as c:
            r = await c.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert engine.seen == [
                CHAT[0],
                {"role": "assistant", "content": '{"name": "f", "arguments": {"x": 1}}'},
                {"role": "user", "content": "Result of the tool call c1 (f):\n42"},
            ]
            r = await c.post("/v1/chat/completions", json={"messages": CHAT, "tools": [tool], "max_tokens": 2})
            assert r.status_code == 200, r.text
            preamble = engine.seen[0]
            assert preamble["role"] == "system" and engine.seen[1:] == CHAT
            assert '{"name": "f", "description": "F.", "parameters": {"type": "object"}}' in preamble["content"]

    bounded(body)
