"""Documented promises (README and docs/) that no other test pinned down, checked through HTTP on the FakeEngine
(no torch).

Each test names the documented sentence it holds the server to. Everything goes through the ASGI app with
its lifespan (``serving``) and looks only at HTTP answers and ``/metrics``, so the tests do not depend
on how the server is built inside. Every wait is bounded; nothing asserts on durations.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from config import Config
from engine import FakeEngine
from server import create_app

from conftest import Gate, assert_error, bounded, metric, scrape, serving, sse_events, wait_until

KEY = "promise-key-0123456789"
CHAT = [{"role": "user", "content": "Hello there"}]


async def wait_metric(c: httpx.AsyncClient, name: str, value: float, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while (got := metric(await scrape(c), name)) != value:
        assert asyncio.get_running_loop().time() < deadline, f"{name} stayed {got}, expected {value}"
        await asyncio.sleep(0.005)


def completion(r: httpx.Response) -> tuple[str, dict]:
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]


# --- /v1/completions ----------------------------------------------------------------------------------------


def test_completion_prompt_may_be_a_list_of_strings():
    """Docs: "`prompt` may be a string, a list of strings, a list of token ids, or a list of token-id lists";
    several prompts give one choice each, in order."""

    async def body():
        async with serving() as c:
            base = {"max_tokens": 6, "temperature": 0}
            text, usage = completion(await c.post("/v1/completions", json={**base, "prompt": "one string"}))
            listed, listed_usage = completion(await c.post("/v1/completions", json={**base, "prompt": ["one string"]}))
            assert (listed, listed_usage) == (text, usage)
            other, _ = completion(await c.post("/v1/completions", json={**base, "prompt": ["another string"]}))
            assert other != text  # the answer really depends on the string inside the list
            r = await c.post("/v1/completions", json={**base, "prompt": ["one string", "another string"]})
            assert [ch["text"] for ch in r.json()["choices"]] == [text, other]

    bounded(body)


def test_n_choices_and_best_of_equal_to_n():
    """Docs: "`n` (1 to `MAX_N`) choices per prompt, `best_of` only equal to `n`" (beyond MAX_N: 422; 0 is not
    a count: 422; `best_of` other than `n`: 400)."""

    async def body():
        async with serving() as c:
            base = {"prompt": "choices", "max_tokens": 3}
            one, _ = completion(await c.post("/v1/completions", json={**base, "n": 1, "best_of": 1}))
            assert one == completion(await c.post("/v1/completions", json=base))[0]
            r = await c.post("/v1/completions", json={**base, "n": 3, "best_of": 3})
            assert [ch["index"] for ch in r.json()["choices"]] == [0, 1, 2]
            for bad in (2, 5):
                assert_error(await c.post("/v1/completions", json={**base, "best_of": bad}), 400, contains="best_of")
            for field in ("n", "best_of"):
                assert_error(await c.post("/v1/completions", json={**base, field: 0}), 422, contains=field)
            assert_error(await c.post("/v1/completions", json={**base, "n": 9}), 422, contains="MAX_N")

    bounded(body)


def test_echo_with_logprobs_scores_the_prompt_too():
    """Docs: "`echo` with `logprobs` also returns the prompt's tokens and logprobs (the first one's null)";
    the FakeEngine is certain of every token (logprob 0)."""

    async def body():
        async with serving() as c:
            base = {"prompt": "echo me", "max_tokens": 3}
            echoed, _ = completion(await c.post("/v1/completions", json={**base, "echo": True}))
            plain, _ = completion(await c.post("/v1/completions", json=base))
            assert echoed == "echo me" + plain
            r = await c.post("/v1/completions", json={**base, "logprobs": 1})
            assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 3
            r = await c.post("/v1/completions", json={**base, "echo": True, "logprobs": 1})
            lp = r.json()["choices"][0]["logprobs"]
            assert "".join(lp["tokens"]) == echoed and lp["token_logprobs"] == [None] + [0.0] * 9
            assert lp["text_offset"] == list(range(10))

    bounded(body)


# --- /v1/chat/completions budgets ---------------------------------------------------------------------------


def test_chat_takes_max_tokens_or_max_completion_tokens():
    """Docs: chat "takes `max_tokens` or `max_completion_tokens`"; each is a budget, checked against the limit."""

    async def body():
        async with serving(max_new_tokens_limit=40) as c:
            for field, n in [("max_completion_tokens", 5), ("max_tokens", 7), ("max_completion_tokens", 40)]:
                r = await c.post("/v1/chat/completions", json={"messages": CHAT, field: n})
                assert r.status_code == 200, r.text
                b = r.json()
                assert b["usage"]["completion_tokens"] == n and len(b["choices"][0]["message"]["content"]) == n
                assert b["choices"][0]["finish_reason"] == "length"
            r = await c.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 41})
            assert_error(r, 422, "invalid_request_error", "max_completion_tokens")

    bounded(body)


@pytest.mark.parametrize("max_context, limit", [(1000, 24), (60, 512)], ids=["capped-by-limit", "rest-of-window"])
def test_chat_default_budget_is_the_rest_of_the_window_capped_at_the_limit(max_context, limit):
    """Docs: without a budget, chat gets "what is left of the context window, capped at MAX_NEW_TOKENS_LIMIT"."""

    async def body():
        async with serving(FakeEngine(max_context=max_context), max_new_tokens_limit=limit) as c:
            r = await c.post("/v1/chat/completions", json={"messages": CHAT})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["completion_tokens"] == min(max_context - usage["prompt_tokens"], limit), usage
            assert r.json()["choices"][0]["finish_reason"] == "length"

    bounded(body)


# --- unknown fields -----------------------------------------------------------------------------------------


def test_unknown_fields_are_ignored_on_v1_and_rejected_on_generate():
    """Docs: "Fields OpenAI does not define are ignored on `/v1` ... but rejected on `/generate`"."""
    unknown = {"frobnicate": True, "metadata": {"trace": "x"}, "service_tier": "auto", "parallel_tool_calls": False}

    async def body():
        async with serving() as c:
            for path, payload in [
                ("/v1/completions", {"prompt": "fields", "max_tokens": 4}),
                ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4}),
            ]:
                plain = await c.post(path, json=payload)
                extra = await c.post(path, json={**payload, **unknown})
                assert plain.status_code == extra.status_code == 200, extra.text
                assert extra.json()["choices"] == plain.json()["choices"]
                assert extra.json()["usage"] == plain.json()["usage"]
            r = await c.post("/generate", json={"prompt": "fields", "max_new_tokens": 4, "frobnicate": True})
            assert_error(r, 422, "invalid_request_error", "frobnicate")

    bounded(body)


# --- limits: 0 means none, and what is counted --------------------------------------------------------------


def test_max_prompt_chars_counts_the_rendered_chat_template():
    """Docs: MAX_PROMPT_CHARS is "counted in characters before tokenizing (for chat: the rendered template)".
    The FakeEngine tokenizes bytes, so an ASCII prompt's prompt_tokens is its rendered length."""

    def chat(content: str) -> dict:
        return {"messages": [{"role": "user", "content": content}], "max_tokens": 1}

    async def body():
        async with serving() as c:
            r = await c.post("/v1/chat/completions", json=chat("x" * 30))
            overhead = r.json()["usage"]["prompt_tokens"] - 30  # the template's own characters
            assert overhead > 0
        limit = 40
        async with serving(max_prompt_chars=limit) as c:
            fits = "y" * (limit - overhead)
            assert (await c.post("/v1/chat/completions", json=chat(fits))).status_code == 200
            # One more character: the content alone is far below the limit, the rendered prompt is over it.
            r = await c.post("/v1/chat/completions", json=chat(fits + "y"))
            err = assert_error(r, 422, "invalid_request_error", "MAX_PROMPT_CHARS")
            assert f"{limit + 1} characters" in err["message"], err
            assert (await c.post("/v1/completions", json={"prompt": fits + "y", "max_tokens": 1})).status_code == 200

    bounded(body)


