"""Tools on any model (guided/tools.py): the generic format for a template that does not render tools, forced calls
cut by the budget, and OpenAI's stream deltas, through the ``openai`` client against uvicorn on 127.0.0.1 (the tiny
random Llama: whatever it samples, a forced call parses and validates) and as unit checks of the two formats.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from config import Config
from guided.tools import GENERIC, HERMES, ToolCalling
from server import create_app

from live import ThreadServer, openai_client

TIMEOUT = 120.0
PLAIN_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    from scripts.make_test_model import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")), shape="tiny", seed=0, arch="llama")


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    config = Config(model_id=tiny_llama_dir, served_model_name="tiny", max_batch_size=4, chat_template=PLAIN_TEMPLATE)
    with ThreadServer(create_app(config)) as server, openai_client(server, TIMEOUT) as c:
        yield c


def reassemble(stream) -> tuple[dict[int, dict], str | None, list]:
    """A chat stream's tool-call deltas joined per call index, its finish reason, and the raw deltas."""
    calls: dict[int, dict] = {}
    finish, raw = None, []
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                raw.append(delta.model_dump(exclude_none=True))
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish, raw


def test_forced_calls_on_a_template_without_tools(client):
    """The generic format: required picks some tool, a named choice that one; every call validates, and the streamed
    deltas (the first carrying id, type, name and ``"arguments": ""``) reassemble into the same call."""
    for seed in range(2):
        out = client.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required", seed=seed, max_tokens=80
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        params = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), params)
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], temperature=0, max_tokens=80)
    kwargs["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    calls, finish, raw = reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls" and list(calls) == [0]
    assert raw[0] == {
        "index": 0,
        "id": raw[0]["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == whole.function.arguments


def test_a_forced_call_cut_by_max_tokens_is_still_a_call(client):
    """OpenAI's answer: tool_calls with the arguments so far and finish_reason "length", streamed and not."""
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0)
    whole = client.chat.completions.create(**kwargs, max_tokens=80)
    full_args = whole.choices[0].message.tool_calls[0].function.arguments
    budget = whole.usage.completion_tokens - 2
    cut = client.chat.completions.create(**kwargs, max_tokens=budget).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    (call,) = cut.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert full_args.startswith(call.function.arguments) and call.function.arguments != full_args
    calls, finish, _ = reassemble(client.chat.completions.create(**kwargs, max_tokens=budget, stream=True))
    assert finish == "length" and calls[0]["arguments"] == call.function.arguments


def test_auto_answers_parse_as_calls_or_content_alike_streamed_and_not(client):
    for seed in range(3):
        kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER], temperature=1.0, seed=seed, max_tokens=12)
        whole = client.chat.completions.create(**kwargs).choices[0]
        text = "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True) if c.choices
        )
        assert whole.message.tool_calls is None and whole.message.content == text


def test_generic_format_parses_a_bare_object_a_list_and_a_fence_only():
    names = ["f", "g"]
    one = GENERIC.parse('{"name": "f", "arguments": {"a": 1}}', names)
    assert [c["function"] for c in one] == [{"name": "f", "arguments": '{"a":1}'}]
    two = GENERIC.parse('```json\n[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": [2]}}]\n```', names)
    assert [c["function"]["name"] for c in two] == ["f", "g"] and two[0]["id"] != two[1]["id"]
    for text in ('{"name": "h", "arguments": {}}', '{"name": "f", "arguments": 3}', 'Sure: {"name": "f"}', "", "[]"):
        assert GENERIC.parse(text, names) is None, text
    assert GENERIC.may_be_call("  {") and GENERIC.may_be_call("``") and not GENERIC.may_be_call("Hello")


def test_cut_calls_keep_their_arguments_so_far():
    calling = ToolCalling(GENERIC, ("get_weather", "get_time"), forced=True)
    calls, finish = calling.answer('{"name":"get_weather","arguments":{"city":"Pa', "length")
    assert finish == "length" and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city":"Pa'}
    calls, _ = calling.answer('{"name":"get_w', "length")  # the one name it begins
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calling.answer('{"name":"get_', "length") == (None, "length")  # two names begin so
    assert calling.answer('{"na', "length") == (None, "length")  # cut before the name: either function
    calls, _ = ToolCalling(GENERIC, ("get_time",), forced=True).answer('{"na', "length")  # ... or the only one
    assert calls[0]["function"] == {"name": "get_time", "arguments": ""}
    hermes = ToolCalling(HERMES, ("f",), forced=True)
    calls, finish = hermes.answer('<tool_call>\n{"name":"f","arguments":{"x":[1,', "length")
    assert finish == "length" and calls[0]["function"]["arguments"] == '{"x":[1,'
    assert ToolCalling(GENERIC, ("f",), forced=False).answer('{"name":"f","arg', "length") == (None, "length")


def test_generic_tools_off_keeps_the_400(tiny_llama_dir):
    config = Config(model_id=tiny_llama_dir, max_batch_size=1, chat_template=PLAIN_TEMPLATE, generic_tools=False)
    with ThreadServer(create_app(config)) as server, openai_client(server, TIMEOUT) as c:
        with pytest.raises(Exception) as info:
            c.chat.completions.create(model=config.model_name, messages=ASK, tools=[WEATHER], max_tokens=2)
        assert info.value.status_code == 400 and info.value.body["param"] == "tools"
