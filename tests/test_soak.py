"""Soak: mixed traffic against a real ``python server.py`` (MODEL_ID=fake) for SOAK_SECONDS (default 20).

Workers loop over plain and streamed requests, clients that hang up mid-stream, queue overflow,
queue and request timeouts, injected engine faults (FAKE_STEP_FAULT_EVERY), bad input, bad API
keys and oversized bodies. Every request gets an answer of the kind its case allows (a hang-up
is the only request without one); the server's RSS (``/proc/<pid>/status``) stays flat within a
generous bound; at the end nothing is running, waiting, in flight, or holding a KV row.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import time

import httpx
import pytest

from api.errors import ERROR_CODES

from conftest import assert_pool_full, fake_text, run
from live import ProcessServer, metric

STATUS_OF = {code: status for status, code in ERROR_CODES.items()}  # error.code -> HTTP status

pytestmark = pytest.mark.soak

SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "20"))
WORKERS = 24
KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
RSS_GROWTH_LIMIT_KIB = 40 * 1024  # generous: allocator noise, lazily built caches


def server_env() -> dict[str, str]:
    return {
        "MODEL_ID": "fake",
        "MAX_BATCH_SIZE": "8",
        "MAX_QUEUE_DEPTH": "8",
        "MAX_NEW_TOKENS_LIMIT": "1000",
        "FAKE_STEP_DELAY_S": "0.002",
        "FAKE_STEP_FAULT_EVERY": "500",
        "MAX_QUEUE_TIME_S": "1.5",
        "REQUEST_TIMEOUT_S": "0.8",
        "API_KEY": KEY,
        "MAX_BODY_BYTES": "65536",
        "MAX_CONCURRENT_REQUESTS": "20",
        "LOG_LEVEL": "WARNING",
    }


# Which answers each kind of request may get. 503: queue full; 504: queue time limit; 500: injected fault;
# 429: too many in flight. A running request past REQUEST_TIMEOUT_S should get 504; it gets 503 "request
# aborted" today (engine.abort overwrites the timeout status; see the report), so both are allowed for it.
ALLOWED = {
    "plain": {200, 500, 503, 504, 429},
    "stream": {200, 500, 503, 504, 429},
    "timeout": {503, 504, 429, 500},
    "bad_json": {422, 429},
    "bad_field": {422, 429},
    "bad_key": {401},  # auth is checked before any limit
    "too_large": {413, 429},
    "models": {200, 429},
}


async def one_request(c: httpx.AsyncClient, url: str, kind: str, rng: random.Random, i: int) -> tuple[str, int]:
    """Send one request of ``kind``; return (kind, status). Validates a 200's content."""
    prompt = f"soak {i} {rng.random():.6f}"
    if kind == "plain":
        n = rng.randint(1, 40)
        r = await c.post(f"{url}/generate", json={"prompt": prompt, "max_new_tokens": n}, headers=AUTH)
        if r.status_code == 200:
            assert r.json()["text"] == fake_text(prompt, n)
        else:
            assert r.json()["error"]["message"]
        return kind, r.status_code
    if kind in ("stream", "hangup"):
        n = rng.randint(5, 60) if kind == "stream" else 900
        async with c.stream(
            "POST",
            f"{url}/v1/completions",
            headers=AUTH,
            json={"prompt": prompt, "max_tokens": n, "stream": True, "temperature": 0},
        ) as r:
            if r.status_code != 200:
                await r.aread()
                return ("stream" if kind == "stream" else "plain"), r.status_code
            text, error, done, events = [], None, False, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if kind == "hangup" and events >= rng.randint(2, 8):
                    return "hangup", 0  # leave mid-stream: the context manager closes the connection
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = STATUS_OF[event["error"]["code"]]
                else:
                    text.append(event["choices"][0]["text"])
        if kind == "hangup":
            return "hangup", 0
        assert done, "stream ended without [DONE]"
        if error is not None:
            return kind, error
        assert "".join(text) == fake_text(prompt, n)
        return kind, 200
    if kind == "timeout":
        r = await c.post(f"{url}/generate", json={"prompt": prompt, "max_new_tokens": 990}, headers=AUTH)
        return kind, r.status_code
    if kind == "bad_json":
        r = await c.post(
            f"{url}/generate", content=b'{"prompt": ', headers={**AUTH, "content-type": "application/json"}
        )
        return kind, r.status_code
    if kind == "bad_field":
        raw = b'{"messages": [{"role": "user", "content": "x\\ud800"}], "max_tokens": -1}'  # an unpaired surrogate
        r = await c.post(
            f"{url}/v1/chat/completions", content=raw, headers={**AUTH, "content-type": "application/json"}
        )
        return kind, r.status_code
    if kind == "bad_key":
        r = await c.post(f"{url}/generate", json={"prompt": prompt}, headers={"Authorization": "Bearer nope"})
        return kind, r.status_code
    if kind == "too_large":
        r = await c.post(f"{url}/generate", json={"prompt": "x" * 70_000}, headers=AUTH)
        return kind, r.status_code
    if kind == "models":
        r = await c.get(f"{url}/v1/models", headers=AUTH)
        return kind, r.status_code
    raise AssertionError(kind)