def test_max_prompt_chars_0_means_no_limit():
    """Docs: MAX_PROMPT_CHARS "100000 (0 = none)"."""
    prompt = "z" * 150_000  # past the default limit, under the default MAX_BODY_BYTES

    async def body():
        async with serving(FakeEngine(max_context=200_000)) as c:
            assert_error(
                await c.post("/generate", json={"prompt": prompt, "max_new_tokens": 1}),
                422,
                contains="MAX_PROMPT_CHARS",
            )
        async with serving(FakeEngine(max_context=200_000), max_prompt_chars=0) as c:
            for path, payload in [
                ("/generate", {"prompt": prompt, "max_new_tokens": 1}),
                ("/v1/completions", {"prompt": prompt, "max_tokens": 1}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}),
            ]:
                r = await c.post(path, json=payload)
                assert r.status_code == 200, (path, r.text[:300])
                assert r.json()["usage"]["prompt_tokens"] >= 150_000

    bounded(body)


def test_max_concurrent_requests_0_means_no_limit():
    """Docs: MAX_CONCURRENT_REQUESTS "2048 (0 = none)": 2100 requests in flight at once, none refused."""
    n = 2100  # more than the default, so 0 cannot be read as "the default" either

    async def body():
        gate = Gate()
        eng = FakeEngine(capacity=256, step_fault=gate.wait)
        try:
            async with serving(eng, max_concurrent_requests=0, max_queue_depth=4096) as c:
                tasks = [
                    asyncio.create_task(c.post("/generate", json={"prompt": f"c{i}", "max_new_tokens": 2}))
                    for i in range(n)
                ]
                in_flight = 0.0

                def all_in() -> bool:
                    return in_flight == n or any(t.done() for t in tasks)

                while not all_in():
                    in_flight = metric(await scrape(c), "minibatch:num_requests_in_flight")
                    await asyncio.sleep(0.01)
                assert not any(t.done() for t in tasks), [t.result().text for t in tasks if t.done()][:3]
                gate.open.set()
                rs = await asyncio.wait_for(asyncio.gather(*tasks), 30)
                assert {r.status_code for r in rs} == {200}
                assert metric(await scrape(c), "minibatch:request_rejected_total", 'reason="too_many_connections"') == 0
        finally:
            gate.open.set()

    bounded(body, timeout=60)


