"""Fault injection on a real uvicorn (in a thread, so the FakeEngine's faults are ours to choose):
engine steps and admissions that raise on chosen requests, and streaming clients killed mid-stream.

The requests caught by a fault get a 500 that says what failed; every other request gets its own
correct answer; the server keeps serving; capacity comes back. The engine's first admission is held
until every request is queued, one after another, so the queue order is the request order and the
batches (hence the number of requests a fault takes down) are the same on every run. Only HTTP and
the FakeEngine's own hooks are looked at. Bounded: every client call and wait has a timeout, every
test stops the server it started.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from api.errors import ERROR_CODES
from config import Config
from engine import FakeEngine
from server import create_app

from conftest import TIMEOUT, assert_pool_full, read_sse, run
from live import ThreadServer, fake_text, metric, scrape_url

STATUS_OF = {code: status for status, code in ERROR_CODES.items()}  # error.code -> HTTP status


def start(engine: FakeEngine, **config) -> ThreadServer:
    config.setdefault("max_new_tokens_limit", 200)
    config.setdefault("log_level", "WARNING")
    return ThreadServer(create_app(config=Config(model_id="fake", **config), engine=engine))


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def finished(text: str, reason: str) -> float:
    return metric(text, "minibatch:request_success_total", f'finished_reason="{reason}"')


def assert_idle(srv: ThreadServer) -> None:
    """Nothing running, waiting, holding a KV row or in flight; ready for more."""

    def idle() -> bool:
        text = scrape_url(srv.url)
        return all(
            metric(text, f"minibatch:{name}") == 0
            for name in (
                "num_requests_running",
                "num_requests_waiting",
                "kv_cache_usage_perc",
                "num_requests_in_flight",
            )
        )

    wait_for(idle, what="the server to be idle")
    assert_pool_full(srv.state.engine)
    assert httpx.get(f"{srv.url}/ready", timeout=10).status_code == 200


class HeldStart:
    """An engine hook that holds the first engine call until released (then never again)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()

    def __call__(self, *_) -> None:
        if not self.released.is_set():
            self.entered.set()
            assert self.released.wait(TIMEOUT), "the held engine call was never released"


async def wait_async(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


async def queue_in_order(c: httpx.AsyncClient, url: str, held: HeldStart, send) -> list[asyncio.Task]:
    """Start ``send[i]()`` one after another, each once the previous is in the server's queue, while the
    engine's first call (request 0's admission) is held; then let the engine go. Returns the tasks."""

    async def waiting(n: int) -> bool:
        return metric((await c.get(f"{url}/metrics")).text, "minibatch:num_requests_waiting") == n

    tasks = []
    for i, fn in enumerate(send):
        tasks.append(asyncio.create_task(fn()))
        if i == 0:
            await wait_async(lambda: asyncio.sleep(0, held.entered.is_set()), what="the first admission")
        else:
            await wait_async(lambda: waiting(i), what=f"request {i} to queue")
    held.released.set()
    return tasks


async def post(c: httpx.AsyncClient, url: str, payload: dict, stream: bool) -> tuple[int, dict]:
    """POST /generate; a stream is folded into (status, final dict), or (error code, error body)."""
    if not stream:
        r = await c.post(f"{url}/generate", json=payload)
        return r.status_code, r.json()
    async with c.stream("POST", f"{url}/generate", json={**payload, "stream": True}) as r:
        events = [e for e in await read_sse(r) if e != "[DONE]"]
    if events and "error" in events[-1]:
        return STATUS_OF[events[-1]["error"]["code"]], events[-1]
    return r.status_code, {"text": "".join(e["text"] for e in events), "finish_reason": events[-1].get("finish_reason")}


async def fire(url: str, held: HeldStart | None, requests: list[tuple[str, str, int]], stream_every: int = 0):
    """Send each (request_id, prompt, n), every ``stream_every``-th one streamed: queued in order through
    ``held`` (the engine's hook), or all at once without it. Returns {request_id: (status, body)}."""
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=500)) as c:
        send = [
            lambda rid=rid, p=p, n=n, i=i: post(
                c,
                url,
                {"request_id": rid, "prompt": p, "max_new_tokens": n},
                bool(stream_every) and i % stream_every == 0,
            )
            for i, (rid, p, n) in enumerate(requests)
        ]
        tasks = await queue_in_order(c, url, held, send) if held else [asyncio.create_task(fn()) for fn in send]
        results = await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
    return {rid: res for (rid, _, _), res in zip(requests, results)}


