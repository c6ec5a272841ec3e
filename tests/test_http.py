"""HTTP contract through a real ASGI client over FakeEngine: shapes, validation, backpressure, failures."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from config import Config
from engine import FakeEngine
from server import create_app

from conftest import Gate, assert_error, bounded, fake_ids, fake_text, serving, wait_until

LIMIT = 64  # MAX_NEW_TOKENS_LIMIT in most tests


def assert_ok(r: httpx.Response, prompt: str, n: int, request_id: str | None = None) -> dict:
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"request_id", "text", "token_ids", "finish_reason", "usage", "metrics"}
    assert body["text"] == fake_text(prompt, n)
    assert body["token_ids"] == fake_ids(prompt, n)
    assert body["finish_reason"] == "length"
    p = len(prompt.encode("utf-8"))
    assert body["usage"] == {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
    if request_id is not None:
        assert body["request_id"] == request_id
    return body


# --- success -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, n", [("hello", 4), ("x", 1), ("héllo 😀", 7), ("a b\nc", LIMIT)])
def test_generate_200_shape(prompt, n):
    async def body():
        async with serving(FakeEngine(max_context=1024)) as c:
            r = await c.post("/generate", json={"prompt": prompt, "max_new_tokens": n, "request_id": "abc-1"})
            b = assert_ok(r, prompt, n, request_id="abc-1")
            m = b["metrics"]
            assert set(m) == {"queue_wait_ms", "ttft_ms", "generate_ms", "e2e_ms"}
            assert all(isinstance(v, float) and v >= 0 for v in m.values()), m
            assert m["queue_wait_ms"] <= m["ttft_ms"] <= m["e2e_ms"]
            assert m["generate_ms"] <= m["e2e_ms"]

    bounded(body)


def test_generate_takes_a_prompt_as_token_ids():
    """Token ids are fed as they are: the same answer as the text they encode, streamed or not."""

    async def body():
        async with serving(FakeEngine(max_context=1024)) as c:
            ids = [b + 1 for b in "héllo".encode()]  # the fake's tokenizer: token b + 1 per UTF-8 byte b
            r = await c.post("/generate", json={"prompt": ids, "max_new_tokens": 5})
            assert_ok(r, "héllo", 5)
            r = await c.post("/generate", json={"prompt": ids, "max_new_tokens": 5, "stream": True})
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert [t for e in events for t in e.get("token_ids", [])] == fake_ids("héllo", 5)

    bounded(body)


def test_request_id_generated_when_absent():
    async def body():
        async with serving() as c:
            r1 = await c.post("/generate", json={"prompt": "hi"})
            r2 = await c.post("/generate", json={"prompt": "hi", "request_id": None})
            b1 = assert_ok(r1, "hi", 16)  # default max_new_tokens
            b2 = assert_ok(r2, "hi", 16)
            assert b1["request_id"].startswith("req-") and len(b1["request_id"]) > 8
            assert b1["request_id"] != b2["request_id"]

    bounded(body)


def test_finish_reason_stop():
    def token_fn(s):
        return FakeEngine.EOS if len(s.output_token_ids) == 2 else ord("z") + 1

    async def body():
        async with serving(FakeEngine(token_fn=token_fn)) as c:
            r = await c.post("/generate", json={"prompt": "abc", "max_new_tokens": 10})
            assert r.status_code == 200, r.text
            b = r.json()
            assert b["finish_reason"] == "stop"
            assert b["token_ids"] == [ord("z") + 1, ord("z") + 1, 0]
            assert b["text"] == "zz"  # EOS is not text
            assert b["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}

    bounded(body)


def test_config_stop_token_ids_reach_the_built_engine():
    stop = ord(fake_text("abc", 3)[2]) + 1  # the third letter of the answer to "abc"

    async def body():
        app = create_app(config=Config(model_id="fake", max_batch_size=3, stop_token_ids=(stop,)))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                h = (await c.get("/health")).json()
                assert h["model"] == "fake" and h["capacity"] == 3
                r = await c.post("/generate", json={"prompt": "abc", "max_new_tokens": 10})
                assert r.json()["finish_reason"] == "stop"
                assert r.json()["token_ids"] == fake_ids("abc", 3)

    bounded(body)


def test_the_engine_is_built_and_stepped_on_one_thread_and_planned_on_the_loop(monkeypatch):
    """scheduler.engine_thread: libgomp spins its workers only while its pools fit the cores, so the thread
    that builds the engine (OpenMP pool made while packing weights) must be the one that steps it. The planner
    (schedule, update_from_output), which keeps the KV books and the sequences' status, runs on the event loop
    only (docs/architecture.md, "Threading")."""
    import threading

    import server

    threads: dict[str, set[int]] = {"build": set(), "step": set(), "plan": set(), "loop": set()}

    class Recording(FakeEngine):
        def execute(self, plan):
            threads["step"].add(threading.get_ident())
            return super().execute(plan)

    def recorded(method):
        def call(*args, **kwargs):
            threads["plan"].add(threading.get_ident())
            return method(*args, **kwargs)

        return call

    def load(config):
        threads["build"].add(threading.get_ident())
        engine = Recording(capacity=2)
        engine.planner.schedule = recorded(engine.planner.schedule)
        engine.planner.update_from_output = recorded(engine.planner.update_from_output)
        return engine

    monkeypatch.setattr(server, "load_engine", load)

    async def body():
        threads["loop"].add(threading.get_ident())
        app = create_app(config=Config(model_id="fake", max_batch_size=2))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                for prompt in ("ab", "cd"):
                    assert (await c.post("/generate", json={"prompt": prompt, "max_new_tokens": 4})).status_code == 200

    bounded(body)
    assert len(threads["build"]) == 1 and threads["step"] == threads["build"]
    assert not threads["loop"] & threads["build"]  # the worker is not the event loop's thread
    assert threads["plan"] == threads["loop"]


@pytest.mark.parametrize("temperature", [0, 0.0, -0.0])
def test_temperature_zero_accepted(temperature):
    async def body():
        async with serving() as c:
            r = await c.post("/generate", json={"prompt": "t", "max_new_tokens": 2, "temperature": temperature})
            assert_ok(r, "t", 2)

    bounded(body)


def test_context_window_boundary():
    async def body():
        async with serving(FakeEngine(max_context=16)) as c:
            prompt = "p" * (16 - 10)
            ok = await c.post("/generate", json={"prompt": prompt, "max_new_tokens": 10})
            assert_ok(ok, prompt, 10)
            over = await c.post("/generate", json={"prompt": prompt + "q", "max_new_tokens": 10})
            assert_error(over, 422, "invalid_request_error", "context window of 16 tokens")

    bounded(body)


def test_max_new_tokens_at_the_limit():
    async def body():
        async with serving(FakeEngine(max_context=4096), max_new_tokens_limit=8) as c:
            assert_ok(await c.post("/generate", json={"prompt": "l", "max_new_tokens": 8}), "l", 8)
            assert_error(await c.post("/generate", json={"prompt": "l", "max_new_tokens": 9}), 422, contains="[1, 8]")

    bounded(body)


def test_concurrent_requests_each_get_their_own_answer():
    async def body():
        async with serving(FakeEngine(capacity=3, step_delay=0.001)) as c:
            reqs = [(f"prompt number {i}", 1 + (i * 5) % 13, f"id-{i % 4}") for i in range(24)]
            rs = await asyncio.gather(
                *(c.post("/generate", json={"prompt": p, "max_new_tokens": n, "request_id": rid}) for p, n, rid in reqs)
            )
            for (p, n, rid), r in zip(reqs, rs):
                assert_ok(r, p, n, request_id=rid)
            h = (await c.get("/health")).json()
            assert h["engine"]["peak_batch"] == 3
            assert h["running"] == 0 and h["waiting"] == 0

    bounded(body)


# --- health ----------------------------------------------------------------------------------------------


def test_health_ok():
    async def body():
        async with serving(FakeEngine(capacity=5)) as c:
            await c.post("/generate", json={"prompt": "x", "max_new_tokens": 3})
            r = await c.get("/health")
            assert r.status_code == 200
            h = r.json()
            assert h["status"] == "ok"
            assert h["model"] == "fake"
            assert h["capacity"] == 5
            assert h["running"] == 0 and h["waiting"] == 0
            assert h["engine"] == {
                "steps": 2,
                "peak_batch": 1,
                "generated_tokens": 3,
                "kv_blocks": 160,
                "kv_free_blocks": 160,
                "kv_block_size": 32,
                "num_preemptions": 0,
                "num_fair_preemptions": 0,
                "num_prefilling": 0,
                "kv_cached_blocks": 0,
                "prefix_cache_queries": 1,
                "prefix_cache_hits": 0,
                "prefill_tokens_computed": 1,
                "spec_num_drafts": 0,
                "spec_num_draft_tokens": 0,
                "spec_num_accepted_tokens": 0,
                "spec_num_emitted_tokens": 0,
            }  # the fake's default pool: 5 slots x 1024 tokens in blocks of 32, all free again

    bounded(body)


def test_health_and_generate_503_before_lifespan():
    async def body():
        app = create_app(config=Config(model_id="fake"), engine=FakeEngine())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            r = await c.get("/health")
            assert r.status_code == 503
            assert r.json()["status"] == "loading"
            g = await c.post("/generate", json={"prompt": "x"})
            assert_error(g, 503, "unavailable", "not ready")

    bounded(body)


def test_health_503_after_lifespan_ended():
    async def body():
        app = create_app(config=Config(model_id="fake"), engine=FakeEngine())
        async with app.router.lifespan_context(app):
            pass
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            assert (await c.get("/health")).status_code == 503
            assert_error(await c.post("/generate", json={"prompt": "x"}), 503, "unavailable")

    bounded(body)


def test_health_dead_when_scheduler_loop_died():
    async def body():
        async with serving() as c:
            sched = c.app.state.server.scheduler
            sched._task.cancel()
            await wait_until(lambda: not sched.alive)
            r = await c.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "dead"
            assert_error(await c.post("/generate", json={"prompt": "x"}), 503, "unavailable")

    bounded(body)


# --- validation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload, field",
    [
        ({"prompt": ""}, "prompt"),
        ({}, "prompt"),
        ({"max_new_tokens": 4}, "prompt"),
        ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": -3}, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": LIMIT + 1}, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": 10**30}, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": "8"}, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": 8.0}, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": 8.5}, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": True}, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": None}, "max_new_tokens"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": True}, "prompt"),
        ({"prompt": ["a"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "2"]}, "prompt"),
        ({"prompt": [1.0]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [257]}, "prompt"),  # FakeEngine's vocabulary is [0, 257)
        ({"prompt": None}, "prompt"),
        ({"prompt": "x", "temperature": True}, "temperature"),
        ({"prompt": "x", "temperature": "0"}, "temperature"),
        ({"prompt": "x", "temperature": -0.5}, "temperature"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "request_id": ""}, "request_id"),
        ({"prompt": "x", "request_id": 7}, "request_id"),
        ({"prompt": "x", "request_id": "r" * 257}, "request_id"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "Prompt": "y"}, "Prompt"),
    ],
)
def test_422_for_invalid_fields(payload, field):
    async def body():
        async with serving() as c:
            r = await c.post("/generate", json=payload)
            err = assert_error(r, 422, "invalid_request_error")
            assert field in err["message"], err

    bounded(body)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_422_for_non_finite_temperature(literal):
    async def body():
        async with serving() as c:
            raw = '{"prompt": "x", "temperature": %s}' % literal
            if literal == "1e999":
                assert math.isinf(json.loads(raw)["temperature"])
            r = await c.post("/generate", content=raw, headers={"content-type": "application/json"})
            err = assert_error(r, 422, "invalid_request_error")
            assert "temperature" in err["message"]

    bounded(body)


@pytest.mark.parametrize(
    "raw, contains",
    [
        ('{"prompt": ', "malformed JSON"),
        ('{"prompt": "x",}', "malformed JSON"),
        ("{'prompt': 'x'}", "malformed JSON"),
        ("not json", "malformed JSON"),
        ("[]", "JSON object"),
        ('["prompt", "x"]', "JSON object"),
        ('"prompt"', "JSON object"),
        ("42", "JSON object"),
        ("null", None),
        ("", None),
        ('{"prompt": "\\ud800"}', "prompt"),
        ('{"prompt": "ok \\udfff tail"}', "prompt"),
        ('{"prompt": "x", "request_id": "\\ud83d"}', "request_id"),
    ],
)
def test_422_for_bad_bodies(raw, contains):
    async def body():
        async with serving() as c:
            r = await c.post("/generate", content=raw.encode(), headers={"content-type": "application/json"})
            assert_error(r, 422, "invalid_request_error", contains)

    bounded(body)


def test_paired_surrogate_escapes_are_fine():
    async def body():
        async with serving() as c:
            raw = '{"prompt": "smile \\ud83d\\ude00", "max_new_tokens": 3}'
            r = await c.post("/generate", content=raw, headers={"content-type": "application/json"})
            assert_ok(r, "smile 😀", 3)

    bounded(body)


def test_non_json_content_type_is_a_422_with_a_hint():
    async def body():
        async with serving() as c:
            r = await c.post("/generate", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
            assert_error(r, 422, "invalid_request_error", "Content-Type: application/json")

    bounded(body)


@pytest.mark.parametrize("temperature", [0.5, 1, 1e-9, 2.0])
def test_sampling_temperatures_are_accepted(temperature):
    async def body():
        async with serving() as c:
            r = await c.post("/generate", json={"prompt": "x", "temperature": temperature, "seed": 3})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 16

    bounded(body)


def test_422_context_window_with_multibyte_prompt():
    async def body():
        async with serving(FakeEngine(max_context=10)) as c:
            r = await c.post("/generate", json={"prompt": "ééé", "max_new_tokens": 5})  # 6 byte tokens + 5
            assert_error(r, 422, "invalid_request_error", "prompt (6 tokens) + max_new_tokens (5)")
            assert_ok(await c.post("/generate", json={"prompt": "ééé", "max_new_tokens": 4}), "ééé", 4)

    bounded(body)


@pytest.mark.parametrize(
    "method, path, status", [("GET", "/nope", 404), ("GET", "/generate", 405), ("POST", "/health", 405)]
)
def test_routing_errors_have_the_error_shape(method, path, status):
    async def body():
        async with serving() as c:
            assert_error(await c.request(method, path), status)

    bounded(body)


# --- overload and failures -----------------------------------------------------------------------------


def test_503_when_queue_is_full():
    async def body():
        gate = Gate()
        eng = FakeEngine(capacity=1, step_fault=gate.wait)
        try:
            async with serving(eng, max_queue_depth=1) as c:
                sched = c.app.state.server.scheduler
                first = asyncio.create_task(c.post("/generate", json={"prompt": "one", "max_new_tokens": 3}))
                await wait_until(lambda: len(sched.running) == 1 and gate.entered.is_set(), what="first running")
                second = asyncio.create_task(c.post("/generate", json={"prompt": "two", "max_new_tokens": 2}))
                await wait_until(lambda: len(sched.waiting) == 1, what="second queued")
                r = await c.post("/generate", json={"prompt": "three", "max_new_tokens": 2})
                assert_error(r, 503, "overloaded", "queue is full")
                assert r.headers["retry-after"] == "1"
                h = await c.get("/health")
                assert h.json()["running"] == 1 and h.json()["waiting"] == 1
                gate.open.set()
                r1, r2 = await asyncio.wait_for(asyncio.gather(first, second), 10)
                assert_ok(r1, "one", 3)
                assert_ok(r2, "two", 2)
                assert_ok(await c.post("/generate", json={"prompt": "three", "max_new_tokens": 2}), "three", 2)
        finally:
            gate.open.set()

    bounded(body)


def test_burst_over_a_tiny_queue_gets_some_503s():
    async def body():
        async with serving(FakeEngine(capacity=1, step_delay=0.01), max_queue_depth=1) as c:
            prompts = [f"burst {i}" for i in range(8)]
            rs = await asyncio.gather(*(c.post("/generate", json={"prompt": p, "max_new_tokens": 10}) for p in prompts))
            codes = [r.status_code for r in rs]
            assert set(codes) <= {200, 503}, codes
            assert codes.count(200) >= 1 and codes.count(503) >= 1, codes
            for p, r in zip(prompts, rs):
                if r.status_code == 200:
                    assert_ok(r, p, 10)
                else:
                    assert_error(r, 503, "overloaded", "queue is full")

    bounded(body)


def test_500_when_engine_step_raises_and_server_keeps_serving():
    def fault(step_no):
        if step_no == 2:
            raise RuntimeError("CUDA went sideways")

    async def body():
        eng = FakeEngine(capacity=2, step_fault=fault)
        async with serving(eng) as c:
            r = await c.post("/generate", json={"prompt": "doomed", "max_new_tokens": 5})
            err = assert_error(r, 500, "server_error")
            # A stable message: the exception's own text stays in the server log.
            assert err["message"] == "generation failed: engine step failed"
            # The failed request is answered before the loop resets the engine.
            await wait_until(lambda: eng.resets == 1, what="engine reset")
            assert_ok(await c.post("/generate", json={"prompt": "fine", "max_new_tokens": 5}), "fine", 5)
            h = await c.get("/health")
            assert h.status_code == 200 and h.json()["status"] == "ok"

    bounded(body)


def test_500_when_admit_raises_and_server_keeps_serving():
    calls = {"n": 0}

    def fault(seqs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("prefill out of memory")

    async def body():
        async with serving(FakeEngine(admit_fault=fault)) as c:
            err = assert_error(
                await c.post("/generate", json={"prompt": "a", "max_new_tokens": 3}), 500, "server_error"
            )
            assert err["message"] == "generation failed: admission failed"
            assert_ok(await c.post("/generate", json={"prompt": "b", "max_new_tokens": 3}), "b", 3)

    bounded(body)


def test_client_disconnect_frees_the_slot():
    async def body():
        eng = FakeEngine(capacity=1, step_delay=0.002, max_context=1_000_000)
        async with serving(eng, max_new_tokens_limit=100_000) as c:
            sched = c.app.state.server.scheduler
            task = asyncio.create_task(c.post("/generate", json={"prompt": "long", "max_new_tokens": 100_000}))
            await wait_until(lambda: len(sched.running) == 1, what="long running")
            (seq,) = sched.running.values()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_until(lambda: not sched.running and eng.num_active() == 0, what="slot freed")
            assert seq.finish_reason == "abort"
            assert len(seq.output_token_ids) < 100_000
            assert_ok(await c.post("/generate", json={"prompt": "next", "max_new_tokens": 3}), "next", 3)

    bounded(body)


def test_shutdown_answers_in_flight_requests():
    async def body():
        gate = Gate()
        eng = FakeEngine(capacity=1, step_fault=gate.wait)
        app = create_app(config=Config(model_id="fake"), engine=eng)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                async with app.router.lifespan_context(app):
                    sched = app.state.server.scheduler
                    tasks = [
                        asyncio.create_task(c.post("/generate", json={"prompt": f"s{i}", "max_new_tokens": 4}))
                        for i in range(3)
                    ]
                    await wait_until(lambda: gate.entered.is_set() and len(sched.waiting) == 2, what="in flight")
                rs = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            for r in rs:
                assert_error(r, 503, "unavailable", "shutting down")
        finally:
            gate.open.set()

    bounded(body)
