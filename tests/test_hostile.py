"""Hostile clients against a real ``python server.py`` on 127.0.0.1 (issue 11): one client's abuse
(slow bodies, idle sockets, malformed or oversized input, shutdown mid-request) never hurts another
client's answer, and every answer that reaches the app has the API's error shape.

Every loop is bounded in count and time; each test stops only the process it started.
"""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import time

import httpx
import pytest

from conftest import assert_error_body, fake_text, run
from live import ProcessServer, metric

OK_BODY = {"prompt": "hello", "max_new_tokens": 3}


def fake_env(**extra) -> dict[str, str]:
    env = {"MODEL_ID": "fake", "LOG_LEVEL": "INFO", "MAX_NEW_TOKENS_LIMIT": "256"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


# --- raw sockets -----------------------------------------------------------------------------------
def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def slow_body(port: int, declared: int = 100) -> socket.socket:
    """A POST that declares ``declared`` body bytes, sends one, and stalls."""
    s = connect(port)
    head = (
        f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n\r\n{{"
    )
    s.sendall(head.encode())
    return s


def read_response(s: socket.socket, timeout: float) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one HTTP/1.1 response (Content-Length framed) read from ``s``."""
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed without a full response: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def closed_by_peer(s: socket.socket, timeout: float) -> bool:
    """True if the server closes ``s`` (EOF or reset) within ``timeout`` seconds."""
    s.settimeout(timeout)
    try:
        return s.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# --- item 2: slow request bodies ------------------------------------------------------------------
def test_slow_bodies_get_408_and_never_hold_request_slots():
    """More stalled bodies than MAX_CONCURRENT_REQUESTS: normal requests are still served at once,
    and each stalled one gets a 408 after BODY_TIMEOUT_S."""
    with ProcessServer(fake_env(MAX_CONCURRENT_REQUESTS=4, BODY_TIMEOUT_S=1)) as srv:
        stalled = [slow_body(srv.port) for _ in range(8)]
        try:
            time.sleep(0.3)
            r = httpx.post(f"{srv.url}/generate", json=OK_BODY, timeout=10)
            assert r.status_code == 200, r.text
            assert r.json()["text"] == fake_text("hello", 3)
            start = time.monotonic()
            for s in stalled:
                status, _, body = read_response(s, timeout=10)
                assert status == 408, body
                assert_error_body(body, 408, "BODY_TIMEOUT_S")
            print(
                f"\n8 stalled bodies with MAX_CONCURRENT_REQUESTS=4: normal request 200; "
                f"408s within {time.monotonic() - start + 0.3:.2f}s"
            )
        finally:
            for s in stalled:
                s.close()
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert metric(metrics, "minibatch:request_rejected_total", 'reason="body_timeout"') == 8
        assert metric(metrics, "minibatch:num_requests_in_flight") == 0


# --- item 3: connection exhaustion ----------------------------------------------------------------
def test_idle_and_slowloris_connections_are_closed_and_service_goes_on():
    """Idle sockets and headers trickled in byte by byte are cut after HEADER_TIMEOUT_S, so a crowd of
    them cannot keep LIMIT_CONCURRENCY full; a normal request is served afterwards."""
    with ProcessServer(fake_env(LIMIT_CONCURRENCY=40, HEADER_TIMEOUT_S=1)) as srv:
        idle = [connect(srv.port) for _ in range(30)]
        loris = [connect(srv.port) for _ in range(10)]
        try:
            for s in loris:
                s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
            deadline = time.monotonic() + 3.0
            i = 0
            while time.monotonic() < deadline:  # one header line every 0.2 s per socket: never complete
                for s in loris:
                    try:
                        s.sendall(f"X-Slow-{i}: a\r\n".encode())
                    except OSError:
                        pass
                i += 1
                time.sleep(0.2)
            open_idle = sum(not closed_by_peer(s, 0.5) for s in idle)
            open_loris = sum(not closed_by_peer(s, 0.5) for s in loris)
            print(f"\nafter 3 s with HEADER_TIMEOUT_S=1: {open_idle}/30 idle and {open_loris}/10 slowloris still open")
            assert open_idle == 0 and open_loris == 0
            r = httpx.post(f"{srv.url}/generate", json=OK_BODY, timeout=10)
            assert r.status_code == 200, r.text
        finally:
            for s in idle + loris:
                s.close()


def _limit_files(soft: int, hard: int | None = None):
    def preexec() -> None:
        cur_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, cur_hard if hard is None else hard))

    return preexec


def _nofile(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard)
    raise RuntimeError("no Max open files line")


def test_soft_file_limit_is_raised_to_the_hard_limit():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard <= 256:
        pytest.skip(f"hard RLIMIT_NOFILE {hard}: nothing to raise")
    with ProcessServer(fake_env(), preexec_fn=_limit_files(256)) as srv:
        soft, server_hard = _nofile(srv.pid)
        print(f"\nserver started with soft RLIMIT_NOFILE 256: now {soft} (hard {server_hard})")
        assert soft == server_hard == hard


def test_accept_errors_at_the_file_limit_are_logged_once_not_flooded():
    """With the file limit reached, asyncio logs "socket.accept() out of system resource" once per
    failed accept (thousands a second); the server rate-limits it and still serves once sockets free up."""
    with ProcessServer(fake_env(LIMIT_CONCURRENCY=0), preexec_fn=_limit_files(64, 64)) as srv:
        socks = []
        try:
            for _ in range(90):
                try:
                    socks.append(connect(srv.port))
                except OSError:
                    break
            time.sleep(2.0)
        finally:
            for s in socks:
                s.close()
        time.sleep(1.5)  # the server retries accept() every second
        r = httpx.post(f"{srv.url}/generate", json=OK_BODY, timeout=10)
        assert r.status_code == 200, r.text
        log = srv.output()
        n = log.count("socket.accept() out of system resource")
        print(f"\n{len(socks)} connections at a 64-file limit: {n} accept-error log lines, {len(log)} log bytes")
        assert 1 <= n <= 3, n


# --- item 9: shutdown edges -----------------------------------------------------------------------
def test_sigterm_with_a_stalled_body_answers_it_in_the_error_shape_and_exits_0():
    with ProcessServer(fake_env(BODY_TIMEOUT_S=30, DRAIN_TIMEOUT_S=5)) as srv:
        s = slow_body(srv.port)
        try:
            time.sleep(0.3)
            start = time.monotonic()
            srv.terminate()
            status, headers, body = read_response(s, timeout=15)
            code = srv.wait(15)
            took = time.monotonic() - start
        finally:
            s.close()
        print(f"\nSIGTERM with a stalled body: {status} after {took:.2f}s, exit {code}")
        assert status == 503 and headers.get("content-type") == "application/json", (status, headers, body)
        assert_error_body(body, 503, "shutting down")
        assert code == 0 and took < 5
        assert "Traceback" not in srv.output()


# --- items 6, 7, 8, 10, 11 -------------------------------------------------------------------------
def test_health_shows_the_served_name_never_the_model_path():
    with ProcessServer(fake_env(API_KEY="k", SERVED_MODEL_NAME="public-name")) as srv:
        body = httpx.get(f"{srv.url}/health").json()
        assert body["model"] == "public-name", body
        assert "fake" not in json.dumps(body)


def test_queue_full_503_has_retry_after():
    with ProcessServer(fake_env(MAX_BATCH_SIZE=1, MAX_QUEUE_DEPTH=1, FAKE_STEP_DELAY_S=0.02)) as srv:

        async def burst():
            async with httpx.AsyncClient(timeout=20) as c:
                return await asyncio.gather(
                    *(c.post(f"{srv.url}/generate", json={"prompt": f"p{i}", "max_new_tokens": 20}) for i in range(6))
                )

        answers = run(burst())
        full = [r for r in answers if r.status_code == 503]
        assert full and all(r.status_code in (200, 503) for r in answers), [r.status_code for r in answers]
        for r in full:
            assert r.json()["error"]["type"] == "overloaded"
            assert r.headers.get("retry-after") == "1", r.headers


@pytest.fixture(scope="module")
def plain():
    with ProcessServer(fake_env()) as srv:
        yield srv


def post_raw(srv: ProcessServer, body: bytes, path: str = "/generate") -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=10)


@pytest.mark.parametrize(
    "body, words",
    [
        (b'{"prompt": "x", "max_new_tokens": ' + b"9" * 5000 + b"}", ("digits",)),
        (b"[" * 100_000 + b"]" * 100_000, ("nested",)),
        ('{"prompt": "hello", "max_new_tokens": 2}'.encode("utf-16"), ("UTF-8", "utf-16")),
        ('{"prompt": "hello", "max_new_tokens": 2}'.encode("utf-16-le"), ("UTF-8", "utf-16")),
        ('{"prompt": "hello", "max_new_tokens": 2}'.encode("utf-32"), ("UTF-8", "utf-32")),
        (b'{"prompt": "caf\xe9"}', ("not valid UTF-8",)),
    ],
    ids=["5000-digit int", "nested 100000 deep", "utf-16 bom", "utf-16-le", "utf-32", "latin-1"],
)
def test_malformed_bodies_say_what_is_wrong(plain, body, words):
    r = post_raw(plain, body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    for word in words:
        assert word in err["message"], err


def test_utf8_with_bom_is_accepted(plain):
    r = post_raw(plain, '{"prompt": "hello", "max_new_tokens": 2}'.encode("utf-8-sig"))
    assert r.status_code == 200, r.text


def test_unknown_routes_and_methods_count_as_not_found(plain):
    before = httpx.get(f"{plain.url}/metrics").text
    assert httpx.get(f"{plain.url}/nope").status_code == 404
    assert httpx.delete(f"{plain.url}/generate").status_code == 405
    assert httpx.get(f"{plain.url}/v1/nothing").status_code == 404
    after = httpx.get(f"{plain.url}/metrics").text
    reason = 'reason="{}"'
    for name, delta in (("not_found", 3), ("validation", 0)):
        got = metric(after, "minibatch:request_rejected_total", reason.format(name))
        got -= metric(before, "minibatch:request_rejected_total", reason.format(name))
        assert got == delta, (name, got)


@pytest.mark.parametrize(
    "path, payload",
    [
        ("/generate", {"prompt": "boom", "max_new_tokens": 20}),
        ("/v1/completions", {"prompt": "boom", "max_tokens": 20}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "boom"}], "max_tokens": 20}),
    ],
)
def test_engine_error_ends_every_stream_the_openai_way_with_a_stable_message(path, payload):
    """After an engine error both APIs send the error event, then [DONE]; no internal exception text."""
    with ProcessServer(fake_env(FAKE_STEP_FAULT_EVERY=1)) as srv:
        with httpx.stream("POST", f"{srv.url}{path}", json={**payload, "stream": True}, timeout=10) as r:
            assert r.status_code == 200
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]", data
        err = json.loads(data[-2])["error"]
        assert err["code"] == "server_error" and err["type"] == "server_error", err
        assert "engine step failed" in err["message"] and "injected" not in err["message"], err
        r = httpx.post(f"{srv.url}{path}", json=payload, timeout=10)
        err = r.json()["error"]
        assert r.status_code == 500 and "injected" not in err["message"], err
        assert "injected fault" in srv.output()  # the detail is logged for the operator