KINDS = (
    ["plain"] * 8
    + ["stream"] * 5
    + ["hangup"] * 3
    + ["timeout", "bad_json", "bad_field", "bad_key", "too_large", "models"]
)


def test_soak_mixed_traffic_keeps_memory_flat_and_ends_idle():
    with ProcessServer(server_env()) as srv:
        rss: list[tuple[float, int]] = []
        outcomes: collections.Counter[tuple[str, int]] = collections.Counter()
        failures: list[str] = []
        start = time.monotonic()
        stop_at = start + SOAK_SECONDS

        async def worker(w: int, c: httpx.AsyncClient) -> None:
            rng = random.Random(w)
            i = 0
            while time.monotonic() < stop_at:
                kind = rng.choice(KINDS)
                i += 1
                try:
                    got_kind, status = await asyncio.wait_for(one_request(c, srv.url, kind, rng, w * 100_000 + i), 30)
                except Exception as exc:  # no answer, or a wrong one
                    failures.append(f"{kind}: {type(exc).__name__}: {exc}")
                    continue
                outcomes[(got_kind, status)] += 1
                if got_kind != "hangup" and status not in ALLOWED[got_kind]:
                    failures.append(f"{kind}: unexpected status {status}")

        async def sampler() -> None:
            while time.monotonic() < stop_at:
                rss.append((time.monotonic() - start, srv.rss_kib()))
                await asyncio.sleep(0.5)

        async def body() -> str:
            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=WORKERS * 2)) as c:
                await asyncio.gather(sampler(), *(worker(w, c) for w in range(WORKERS)))
                # Everything has been answered or hung up on; the server must come back to idle.
                deadline = time.monotonic() + 10
                while True:
                    text = (await c.get(f"{srv.url}/metrics")).text
                    idle = all(
                        metric(text, f"minibatch:{g}") == 0
                        for g in (
                            "num_requests_running",
                            "num_requests_waiting",
                            "kv_cache_usage_perc",
                            "num_requests_in_flight",
                        )
                    )
                    if idle or time.monotonic() > deadline:
                        return text
                    await asyncio.sleep(0.05)

        text = run(asyncio.wait_for(body(), SOAK_SECONDS + 60))
        total = sum(outcomes.values())
        summary = ", ".join(f"{k}/{s}: {n}" for (k, s), n in sorted(outcomes.items()))
        print(f"\nsoak {SOAK_SECONDS:.0f}s: {total} requests ({summary}); RSS KiB {[r for _, r in rss][::4]}")
        assert not failures, failures[:10]
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_requests_in_flight"):
            assert metric(text, f"minibatch:{gauge}") == 0, gauge
        assert metric(text, "minibatch:ready") == 1
        assert_pool_full(httpx.get(f"{srv.url}/health", headers=AUTH).json()["engine"])
        # The mix really happened.
        assert outcomes[("plain", 200)] > 50 and outcomes[("stream", 200)] > 20 and outcomes[("hangup", 0)] > 5
        assert metric(text, "minibatch:request_success_total", 'finished_reason="abort"') > 0  # the hang-ups
        assert metric(text, "minibatch:request_success_total", 'finished_reason="error"') > 0  # injected faults
        assert sum(n for (k, s), n in outcomes.items() if k == "timeout") > 0
        # RSS: flat after warm-up (the first quarter), within a generous bound.
        warm = [r for t, r in rss if t >= SOAK_SECONDS / 4]
        assert len(warm) >= 4, rss
        growth = max(warm) - warm[0]
        assert growth < RSS_GROWTH_LIMIT_KIB, f"RSS grew {growth} KiB after warm-up: {rss}"
        # Still serving.
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "after soak", "max_new_tokens": 3}, headers=AUTH)
        assert r.status_code == 200 and r.json()["text"] == fake_text("after soak", 3)