def check_outcomes(results, requests, failed_ids: set[str], message: str) -> None:
    assert set(results) == {rid for rid, _, _ in requests}
    for rid, prompt, n in requests:
        status, body = results[rid]
        if rid in failed_ids:
            assert status == 500, (rid, status, body)
            err = body["error"]
            assert message in err["message"] and err["type"] == "server_error", err
            assert "injected" not in err["message"], err  # the exception's own text stays in the log
        else:
            assert status == 200, (rid, status, body)
            assert body["text"] == fake_text(prompt, n) and body["finish_reason"] == "length", (rid, body)


def test_step_faults_fail_only_the_active_batch_and_the_server_keeps_serving():
    """Three poisoned requests crash every decode step they are in: each takes down its own batch
    (itself and the 3 others sharing the full 4-slot step), nobody else: exactly 12 of 60 get a 500."""
    poisoned = {"s-5", "s-25", "s-45"}
    caught: set[str] = set()
    held = HeldStart()
    eng = FakeEngine(capacity=4, step_delay=0.002, admit_fault=held)

    def step_fault(step_no: int) -> None:
        active = {s.request_id for s in eng.active_sequences()}
        if active & poisoned:
            caught.update(active)
            raise RuntimeError(f"injected step fault #{step_no}")

    eng.step_fault = step_fault
    with start(eng) as srv:
        requests = [(f"s-{i}", f"step fault prompt {i}", 3 + i % 9) for i in range(60)]
        results = run(fire(srv.url, held, requests, stream_every=3))
        print(f"\nstep faults from {sorted(poisoned)}: {len(caught)} of {len(requests)} requests got 500")
        assert poisoned <= caught and len(caught) == 12, sorted(caught)
        check_outcomes(results, requests, caught, "engine step failed")
        assert_idle(srv)
        assert eng.resets == len(poisoned)
        text = scrape_url(srv.url)
        assert finished(text, "error") == 12
        assert finished(text, "length") == 60 - 12
        assert metric(text, "minibatch:engine_failures_total", 'phase="decode"') == len(poisoned)
        # Later traffic is unaffected.
        again = run(fire(srv.url, None, [(f"after-{i}", f"after {i}", 5) for i in range(8)]))
        assert all(
            code == 200 and body["text"] == fake_text(f"after {i}", 5) for i, (code, body) in enumerate(again.values())
        )


def test_admit_faults_fail_only_their_newcomers():
    """Prefill runs out of memory on any group of newcomers holding a poisoned request: that group
    fails (in a mixed admit+step call too, once retried apart), the running batch goes on. a-1 is
    admitted with a-2 and a-3 (a-0, with a budget of 2, has left by then), a-21 alone: exactly 4 of
    40 get a 500."""
    poisoned = {"a-1", "a-21"}
    caught: set[str] = set()
    held = HeldStart()

    def admit_fault(seqs) -> None:
        held()
        group = {s.request_id for s in seqs}
        if group & poisoned:
            caught.update(group)
            raise MemoryError(f"injected prefill OOM for {sorted(group & poisoned)}")

    eng = FakeEngine(capacity=3, step_delay=0.002, admit_fault=admit_fault)
    with start(eng) as srv:
        requests = [(f"a-{i}", f"admit fault prompt {i}", 2 + i % 7) for i in range(40)]
        results = run(fire(srv.url, held, requests, stream_every=4))
        print(f"\nadmission faults from {sorted(poisoned)}: {len(caught)} of {len(requests)} requests got 500")
        assert poisoned <= caught and len(caught) == 4, sorted(caught)
        check_outcomes(results, requests, caught, "admission failed")
        assert_idle(srv)
        text = scrape_url(srv.url)
        assert metric(text, "minibatch:engine_failures_total", 'phase="prefill"') == 4
        assert finished(text, "error") == 4 and finished(text, "length") == 40 - 4


_KILLABLE_CLIENT = r"""
import socket, sys
port, n = int(sys.argv[1]), sys.argv[2]
body = ('{"prompt": "killed client", "stream": true, "max_new_tokens": %s}' % n).encode()
s = socket.create_connection(("127.0.0.1", port), timeout=20)
s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
          + str(len(body)).encode() + b"\r\n\r\n" + body)
got = b""
while got.count(b"data: ") < 3:
    chunk = s.recv(65536)
    if not chunk or not got and not chunk.startswith(b"HTTP/1.1 200"):
        print(chunk[:200], flush=True)
        sys.exit(1)
    got += chunk
print("streaming", flush=True)
while True:
    s.recv(65536)
"""


