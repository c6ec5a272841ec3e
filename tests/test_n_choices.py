"""``n`` > 1 on /v1: n choices per prompt, sharing the prompt's prefill through the prefix cache.

Model-free tests (FakeEngine, greedy-like: its choices are equal) check the shape: indices, usage counted
once per prompt, streamed frames, MAX_N, and that the prompt is computed once. The model tests sample on the
tiny GPT-2 through the official ``openai`` client against a real uvicorn: seeded choices distinct and
reproducible one by one, greedy choices equal.
"""

from __future__ import annotations

import pytest
from conftest import assert_error, bounded, fake_text, serving
from live import openai_client
from test_streaming_cancel import parse_sse

from engine import FakeEngine
from openai_api import choice_seed


def test_choice_seeds_are_their_own_streams():
    assert choice_seed(None, 3) is None and choice_seed(7, 0) == 7
    seeds = [choice_seed(7, i) for i in range(8)]
    assert len(set(seeds)) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [choice_seed(7, i) for i in range(8)] and choice_seed(8, 1) != seeds[1]


def test_completions_n_choices_prompt_major_with_usage_counting_each_prompt_once():
    async def body():
        async with serving() as c:
            r = await c.post("/v1/completions", json={"prompt": ["first", "second one"], "max_tokens": 4, "n": 3})
            assert r.status_code == 200, r.text
            b = r.json()
            assert [ch["index"] for ch in b["choices"]] == list(range(6))
            texts = [ch["text"] for ch in b["choices"]]
            assert texts == [fake_text("first", 4)] * 3 + [fake_text("second one", 4)] * 3
            assert b["usage"] == {
                "prompt_tokens": 5 + 10,  # each prompt once, not once per choice
                "completion_tokens": 6 * 4,
                "total_tokens": 15 + 24,
                "prompt_tokens_details": {"cached_tokens": 0},
            }

    bounded(body)


def test_chat_n_choices():
    async def body():
        async with serving() as c:
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "temperature": 0}
            b = (await c.post("/v1/chat/completions", json=chat)).json()
            assert [ch["index"] for ch in b["choices"]] == [0, 1]
            assert b["choices"][0]["message"] == b["choices"][1]["message"]  # greedy: n equal choices
            assert b["usage"]["completion_tokens"] == 6 and b["usage"]["prompt_tokens"] == len("<user>hi\n<assistant>")

    bounded(body)


def test_streamed_frames_carry_each_choice_index():
    async def body():
        async with serving() as c:
            opts = {"stream": True, "stream_options": {"include_usage": True}, "n": 3, "max_tokens": 4}
            events = parse_sse((await c.post("/v1/completions", json={"prompt": "abc", **opts})).text)
            assert events[-1] == "[DONE]"
            *frames, usage = events[:-1]
            assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 3
            assert usage["usage"]["completion_tokens"] == 12
            for i in range(3):
                mine = [f["choices"][0] for f in frames if f["choices"][0]["index"] == i]
                assert "".join(ch["text"] for ch in mine) == fake_text("abc", 4)
                assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["length"]
            chat = {"messages": [{"role": "user", "content": "hi"}], **opts, "n": 2}
            events = parse_sse((await c.post("/v1/chat/completions", json=chat)).text)
            frames = [e for e in events[:-1] if e["choices"]]
            roles = [f["choices"][0]["index"] for f in frames if f["choices"][0]["delta"].get("role")]
            assert sorted(roles) == [0, 1]
            for i in (0, 1):
                mine = [f["choices"][0] for f in frames if f["choices"][0]["index"] == i]
                assert "".join(ch["delta"].get("content", "") for ch in mine) == fake_text("<user>hi\n<assistant>", 4)
                assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["length"]

    bounded(body)


def test_n_beyond_max_n_is_422_on_both_endpoints():
    async def body():
        async with serving(max_n=2) as c:
            r = await c.post("/v1/completions", json={"prompt": "x", "n": 3})
            assert assert_error(r, 422, "invalid_request_error", "MAX_N")["param"] == "n"
            chat = {"messages": [{"role": "user", "content": "x"}], "n": 3}
            assert_error(await c.post("/v1/chat/completions", json=chat), 422, contains="MAX_N")
            assert (await c.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 1})).status_code == 200

    bounded(body)


def test_the_prompt_is_computed_once_for_n_choices():
    """Block size 4, an 18-token prompt: choice 0 computes it, the other 3 find its 4 full blocks cached and
    compute only the 2 tokens of the last one."""

    async def body():
        engine = FakeEngine(capacity=8, block_size=4)
        async with serving(engine) as c:
            r = await c.post("/v1/completions", json={"prompt": "eighteen bytes....", "n": 4, "max_tokens": 2})
            assert r.json()["usage"]["prompt_tokens"] == 18
            assert engine.prefill_tokens_computed == 18 + 3 * 2
            assert engine.blocks.is_all_free()

    bounded(body)


# --- the tiny GPT-2 through the openai client -----------------------------------------------------------


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    from live import ThreadServer

    from config import Config
    from server import create_app

    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    config = Config(
        model_id=tiny_model_dir, served_model_name="tiny", chat_template=template, max_batch_size=8, log_level="WARNING"
    )
    with ThreadServer(create_app(config)) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with openai_client(live) as c:
        yield c


@pytest.mark.model
def test_openai_client_n_seeded_choices_distinct_and_reproducible_one_by_one(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    r = client.completions.create(n=4, seed=11, **kw)
    texts = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in sorted(r.choices, key=lambda ch: ch.index)] == [0, 1, 2, 3]
    assert len(set(texts)) >= 3, texts  # independent streams
    assert [ch.text for ch in client.completions.create(n=4, seed=11, **kw).choices] == texts
    for i, text in enumerate(texts):  # choice i alone: n 1 with its own seed
        assert client.completions.create(n=1, seed=choice_seed(11, i), **kw).choices[0].text == text
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 48
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # 4 tokens: no full block before the last token


@pytest.mark.model
def test_openai_client_n_greedy_and_streamed(client, live):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # long enough for cached blocks
    kw = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    before = live.state.engine.prefill_tokens_computed
    r = client.completions.create(n=3, **kw)
    assert len({ch.text for ch in r.choices}) == 1  # greedy: the choices are equal
    computed = live.state.engine.prefill_tokens_computed - before
    assert computed < 2 * r.usage.prompt_tokens, computed  # the prompt once, plus the other choices' last block
    streamed = {0: "", 1: "", 2: ""}
    for ev in client.completions.create(n=3, stream=True, **kw):
        for ch in ev.choices:
            streamed[ch.index] += ch.text
    assert list(streamed.values()) == [r.choices[0].text] * 3
    chat = dict(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=6, n=2, seed=3)
    first = client.chat.completions.create(**chat)
    assert [ch.index for ch in first.choices] == [0, 1] and first.usage.completion_tokens <= 12
    again = client.chat.completions.create(**chat)
    assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in first.choices]
