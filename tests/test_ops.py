"""Operations through the ASGI app over FakeEngine: /metrics, /ready, API key, body/prompt/concurrency
limits, drain, the per-request log line and the documented error codes in the OpenAPI schema."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys

import httpx
import pytest

from api.metrics import logfmt
from config import Config
from engine import FakeEngine
from server import create_app

from conftest import ROOT, Gate, assert_error, bounded, fake_text, scrape, serving, wait_until
from live import config_vars, metric

KEY = "test-key-0123456789"


# --- metrics ---------------------------------------------------------------------------------------------


def test_metrics_count_tokens_requests_and_latencies():
    async def body():
        async with serving(FakeEngine(capacity=2)) as c:
            for i in range(3):
                r = await c.post("/generate", json={"prompt": f"m{i}", "max_new_tokens": 5})
                assert r.status_code == 200
            await c.post("/generate", json={"prompt": "", "max_new_tokens": 5})  # 422
            text = await scrape(c)
            assert metric(text, "minibatch:prompt_tokens_total") == 6  # "m0".."m2": 2 byte tokens each
            assert metric(text, "minibatch:generation_tokens_total") == 15
            assert metric(text, "minibatch:request_success_total", 'finished_reason="length"') == 3
            assert metric(text, "minibatch:request_success_total", 'finished_reason="error"') == 0
            assert metric(text, "minibatch:request_rejected_total", 'reason="validation"') == 1
            assert metric(text, "minibatch:time_to_first_token_seconds_count") == 3
            assert metric(text, "minibatch:e2e_request_latency_seconds_count") == 3
            assert metric(text, "minibatch:request_queue_time_seconds_count") == 3
            assert metric(text, "minibatch:inter_token_latency_seconds_count") == 12  # 4 gaps x 3
            assert metric(text, "minibatch:engine_step_seconds_count", 'phase="decode"') == 12
            assert metric(text, "minibatch:engine_step_seconds_count", 'phase="prefill"') == 3
            assert metric(text, "minibatch:batch_size_count") == 12
            assert metric(text, "minibatch:batch_size_bucket", 'le="1.0"') == 12
            assert metric(text, "minibatch:num_requests_running") == 0
            assert metric(text, "minibatch:num_requests_waiting") == 0
            assert metric(text, "minibatch:kv_cache_usage_perc") == 0
            assert metric(text, "minibatch:batch_capacity") == 2
            assert metric(text, "minibatch:ready") == 1
            assert "_created" not in text

    bounded(body)


def test_metrics_gauges_while_busy():
    async def body():
        gate = Gate()
        eng = FakeEngine(capacity=2, step_fault=gate.wait, num_blocks=4, block_size=4)
        try:
            async with serving(eng) as c:
                sched = c.app.state.server.scheduler
                tasks = [
                    asyncio.create_task(c.post("/generate", json={"prompt": f"b{i}", "max_new_tokens": 3}))
                    for i in range(3)
                ]
                # Prompts are tokenized off the loop, so the first step may start with one or two running.
                await wait_until(lambda: len(sched.running) + len(sched.waiting) == 3 and gate.entered.is_set())
                running = len(sched.running)
                text = await scrape(c)
                assert metric(text, "minibatch:num_requests_running") == running
                assert metric(text, "minibatch:num_requests_waiting") == 3 - running
                # Each running sequence (2 prompt tokens + 1 output) holds one block of 4 tokens.
                assert metric(text, "minibatch:kv_cache_usage_perc") == running / 4
                assert metric(text, "minibatch:kv_cache_free_blocks") == 4 - running
                assert metric(text, "minibatch:num_requests_in_flight") == 3  # /metrics itself is not counted
                gate.open.set()
                rs = await asyncio.wait_for(asyncio.gather(*tasks), 10)
                assert all(r.status_code == 200 for r in rs)
                text = await scrape(c)
                assert metric(text, "minibatch:kv_cache_usage_perc") == 0
                assert metric(text, "minibatch:kv_cache_free_blocks") == 4
                assert metric(text, "minibatch:num_requests_in_flight") == 0
        finally:
            gate.open.set()

    bounded(body)


def test_metrics_finish_reasons_stop_abort_timeout_error():
    def fault(step_no):
        if step_no == 1:
            raise RuntimeError("boom")

    def token_fn(seq):  # EOS as the third token of prompt "s"
        return FakeEngine.EOS if seq.prompt_token_ids == [ord("s") + 1] and len(seq.output_token_ids) == 2 else 100

    async def body():
        async with serving(FakeEngine(capacity=2, step_fault=fault, token_fn=token_fn)) as c:
            assert (await c.post("/generate", json={"prompt": "e", "max_new_tokens": 4})).status_code == 500
            r = await c.post("/generate", json={"prompt": "s", "max_new_tokens": 4})
            assert r.json()["finish_reason"] == "stop"
            text = await scrape(c)
            assert metric(text, "minibatch:request_success_total", 'finished_reason="error"') == 1
            assert metric(text, "minibatch:request_success_total", 'finished_reason="stop"') == 1
            assert metric(text, "minibatch:engine_failures_total", 'phase="decode"') == 1

        eng = FakeEngine(capacity=1, step_delay=0.01)
        async with serving(eng, max_queue_time_s=0.1, max_new_tokens_limit=100) as c:
            sched = c.app.state.server.scheduler
            first = asyncio.create_task(c.post("/generate", json={"prompt": "t0", "max_new_tokens": 60}))
            await wait_until(lambda: len(sched.running) == 1)
            r = await c.post("/generate", json={"prompt": "t1", "max_new_tokens": 5})
            assert_error(r, 504, "timeout", "waiting in the queue")
            assert (await first).status_code == 200
            text = await scrape(c)
            assert metric(text, "minibatch:request_success_total", 'finished_reason="timeout"') == 1
            # It never got the single slot: a rejection too, and no queue time / TTFT was observed for it.
            assert metric(text, "minibatch:request_rejected_total", 'reason="timeout"') == 1
            assert metric(text, "minibatch:request_queue_time_seconds_count") == 1
            assert metric(text, "minibatch:time_to_first_token_seconds_count") == 1

    bounded(body)


def test_metrics_are_per_app_and_available_before_startup():
    async def body():
        app1 = create_app(config=Config(model_id="fake"), engine=FakeEngine())
        app2 = create_app(config=Config(model_id="fake"), engine=FakeEngine())
        assert app1.state.ops.metrics.registry is not app2.state.ops.metrics.registry
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app1), base_url="http://t") as c:
            text = await scrape(c)
            assert metric(text, "minibatch:ready") == 0
            assert metric(text, "minibatch:generation_tokens_total") == 0

    bounded(body)


def test_request_log_line(caplog):
    async def body():
        async with serving() as c:
            await c.post("/generate", json={"prompt": "log me", "max_new_tokens": 3, "request_id": 'evil"\nid=1'})

    with caplog.at_level(logging.INFO, logger="minibatch.requests"):
        bounded(body)
    lines = [r.getMessage() for r in caplog.records if r.name == "minibatch.requests"]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "\n" not in line
    assert line.startswith("request_finished request_id=" + json.dumps('evil"\nid=1'))
    for key in ("finish_reason=length", "prompt_tokens=6", "completion_tokens=3", "queue_ms=", "ttft_ms=", "e2e_ms="):
        assert key in line, line


def test_logfmt_quotes_what_is_not_a_bare_word():
    assert logfmt("ev", a="x", b=1, c=None, d="two words", e=2.5) == 'ev a=x b=1 c=- d="two words" e=2.5'


# --- readiness -------------------------------------------------------------------------------------------


def test_ready_states():
    async def body():
        app = create_app(config=Config(model_id="fake"), engine=FakeEngine())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.get("/ready")
            assert r.status_code == 503 and r.json() == {"status": "loading"}
            async with app.router.lifespan_context(app):
                r = await c.get("/ready")
                assert r.status_code == 200 and r.json() == {"status": "ready"}
                sched = app.state.server.scheduler
                sched._task.cancel()
                await wait_until(lambda: not sched.alive)
                r = await c.get("/ready")
                assert r.status_code == 503 and r.json() == {"status": "dead"}
            assert (await c.get("/ready")).status_code == 503

    bounded(body)


def test_health_stays_liveness_while_draining():
    async def body():
        async with serving() as c:
            c.app.state.ops.begin_drain()
            r = await c.get("/ready")
            assert r.status_code == 503 and r.json() == {"status": "draining"}
            h = await c.get("/health")
            assert h.status_code == 200 and h.json()["status"] == "ok"
            assert (await c.get("/metrics")).status_code == 200
            assert_error(await c.post("/generate", json={"prompt": "x"}), 503, "unavailable", "shutting down")
            assert_error(await c.get("/v1/models"), 503, "unavailable", "shutting down")
            assert metric(await scrape(c), "minibatch:request_rejected_total", 'reason="draining"') == 2

    bounded(body)


def test_drain_in_process_lets_running_finish_then_aborts_the_rest():
    async def body():
        eng = FakeEngine(capacity=2, step_delay=0.005, max_context=100_000)
        async with serving(eng, drain_timeout_s=0.5, max_new_tokens_limit=100_000) as c:
            sched = c.app.state.server.scheduler
            long = asyncio.create_task(c.post("/generate", json={"prompt": "long", "max_new_tokens": 90_000}))
            await wait_until(lambda: sched.num_unfinished == 1)
            short = asyncio.create_task(c.post("/generate", json={"prompt": "short", "max_new_tokens": 40}))
            await wait_until(lambda: sched.num_unfinished == 2)
            c.app.state.ops.begin_drain()
            r_short, r_long = await asyncio.wait_for(asyncio.gather(short, long), 10)
            assert r_short.status_code == 200 and r_short.json()["text"] == fake_text("short", 40)
            assert_error(r_long, 503, "unavailable", "server is shutting down")
            assert sched.num_unfinished == 0 and not sched.alive  # the leftovers were aborted by stopping the loop
            assert (await c.get("/ready")).json() == {"status": "draining"}

    bounded(body)


# --- API key ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": "Bearer "},
        {"X-Api-Key": KEY},
    ],
)
def test_api_key_rejects_missing_or_wrong(headers):
    async def body():
        async with serving(api_key=KEY) as c:
            for method, path, payload in [
                ("POST", "/generate", {"prompt": "x"}),
                ("GET", "/v1/models", None),
                ("POST", "/v1/completions", {"prompt": "x"}),
                ("GET", "/openapi.json", None),
                ("GET", "/nope", None),
            ]:
                r = await c.request(method, path, json=payload, headers=headers)
                assert_error(r, 401, "authentication_error", "API key")
                assert r.headers["www-authenticate"] == "Bearer"
            text = await scrape(c)
            assert metric(text, "minibatch:request_rejected_total", 'reason="auth"') == 5
            assert metric(text, "minibatch:generation_tokens_total") == 0

    bounded(body)


def test_api_key_accepts_the_key_and_leaves_probes_open():
    async def body():
        async with serving(api_key=KEY) as c:
            auth = {"Authorization": f"Bearer {KEY}"}
            r = await c.post("/generate", json={"prompt": "k", "max_new_tokens": 3}, headers=auth)
            assert r.status_code == 200 and r.json()["text"] == fake_text("k", 3)
            r = await c.post(
                "/generate", json={"prompt": "k", "max_new_tokens": 3}, headers={"authorization": f"bearer {KEY}"}
            )
            assert r.status_code == 200
            assert (await c.get("/v1/models", headers=auth)).status_code == 200
            for path in ("/health", "/ready", "/metrics"):
                assert (await c.get(path)).status_code == 200, path

    bounded(body)


def test_no_api_key_configured_means_no_auth():
    async def body():
        async with serving() as c:
            assert (await c.post("/generate", json={"prompt": "k", "max_new_tokens": 1})).status_code == 200

    bounded(body)


# --- limits ----------------------------------------------------------------------------------------------


def test_body_too_large_by_content_length():
    async def body():
        async with serving(max_body_bytes=2048) as c:
            big = json.dumps({"prompt": "x" * 3000}).encode()
            assert_error(
                await c.post("/generate", content=big, headers={"content-type": "application/json"}),
                413,
                "invalid_request_error",
                "MAX_BODY_BYTES",
            )
            ok = json.dumps({"prompt": "x" * 1000, "max_new_tokens": 2}).encode()
            assert (
                await c.post("/generate", content=ok, headers={"content-type": "application/json"})
            ).status_code == 200
            assert metric(await scrape(c), "minibatch:request_rejected_total", 'reason="too_large"') == 1

    bounded(body)


def test_body_too_large_while_streaming_chunked():
    async def body():
        async with serving(FakeEngine(max_context=100_000), max_body_bytes=2048) as c:

            async def chunks(n):
                yield b'{"prompt": "'
                for _ in range(n):
                    yield b"y" * 500
                yield b'", "max_new_tokens": 2}'

            r = await c.post("/generate", content=chunks(10), headers={"content-type": "application/json"})
            assert "content-length" not in r.request.headers
            assert_error(r, 413, "invalid_request_error", "MAX_BODY_BYTES")
            r = await c.post("/generate", content=chunks(3), headers={"content-type": "application/json"})
            assert r.status_code == 200 and r.json()["text"] == fake_text("y" * 1500, 2)

    bounded(body)


def test_invalid_content_length_is_400():
    async def body():
        app = create_app(config=Config(model_id="fake"), engine=FakeEngine())
        async with app.router.lifespan_context(app):
            sent = []

            async def receive():
                return {"type": "http.request", "body": b"{}", "more_body": False}

            async def send(message):
                sent.append(message)

            scope = {
                "type": "http",
                "method": "POST",
                "path": "/generate",
                "headers": [(b"content-length", b"12x")],
                "query_string": b"",
                "root_path": "",
                "scheme": "http",
                "server": ("t", 80),
                "client": ("c", 1),
                "http_version": "1.1",
                "asgi": {"version": "3.0"},
            }
            await app(scope, receive, send)
            assert sent[0]["status"] == 400
            assert json.loads(sent[1]["body"])["error"]["message"] == "invalid Content-Length header"

    bounded(body)


def test_prompt_chars_limit_on_every_endpoint():
    async def body():
        async with serving(FakeEngine(max_context=100_000), max_prompt_chars=50) as c:
            long = "é" * 51
            for path, payload in [
                ("/generate", {"prompt": long}),
                ("/v1/completions", {"prompt": long}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}),
            ]:
                assert_error(await c.post(path, json=payload), 422, "invalid_request_error", "MAX_PROMPT_CHARS")
            r = await c.post("/generate", json={"prompt": "é" * 50, "max_new_tokens": 2})
            assert r.status_code == 200
            assert metric(await scrape(c), "minibatch:request_rejected_total", 'reason="too_large"') == 3

    bounded(body)


def test_concurrency_limit_429_then_recovers():
    async def body():
        gate = Gate()
        eng = FakeEngine(capacity=1, step_fault=gate.wait)
        try:
            async with serving(eng, max_concurrent_requests=2) as c:
                ops = c.app.state.ops
                held = [
                    asyncio.create_task(c.post("/generate", json={"prompt": f"h{i}", "max_new_tokens": 2}))
                    for i in range(2)
                ]
                await wait_until(lambda: ops.in_flight == 2 and gate.entered.is_set())
                r = await c.post("/generate", json={"prompt": "over", "max_new_tokens": 2})
                assert_error(r, 429, "rate_limit_error", "MAX_CONCURRENT_REQUESTS")
                assert r.headers["retry-after"] == "1"
                assert (await c.get("/health")).status_code == 200  # probes are not counted
                assert (await c.get("/ready")).status_code == 200
                gate.open.set()
                rs = await asyncio.wait_for(asyncio.gather(*held), 10)
                assert [x.status_code for x in rs] == [200, 200]
                assert ops.in_flight == 0
                r = await c.post("/generate", json={"prompt": "over", "max_new_tokens": 2})
                assert r.status_code == 200
                text = await scrape(c)
                assert metric(text, "minibatch:request_rejected_total", 'reason="too_many_connections"') == 1
        finally:
            gate.open.set()

    bounded(body)


def test_queue_full_and_not_ready_are_counted():
    async def body():
        gate = Gate()
        eng = FakeEngine(capacity=1, step_fault=gate.wait)
        try:
            async with serving(eng, max_queue_depth=1) as c:
                sched = c.app.state.server.scheduler
                first = asyncio.create_task(c.post("/generate", json={"prompt": "1", "max_new_tokens": 2}))
                await wait_until(lambda: len(sched.running) == 1 and gate.entered.is_set())
                second = asyncio.create_task(c.post("/generate", json={"prompt": "2", "max_new_tokens": 2}))
                await wait_until(lambda: len(sched.waiting) == 1)
                assert_error(await c.post("/generate", json={"prompt": "3"}), 503, "overloaded")
                gate.open.set()
                await asyncio.wait_for(asyncio.gather(first, second), 10)
                assert metric(await scrape(c), "minibatch:request_rejected_total", 'reason="queue_full"') == 1
        finally:
            gate.open.set()
        app = create_app(config=Config(model_id="fake"), engine=FakeEngine())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert_error(await c.post("/generate", json={"prompt": "x"}), 503, "unavailable", "not ready")
            assert metric(await scrape(c), "minibatch:request_rejected_total", 'reason="not_ready"') == 1

    bounded(body)


def test_streaming_still_works_through_the_middleware():
    async def body():
        async with serving(api_key=KEY) as c:
            async with c.stream(
                "POST",
                "/generate",
                json={"prompt": "sse", "max_new_tokens": 4, "stream": True},
                headers={"Authorization": f"Bearer {KEY}"},
            ) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            texts = [json.loads(x[6:])["text"] for x in lines[:-1]]
            assert "".join(texts) == fake_text("sse", 4)

    bounded(body)


def test_openapi_documents_the_operational_errors():
    async def body():
        async with serving() as c:
            schema = (await c.get("/openapi.json")).json()
            gen = schema["paths"]["/generate"]["post"]["responses"]
            for code in ("401", "413", "422", "429", "503"):
                assert code in gen, code
            assert "text/event-stream" in gen["200"]["content"]
            assert "401" not in schema["paths"]["/health"]["get"]["responses"]
            assert set(schema["paths"]["/ready"]["get"]["responses"]) >= {"200", "503"}
            assert "/metrics" in schema["paths"]

    bounded(body)


# --- startup: python server.py ----------------------------------------------------------------------


def _server_py(env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in config_vars()}
    full.update({"HOST": "127.0.0.1", "PORT": "1", **env})  # never binds: startup fails first
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "server.py")],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "env, words",
    [
        ({"MODEL_ID": "fake", "MAX_BATCH_SIZE": "0"}, ("MAX_BATCH_SIZE",)),
        ({"MODEL_ID": "fake", "BODY_TIMEOUT_S": "soon"}, ("BODY_TIMEOUT_S", "a number")),
        ({"MODEL_ID": "/nonexistent/checkpoint-dir"}, ("/nonexistent/checkpoint-dir",)),
    ],
    ids=["bad value", "bad type", "unloadable model"],
)
def test_startup_failure_is_one_error_line_and_exit_1(env, words):
    proc = _server_py(env)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]


def test_importing_server_builds_no_app_and_server_app_is_built_once():
    """``python server.py`` builds its app in main only; ``uvicorn server:app`` gets one, on access."""
    code = (
        "import server; assert 'app' not in vars(server); a = server.app; "
        "assert a is server.app and a.state.server is None; print('ok')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MODEL_ID": "fake"},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