def test_killed_streaming_client_frees_its_slot():
    eng = FakeEngine(capacity=1, step_delay=0.005, max_context=1_000_000)
    with start(eng, max_new_tokens_limit=100_000) as srv:
        client = subprocess.Popen(
            [sys.executable, "-c", _KILLABLE_CLIENT, str(srv.port), "100000"], stdout=subprocess.PIPE, text=True
        )
        try:
            line = client.stdout.readline().strip()  # bounded: the client's socket has a timeout
            assert line == "streaming", line
            (seq,) = eng.active_sequences()
            client.send_signal(signal.SIGKILL)  # no goodbye: the kernel closes the socket
            client.wait(10)
        finally:
            if client.poll() is None:
                client.kill()
                client.wait(10)
        wait_for(lambda: seq.is_finished, what="the killed client's sequence to end")
        assert seq.finish_reason == "abort" and len(seq.output_token_ids) < 100_000
        assert_idle(srv)
        # The single slot serves the next request.
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "next", "max_new_tokens": 4}, timeout=10)
        assert r.status_code == 200 and r.json()["text"] == fake_text("next", 4)
        assert finished(scrape_url(srv.url), "abort") == 1


def test_many_streaming_clients_dropped_mid_stream():
    eng = FakeEngine(capacity=4, step_delay=0.002, max_context=1_000_000)
    with start(eng, max_new_tokens_limit=100_000) as srv:
        socks = []
        body = b'{"prompt": "dropped", "stream": true, "max_new_tokens": 50000}'

        def queued() -> tuple[float, float]:
            text = scrape_url(srv.url)
            return metric(text, "minibatch:num_requests_running"), metric(text, "minibatch:num_requests_waiting")

        try:
            for _ in range(12):  # 4 running, 8 waiting
                s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
                s.sendall(
                    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
                socks.append(s)
            wait_for(lambda: queued() == (4, 8), what="4 running and 8 waiting")
        finally:
            for s in socks:
                s.close()
        assert_idle(srv)
        assert finished(scrape_url(srv.url), "abort") == 12
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "after", "max_new_tokens": 3}, timeout=10)
        assert r.status_code == 200 and r.json()["text"] == fake_text("after", 3)


def test_a_fault_while_clients_disconnect_loses_nothing():
    """A decode step fails while three clients hang up during it (one in that batch, two queued):
    the batch's other three get the step's 500, the two queued leavers never run, the four
    requests behind them get their answers, and every request ends exactly once."""
    held = HeldStart()
    eng = FakeEngine(capacity=4, step_delay=0.002, admit_fault=held)
    batch = {f"d{i}" for i in range(4)}
    in_step, go = threading.Event(), threading.Event()
    caught: list[set[str]] = []

    def step_fault(step_no: int) -> None:
        active = {s.request_id for s in eng.planner.rows}  # the decode rows of the step running now
        if active == batch and not caught:
            caught.append(active)
            in_step.set()
            assert go.wait(TIMEOUT), "the test never let the faulty step go on"
            raise RuntimeError("injected fault during disconnects")

    eng.step_fault = step_fault
    leavers = {"d0", "d4", "d8"}  # d0 runs in the faulty step; d4 and d8 wait in the queue
    prompts = {f"d{i}": f"disconnect prompt {i}" for i in range(10)}
    with start(eng, max_new_tokens_limit=1000) as srv:

        async def body():
            async with httpx.AsyncClient(timeout=30) as c:
                send = [
                    lambda rid=rid: c.post(
                        f"{srv.url}/generate", json={"request_id": rid, "prompt": prompts[rid], "max_new_tokens": 30}
                    )
                    for rid in prompts
                ]
                tasks = dict(zip(prompts, await queue_in_order(c, srv.url, held, send)))
                await wait_async(lambda: asyncio.sleep(0, in_step.is_set()), what="the faulty step")
                for rid in leavers:
                    tasks[rid].cancel()

                async def noticed() -> bool:  # the server saw all three leave while the step was running
                    text = (await c.get(f"{srv.url}/metrics")).text
                    return (
                        metric(text, "minibatch:num_requests_in_flight") == 7
                        and finished(text, "abort") == 2
                        and metric(text, "minibatch:num_requests_waiting") == 4
                    )

                await wait_async(noticed, what="the server to notice the disconnects")
                go.set()
                done = await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), TIMEOUT)
                return dict(zip(prompts, done))

        try:
            results = run(body())
        finally:
            go.set()
        assert caught == [batch]
        for rid, r in results.items():
            if rid in leavers:
                assert isinstance(r, asyncio.CancelledError), (rid, r)
            elif rid in batch:
                err = r.json()["error"]
                assert r.status_code == 500 and err["message"].endswith("engine step failed")
            else:
                assert r.status_code == 200 and r.json()["text"] == fake_text(prompts[rid], 30), (rid, r.text)
        assert_idle(srv)
        text = scrape_url(srv.url)
        # Every request once: the faulty batch (the leaver d0 included) as errors, the queued leavers as aborts.
        assert (finished(text, "error"), finished(text, "abort"), finished(text, "length")) == (4, 2, 4)
        assert sum(finished(text, r) for r in ("stop", "length", "abort", "timeout", "error")) == 10
        assert eng.resets == 1
