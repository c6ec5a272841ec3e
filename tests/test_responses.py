"""``POST /v1/responses`` through real clients against uvicorn on 127.0.0.1: the ``openai`` package
(``responses.create`` / ``responses.stream``) and the OpenAI Agents SDK's default model class (``Runner.run`` with a
function tool). The tiny random Llama's template does not render tools, so its tools go the generic way.

Greedy answers equal the chat endpoint's on the same conversation (both render it the same way); the event stream
reassembles into the whole answer; structured output and forced calls follow their grammar whatever the random
model samples.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import pytest

from config import Config
from engine import FakeEngine, RowFailure
from server import create_app

from conftest import bounded, serving
from live import ThreadServer, openai_client

TIMEOUT = 120.0
PLAIN_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "role": {"enum": ["admin", "guest"]}},
    "required": ["name", "role"],
    "additionalProperties": False,
}
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    from scripts.make_test_model import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")), shape="tiny", seed=0, arch="llama")


@pytest.fixture(scope="module")
def live(tiny_llama_dir):
    config = Config(
        model_id=tiny_llama_dir,
        served_model_name="tiny-llama",  # the Agents SDK reads "a/b" as provider "a"'s model "b"
        max_batch_size=4,
        chat_template=PLAIN_TEMPLATE,
        max_new_tokens_limit=200,
    )
    with ThreadServer(create_app(config)) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with openai_client(live, TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_greedy_text_equals_chat_and_input_forms_agree(client, model):
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_tokens=12,
        **GREEDY,
    )
    text = client.responses.create(model=model, instructions="Be brief.", input="Hello", max_output_tokens=12, **GREEDY)
    items = [
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
    ]
    listed = client.responses.create(model=model, input=items, max_output_tokens=12, **GREEDY)
    for r in (text, listed):
        assert r.object == "response" and r.id.startswith("resp_") and r.model == model
        assert r.output_text == chat.choices[0].message.content and r.output[0].type == "message"
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 12
        assert r.usage.total_tokens == r.usage.input_tokens + 12


def test_stream_is_the_responses_event_sequence_and_reassembles(client, model):
    whole = client.responses.create(model=model, input="Once", max_output_tokens=10, **GREEDY)
    with client.responses.stream(model=model, input="Once", max_output_tokens=10, **GREEDY) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(deltas) >= 2
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == events[-4].text == whole.output_text
    assert events[-1].response.output[0].content[0].text == whole.output_text
    assert events[-1].response.usage.output_tokens == 10


def test_text_format_json_schema_validates_streamed_and_not(client, model):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        r = client.responses.create(
            model=model, input="A user:", text=fmt, temperature=1.0, max_output_tokens=60, extra_body={"seed": seed}
        )
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), PERSON)
    with client.responses.stream(model=model, input="A user:", text=fmt, max_output_tokens=60, **GREEDY) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.text.format.type == "json_schema"
    jsonschema.validate(json.loads(final.output_text), PERSON)


def test_forced_function_call_and_its_round_trip(client, model):
    first = client.responses.create(
        model=model,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=60,
        temperature=1.0,
        extra_body={"seed": 3},
    )
    assert first.status == "completed" and len(first.output) == 1, first
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'},
    ]
    answer = client.responses.create(
        model=model, input=history, tools=[WEATHER], tool_choice="none", max_output_tokens=6, **GREEDY
    )
    assert answer.output[0].type == "message" and answer.output_text and answer.usage.output_tokens == 6
    # The history's call and result reach the prompt: it is longer than the question alone.
    alone = client.responses.create(model=model, input=history[:1], max_output_tokens=1, temperature=0)
    assert answer.usage.input_tokens > alone.usage.input_tokens + 10


def test_streamed_function_call_events(client, model):
    kwargs = dict(
        model=model, input="Weather?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}
    )
    whole = client.responses.create(**kwargs, max_output_tokens=60, temperature=0)
    with client.responses.stream(**kwargs, max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert events[4].arguments == whole.output[0].arguments == final.output[0].arguments
    assert final.output[0].name == "get_weather" and final.status == "completed"


def test_forced_call_cut_by_the_budget_is_still_a_call(client, model):
    """A forced call cut short: status incomplete, the call with its arguments so far (OpenAI's answer)."""
    kwargs = dict(model=model, input="Weather?", tools=[WEATHER], tool_choice="required", temperature=0)
    whole = client.responses.create(**kwargs, max_output_tokens=60)
    r = client.responses.create(**kwargs, max_output_tokens=whole.usage.output_tokens - 2)
    (call,) = r.output
    assert r.status == "incomplete" and call.type == "function_call" and call.status == "incomplete"
    assert call.name == "get_weather" and call.arguments.startswith("{")
    assert whole.output[0].arguments.startswith(call.arguments) and call.arguments != whole.output[0].arguments


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "stateless"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type", "reasoning"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
            "input_image",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id", "call_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type", "web_search"),
        ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity", "verbosity"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "include"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"not": {}}}}},
            "text.format",
            "not",
        ),
    ],
)
def test_what_is_not_implemented_is_a_400_naming_it(live, body, param, words):
    r = httpx.post(f"{live.url}/v1/responses", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["code"] == "invalid_request", err


def test_store_is_accepted_and_nothing_is_stored(live):
    body = {"input": "x", "store": True, "max_output_tokens": 2, "metadata": {"k": "v"}}
    r = httpx.post(f"{live.url}/v1/responses", json=body, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["store"] is False and r.json()["metadata"] == {"k": "v"}, r.text


def test_agents_sdk_default_model_runs_a_function_tool(live, model, tiny_llama_dir):
    """The Agents SDK's default model class (OpenAIResponsesModel) unchanged: a forced call runs the tool; with the
    default tool-use behaviour the next turn sends the call and its output back as input items and takes the
    answer (forced to end at once through ``logit_bias`` on EOS: a random model would not)."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:  # a bounded call: the random model fills a string forever
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    with open(f"{tiny_llama_dir}/config.json") as f:
        eos = json.load(f)["eos_token_id"]
    settings = agents.ModelSettings(tool_choice="required", max_tokens=60, extra_body={"logit_bias": {str(eos): 100}})

    async def main():
        client = AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        agents.set_default_openai_client(client, use_for_tracing=False)
        stop = agents.Agent(
            name="a",
            instructions="Use tools.",
            tools=[get_weather],
            model=model,
            model_settings=settings,
            tool_use_behavior="stop_on_first_tool",
        )
        first = await agents.Runner.run(stop, "Weather in Paris?")
        full = agents.Agent(
            name="b", instructions="Use tools.", tools=[get_weather], model=model, model_settings=settings
        )
        second = await agents.Runner.run(full, "Weather in Paris?", max_turns=3)
        await client.close()
        return first, second

    first, second = asyncio.run(main())
    assert type(agents.OpenAIProvider().get_model(model)).__name__ == "OpenAIResponsesModel"  # the default
    assert first.final_output == f"sunny in {seen[0]}" and len(seen) == 2
    assert len(second.raw_responses) == 2 and second.final_output == ""
    call = second.raw_responses[0].output[0]
    assert call.type == "function_call" and call.name == "get_weather"


def named_events(body: str) -> list[tuple[str, dict]]:
    """A Responses stream's (event name, payload) pairs: each block is ``event:`` then ``data:``."""
    out = []
    for block in body.split("\n\n"):
        if block.strip():
            event, data = block.split("\n")
            assert event.startswith("event: ") and data.startswith("data: "), block
            out.append((event[len("event: ") :], json.loads(data[len("data: ") :])))
    return out


def test_stream_with_tools_that_answers_text_and_a_stream_that_fails():
    """On the fake (no model): with tools offered and a text answer, the text is released as soon as it cannot be a
    call, in the same event sequence as without tools; a sequence that fails ends the stream with ``error`` and
    ``response.failed`` (no ``[DONE]``), each event named as its type."""
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]

    async def body():
        async with serving() as c:
            base = {"input": "hi", "max_output_tokens": 4, "stream": True}
            plain = named_events((await c.post("/v1/responses", json=base)).text)
            offered = named_events((await c.post("/v1/responses", json={**base, "tools": tools})).text)
            assert [n for n, _ in plain] == [n for n, _ in offered] and all(n == e["type"] for n, e in offered)
            deltas = [e["delta"] for n, e in offered if n == "response.output_text.delta"]
            assert "".join(deltas) == offered[-1][1]["response"]["output"][0]["content"][0]["text"]
        failing = FakeEngine(capacity=2, token_fn=lambda seq: RowFailure("boom"))
        async with serving(failing) as c:
            r = await c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4, "stream": True})
            events = named_events(r.text)
            assert [n for n, _ in events][-2:] == ["error", "response.failed"], events
            error, failed = events[-2][1], events[-1][1]["response"]
            assert error["code"] == "server_error" and "boom" in error["message"]
            assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
            assert [e["sequence_number"] for _, e in events] == list(range(len(events)))

    bounded(body)
