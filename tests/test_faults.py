"""Fault injection on a real uvicorn (in a thread, so the FakeEngine's faults are ours to choose):
engine steps and admissions that raise on chosen calls, and streaming clients killed mid-stream.

The requests caught by a fault get a 500 that says what failed; every other request gets its own
correct answer; the server keeps serving; capacity comes back. Bounded: every client call has a
timeout, every test stops the server it started.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx

from conftest import run
from config import Config
from engine import FakeEngine
from live import ThreadServer, fake_text, metric
from server import create_app


def start(engine: FakeEngine, **config) -> ThreadServer:
    config.setdefault("max_new_tokens_limit", 200)
    return ThreadServer(create_app(config=Config(model_id="fake", **config), engine=engine))


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def assert_idle(srv: ThreadServer) -> None:
    st = srv.state
    wait_for(lambda: st.scheduler.num_unfinished == 0 and st.engine.num_active() == 0, what="idle")
    assert not st.scheduler.running and not st.scheduler.waiting
    text = httpx.get(f"{srv.url}/metrics").text
    assert metric(text, "minibatch:kv_cache_usage_perc") == 0
    assert metric(text, "minibatch:num_requests_in_flight") == 0
    assert httpx.get(f"{srv.url}/ready").status_code == 200


async def fire(url: str, requests: list[tuple[str, str, int]], stream_every: int = 0) -> dict[str, tuple[int, dict]]:
    """POST each (request_id, prompt, n) at once; streamed ones are folded into one final dict."""
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=500)) as c:
        async def one(i: int, rid: str, prompt: str, n: int):
            payload = {"request_id": rid, "prompt": prompt, "max_new_tokens": n}
            if stream_every and i % stream_every == 0:
                async with c.stream("POST", f"{url}/generate", json={**payload, "stream": True}) as r:
                    events = [json.loads(line[6:]) for line in [x async for x in r.aiter_lines()]
                              if line.startswith("data: ") and line != "data: [DONE]"]
                if events and "error" in events[-1]:
                    return rid, (events[-1]["error"]["code"], events[-1])
                return rid, (r.status_code, {"text": "".join(e["text"] for e in events),
                                             "finish_reason": events[-1].get("finish_reason")})
            r = await c.post(f"{url}/generate", json=payload)
            return rid, (r.status_code, r.json())

        pairs = await asyncio.gather(*(one(i, *req) for i, req in enumerate(requests)))
    return dict(pairs)


def check_outcomes(results, requests, failed_ids: set[str], message: str) -> None:
    assert set(results) == {rid for rid, _, _ in requests}
    for rid, prompt, n in requests:
        status, body = results[rid]
        if rid in failed_ids:
            assert status == 500, (rid, status, body)
            err = body["error"]
            assert message in err["message"] and err["type"] == "server_error", err
        else:
            assert status == 200, (rid, status, body)
            assert body["text"] == fake_text(prompt, n) and body["finish_reason"] == "length", (rid, body)


def test_step_faults_fail_only_the_active_batch_and_the_server_keeps_serving():
    """Three poisoned requests crash every decode step they are in: each takes down its own batch
    (itself and whoever shares the step), nobody else. A poisoned newcomer joining a running batch
    rides in a mixed admit+step call first, which fails, is retried apart, and then fails in the step."""
    poisoned = {"s-5", "s-25", "s-45"}
    caught: set[str] = set()
    eng = FakeEngine(capacity=4, step_delay=0.002)

    def step_fault(step_no: int) -> None:
        active = {s.request_id for s in eng.active_sequences()}
        if active & poisoned:
            caught.update(active)
            raise RuntimeError(f"injected step fault #{step_no}")

    eng.step_fault = step_fault
    with start(eng) as srv:
        requests = [(f"s-{i}", f"step fault prompt {i}", 3 + i % 9) for i in range(60)]
        results = run(fire(srv.url, requests, stream_every=3))
        print(f"\nstep faults from {sorted(poisoned)}: {len(caught)} of {len(requests)} requests got 500")
        assert poisoned <= caught and len(caught) <= 12, caught
        check_outcomes(results, requests, caught, "engine step failed: injected step fault #")
        assert_idle(srv)
        assert eng.resets == len(poisoned)
        text = httpx.get(f"{srv.url}/metrics").text
        assert metric(text, "minibatch:request_success_total", 'finished_reason="error"') == len(caught)
        assert metric(text, "minibatch:request_success_total", 'finished_reason="length"') == 60 - len(caught)
        assert metric(text, "minibatch:engine_failures_total", 'phase="decode"') == len(poisoned)
        # Later traffic is unaffected.
        again = run(fire(srv.url, [(f"after-{i}", f"after {i}", 5) for i in range(8)]))
        assert all(code == 200 for code, _ in again.values())


def test_admit_faults_fail_only_their_newcomers():
    """Prefill runs out of memory on any group holding a poisoned request: that group fails (in a
    mixed admit+step call too, once retried apart), the running batch goes on."""
    poisoned = {"a-6", "a-21"}
    caught: set[str] = set()

    def admit_fault(seqs) -> None:
        group = {s.request_id for s in seqs}
        if group & poisoned:
            caught.update(group)
            raise MemoryError(f"injected prefill OOM for {sorted(group & poisoned)}")

    eng = FakeEngine(capacity=3, step_delay=0.002, admit_fault=admit_fault)
    with start(eng) as srv:
        requests = [(f"a-{i}", f"admit fault prompt {i}", 2 + i % 7) for i in range(40)]
        results = run(fire(srv.url, requests, stream_every=4))
        print(f"\nadmission faults from {sorted(poisoned)}: {len(caught)} of {len(requests)} requests got 500")
        assert poisoned <= caught and len(caught) <= 6, caught
        check_outcomes(results, requests, caught, "admission failed: injected prefill OOM")
        assert_idle(srv)
        text = httpx.get(f"{srv.url}/metrics").text
        assert metric(text, "minibatch:engine_failures_total", 'phase="prefill"') == len(caught)


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
        st = srv.state
        client = subprocess.Popen([sys.executable, "-c", _KILLABLE_CLIENT, str(srv.port), "100000"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            line = client.stdout.readline().strip()  # bounded: the client's socket has a timeout
            assert line == "streaming", line
            (seq,) = st.scheduler.running.values()
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
        text = httpx.get(f"{srv.url}/metrics").text
        assert metric(text, "minibatch:request_success_total", 'finished_reason="abort"') == 1


def test_many_streaming_clients_dropped_mid_stream():
    eng = FakeEngine(capacity=4, step_delay=0.002, max_context=1_000_000)
    with start(eng, max_new_tokens_limit=100_000) as srv:
        st = srv.state
        socks = []
        body = b'{"prompt": "dropped", "stream": true, "max_new_tokens": 50000}'
        for _ in range(12):  # 4 running, 8 waiting
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\n\r\n" + body)
            socks.append(s)
        wait_for(lambda: st.scheduler.num_unfinished == 12, what="12 in flight")
        for s in socks:
            s.close()
        assert_idle(srv)
        text = httpx.get(f"{srv.url}/metrics").text
        assert metric(text, "minibatch:request_success_total", 'finished_reason="abort"') == 12
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "after", "max_new_tokens": 3}, timeout=10)
        assert r.status_code == 200


def test_a_fault_while_a_client_disconnects_loses_nothing():
    """A step fault and client disconnects in the same window: every sequence resolves exactly once."""
    eng = FakeEngine(capacity=4, step_delay=0.003)
    seen: list[int] = []

    def step_fault(step_no: int) -> None:
        if step_no == 10:
            raise RuntimeError("injected fault during disconnects")

    eng.step_fault = step_fault
    with start(eng, max_new_tokens_limit=1000) as srv:
        sched = srv.state.scheduler
        inner = sched.on_resolved

        def on_resolved(seq) -> None:  # on the server's event loop
            seen.append(seq.seq_id)
            inner(seq)

        sched.on_resolved = on_resolved

        async def body():
            async with httpx.AsyncClient(timeout=30) as c:
                tasks = [asyncio.create_task(c.post(f"{srv.url}/generate", json={"prompt": f"d{i}", "max_new_tokens": 30}))
                         for i in range(10)]
                deadline = time.monotonic() + 10
                while len(seen) + sched.num_unfinished < 10 and time.monotonic() < deadline:
                    await asyncio.sleep(0.001)
                for t in tasks[::3]:
                    t.cancel()
                return await asyncio.gather(*tasks, return_exceptions=True)

        results = run(body())
        assert_idle(srv)
        assert len(seen) == len(set(seen)) == 10, seen
        codes = sorted(r.status_code for r in results if isinstance(r, httpx.Response))
        assert set(codes) <= {200, 500}, codes
