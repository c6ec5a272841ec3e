"""Graceful drain on a real ``python server.py`` receiving SIGTERM (FakeEngine slowed by FAKE_STEP_DELAY_S).

In-flight requests (queued, running, streamed) finish; new ones are refused (503 while the socket is
still open, connection refused after); what outlives DRAIN_TIMEOUT_S is aborted with a clear
error; the process exits 0 in time. Each test stops only the process it started.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from conftest import fake_text, read_sse, run
from live import ProcessServer

STEP = 0.02  # FAKE_STEP_DELAY_S: a decode step takes 20 ms


def fake_env(**extra) -> dict[str, str]:
    env = {
        "MODEL_ID": "fake",
        "FAKE_STEP_DELAY_S": str(STEP),
        "MAX_BATCH_SIZE": "4",
        "LOG_LEVEL": "INFO",
        "MAX_NEW_TOKENS_LIMIT": "1000",
    }
    env.update({k: str(v) for k, v in extra.items()})
    return env


async def stream_events(client: httpx.AsyncClient, url: str, payload: dict) -> list:
    async with client.stream("POST", f"{url}/generate", json={**payload, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        return await read_sse(r)


async def wait_unfinished(client: httpx.AsyncClient, url: str, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = (await client.get(f"{url}/health")).json()
        if h["running"] + h["waiting"] >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never saw {n} requests in flight")


async def probe_new_requests(url: str, seconds: float) -> list[str]:
    """Fresh connections sending new work during the drain: each must be refused, never served."""
    outcomes = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            async with httpx.AsyncClient(timeout=5) as fresh:
                r = await fresh.post(f"{url}/generate", json={"prompt": "late", "max_new_tokens": 2})
            assert r.status_code == 503, r.text
            assert "shutting down" in r.json()["error"]["message"]
            outcomes.append("503")
        except httpx.ConnectError:
            outcomes.append("refused")
        except (httpx.ReadError, httpx.RemoteProtocolError):
            # Accepted just as the drained server closed its listener: closed unanswered, never served.
            outcomes.append("closed")
        await asyncio.sleep(0.05)
    return outcomes


def test_sigterm_lets_in_flight_requests_finish_and_exits_0():
    with ProcessServer(fake_env(DRAIN_TIMEOUT_S=20)) as srv:

        async def body():
            async with httpx.AsyncClient(timeout=30) as c:
                plain = [(f"drain plain {i}", 40 + 5 * i) for i in range(6)]  # 4 slots: 2 wait in the queue
                streams = [(f"drain stream {i}", 30) for i in range(2)]
                plain_tasks = [
                    asyncio.create_task(c.post(f"{srv.url}/generate", json={"prompt": p, "max_new_tokens": n}))
                    for p, n in plain
                ]
                stream_tasks = [
                    asyncio.create_task(stream_events(c, srv.url, {"prompt": p, "max_new_tokens": n}))
                    for p, n in streams
                ]
                await wait_unfinished(c, srv.url, len(plain) + len(streams))
                sigterm_at = time.monotonic()
                srv.terminate()
                probes = await probe_new_requests(srv.url, 0.6)
                results = await asyncio.wait_for(asyncio.gather(*plain_tasks), 20)
                events = await asyncio.wait_for(asyncio.gather(*stream_tasks), 20)
                return sigterm_at, probes, results, events

        sigterm_at, probes, results, events = run(body())
        for (p, n), r in zip([(f"drain plain {i}", 40 + 5 * i) for i in range(6)], results):
            assert r.status_code == 200, r.text
            assert r.json()["text"] == fake_text(p, n) and r.json()["finish_reason"] == "length"
        for (p, n), evs in zip([(f"drain stream {i}", 30) for i in range(2)], events):
            assert evs[-1] == "[DONE]", evs[-3:]
            final = evs[-2]
            assert final["finish_reason"] == "length", final
            assert "".join(e["text"] for e in evs[:-1]) == fake_text(p, n)
        assert probes and set(probes) <= {"503", "refused", "closed"}, probes
        code = srv.wait(15)
        assert code == 0, srv.output()
        assert time.monotonic() - sigterm_at < 20
        log = srv.output()
        assert "drain_started" in log and "drain_timeout" not in log, log


def test_sigterm_aborts_what_outlives_the_drain_timeout_with_a_clear_error():
    with ProcessServer(fake_env(DRAIN_TIMEOUT_S=1)) as srv:

        async def body():
            async with httpx.AsyncClient(timeout=30) as c:
                long_plain = asyncio.create_task(
                    c.post(f"{srv.url}/generate", json={"prompt": "too long", "max_new_tokens": 1000})
                )
                long_stream = asyncio.create_task(
                    stream_events(c, srv.url, {"prompt": "too long stream", "max_new_tokens": 1000})
                )
                short = asyncio.create_task(
                    c.post(f"{srv.url}/generate", json={"prompt": "short", "max_new_tokens": 5})
                )
                await wait_unfinished(c, srv.url, 3)
                sigterm_at = time.monotonic()
                srv.terminate()
                r_long, evs, r_short = await asyncio.wait_for(asyncio.gather(long_plain, long_stream, short), 15)
                return sigterm_at, r_long, evs, r_short

        sigterm_at, r_long, evs, r_short = run(body())
        assert r_short.status_code == 200 and r_short.json()["text"] == fake_text("short", 5)
        assert r_long.status_code == 503, r_long.text
        err = r_long.json()["error"]
        assert err["message"] == "request aborted: server is shutting down" and err["code"] == "unavailable"
        assert evs[-1] == "[DONE]" and evs[-2]["error"]["message"] == "request aborted: server is shutting down", evs[
            -2:
        ]
        assert 0 < len("".join(e.get("text", "") for e in evs[:-2])) < 1000  # it streamed, then was cut
        code = srv.wait(10)
        assert code == 0, srv.output()
        assert time.monotonic() - sigterm_at < 8  # 1 s drain + shutdown, well before uvicorn's backstop
        log = srv.output()
        assert "drain_timeout aborting=2" in log, log
        assert log.count('error="server is shutting down"') == 2, log


def test_sigterm_when_idle_exits_0_quickly():
    with ProcessServer(fake_env(DRAIN_TIMEOUT_S=30)) as srv:
        assert httpx.post(f"{srv.url}/generate", json={"prompt": "x", "max_new_tokens": 2}).status_code == 200
        start = time.monotonic()
        srv.terminate()
        assert srv.wait(10) == 0, srv.output()
        assert time.monotonic() - start < 8