def test_time_limits_0_mean_none():
    """Docs: MAX_QUEUE_TIME_S / REQUEST_TIMEOUT_S "0 (none)": a request that waits behind a held slot
    and then runs still gets its answer."""

    async def body():
        gate = Gate()
        eng = FakeEngine(capacity=1, step_fault=gate.wait)
        try:
            async with serving(eng, max_queue_time_s=0, request_timeout_s=0) as c:
                first = asyncio.create_task(c.post("/generate", json={"prompt": "first", "max_new_tokens": 3}))
                await wait_until(gate.entered.is_set, what="the first request's step")
                second = asyncio.create_task(c.post("/generate", json={"prompt": "second", "max_new_tokens": 3}))
                await wait_metric(c, "minibatch:num_requests_waiting", 1)
                await asyncio.sleep(0.3)  # both sit there: one in a held step, one in the queue
                assert not first.done() and not second.done()
                gate.open.set()
                rs = await asyncio.wait_for(asyncio.gather(first, second), 10)
                assert [r.status_code for r in rs] == [200, 200]
                assert metric(await scrape(c), "minibatch:request_success_total", 'finished_reason="timeout"') == 0
        finally:
            gate.open.set()

    bounded(body)


# --- time limits on streams ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, payload",
    [
        ("/generate", {"prompt": "late", "max_new_tokens": 2}),
        ("/v1/completions", {"prompt": "late", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
    ],
    ids=["generate", "completions", "chat"],
)
def test_queue_timeout_in_a_stream_is_an_error_event(path, payload):
    """Docs: past MAX_QUEUE_TIME_S "the request ends with a **504** (`"type": "timeout"`), or an error
    event in a stream"."""

    async def body():
        eng = FakeEngine(capacity=1, step_delay=0.002, max_context=1_000_000)
        async with serving(eng, max_queue_time_s=0.2, max_new_tokens_limit=100_000) as c:
            long = asyncio.create_task(c.post("/generate", json={"prompt": "long", "max_new_tokens": 100_000}))
            await wait_metric(c, "minibatch:num_requests_running", 1)
            r = await c.post(path, json={**payload, "stream": True})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r.text)
            if events[-1] == "[DONE]":
                events = events[:-1]
            err = events[-1]
            assert set(err) == {"error"}, events
            assert err["error"]["code"] == "timeout" and err["error"]["type"] == "timeout", err
            assert "waiting in the queue" in err["error"]["message"], err
            # Nothing was generated for it: at most an opening frame (the chat role) before the error.
            for e in events[:-1]:
                choice = e["choices"][0]
                assert not choice.get("text") and not choice.get("delta", {}).get("content"), events
            assert metric(await scrape(c), "minibatch:request_success_total", 'finished_reason="timeout"') == 1
            assert not long.done()
            long.cancel()
            await asyncio.gather(long, return_exceptions=True)

    bounded(body)


# --- auth, drain --------------------------------------------------------------------------------------------


def test_api_key_is_required_on_chat():
    """Docs: with API_KEY set, "every endpoint except /health, /ready and /metrics requires
    `Authorization: Bearer <key>`" — chat included, streamed or not."""

    async def body():
        async with serving(api_key=KEY) as c:
            payload = {"messages": CHAT, "max_tokens": 3}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                for stream in (False, True):
                    r = await c.post("/v1/chat/completions", json={**payload, "stream": stream}, headers=headers)
                    assert_error(r, 401, "authentication_error", "API key")
            auth = {"Authorization": f"Bearer {KEY}"}
            r = await c.post("/v1/chat/completions", json=payload, headers=auth)
            assert r.status_code == 200 and len(r.json()["choices"][0]["message"]["content"]) == 3
            r = await c.post("/v1/chat/completions", json={**payload, "stream": True}, headers=auth)
            assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
            assert metric(await scrape(c), "minibatch:request_rejected_total", 'reason="auth"') == 6
            assert metric(await scrape(c), "minibatch:generation_tokens_total") == 6

    bounded(body)


def test_draining_gauge_goes_to_1_when_the_server_shuts_down():
    """Docs: `minibatch:draining` is "1 while draining". The app's shutdown (what uvicorn runs on
    SIGTERM) starts the drain while a request is still in the engine: the gauge turns 1, readiness
    turns 0, and new requests get a 503."""

    async def body():
        gate = Gate()
        app = create_app(
            config=Config(model_id="fake", log_level="WARNING"), engine=FakeEngine(capacity=1, step_fault=gate.wait)
        )
        lifespan = app.router.lifespan_context(app)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            await lifespan.__aenter__()
            shutdown = None
            try:
                assert metric(await scrape(c), "minibatch:draining") == 0
                assert metric(await scrape(c), "minibatch:ready") == 1
                held = asyncio.create_task(c.post("/generate", json={"prompt": "held", "max_new_tokens": 3}))
                await wait_until(gate.entered.is_set, what="the held step")
                shutdown = asyncio.create_task(lifespan.__aexit__(None, None, None))
                await wait_metric(c, "minibatch:draining", 1)
                assert metric(await scrape(c), "minibatch:ready") == 0
                assert (await c.get("/ready")).status_code == 503
                assert_error(await c.post("/generate", json={"prompt": "new"}), 503, "unavailable", "shutting down")
                gate.open.set()
                await asyncio.wait_for(shutdown, 10)
                r = await asyncio.wait_for(held, 10)
                assert r.status_code in (200, 503), r.text
                if r.status_code == 503:
                    assert_error(r, 503, "unavailable", "shutting down")
                assert metric(await scrape(c), "minibatch:draining") == 1
                assert metric(await scrape(c), "minibatch:request_rejected_total", 'reason="draining"') == 1
            finally:
                gate.open.set()
                if shutdown is None:
                    await lifespan.__aexit__(None, None, None)

    bounded(body)
