"""HTTP framing and the transport defences, under both documented ways of running: ``python server.py`` and
``uvicorn server:app`` (which, left to itself, would pick httptools where it is installed, as ray[serve] installs
it, with none of our settings). Raw sockets against a real server on 127.0.0.1 (FakeEngine); bounded reads.

* A request with both Content-Length and Transfer-Encoding gets one 400 and the connection closes: its tail (a second
  request smuggled after the chunked body) is never served. Before: ``python server.py`` answered 200, framing it by
  chunked, and kept the connection open for the tail.
* Repeated or conflicting framing headers are a 400 too; plain chunked bodies and pipelined requests still work.
* Under ``uvicorn server:app`` the header deadline, the head size limit and the connection limit hold (before: an idle
  connection stayed open; httptools has no head size limit), and a model that cannot load is one line, exit 1.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from live import ROOT, ProcessServer, metric, scrape_url

WAYS = {"python server.py": None, "uvicorn server:app": []}
ENV = {"MODEL_ID": "fake", "LOG_LEVEL": "WARNING", "HEADER_TIMEOUT_S": "1", "MAX_HEADER_BYTES": "4096"}


@pytest.fixture(scope="module", params=list(WAYS))
def server(request):
    with ProcessServer(ENV, uvicorn_args=WAYS[request.param]) as srv:
        yield srv


def exchange(port: int, data: bytes, timeout: float = 5.0) -> tuple[list[tuple[int, bytes]], bool]:
    """Send ``data`` on a fresh connection, read until the server closes it or ``timeout`` passes: the responses
    (status, body) in order, and whether the server closed the connection."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(data)
    out, closed, deadline = b"", False, time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            closed = True
            break
        if not chunk:
            closed = True
            break
        out += chunk
    sock.close()
    return parse_responses(out), closed


def parse_responses(data: bytes) -> list[tuple[int, bytes]]:
    """Responses framed by Content-Length (all this server sends for these requests)."""
    responses = []
    while data.startswith(b"HTTP/1.1 "):
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
        length = int(headers.get(b"content-length", b"0"))
        responses.append((int(lines[0].split()[1]), rest[:length]))
        data = rest[length:]
    return responses


def post(path: str, body: bytes, framing: list[str]) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + "".join(
        f"{line}\r\n" for line in framing
    )
    return head.encode() + b"\r\n" + body


def chunked(body: bytes) -> bytes:
    return f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"


GENERATE = b'{"prompt": "first", "max_new_tokens": 2}'
SMUGGLED = post("/generate", b'{"prompt": "smuggled", "max_new_tokens": 3}', ["Content-Length: 42"])


def test_cl_te_gets_one_400_and_its_tail_is_never_served(server):
    before = scrape_url(server.url)
    attack = post("/generate", chunked(GENERATE), ["Content-Length: 4", "Transfer-Encoding: chunked"]) + SMUGGLED
    responses, closed = exchange(server.port, attack)
    assert [status for status, _ in responses] == [400], responses
    error = json.loads(responses[0][1])["error"]
    assert "Content-Length and Transfer-Encoding" in error["message"] and error["code"] == "invalid_request"
    assert closed, "the connection stayed open after the refusal"
    after = scrape_url(server.url)
    for name in ("minibatch:prompt_tokens_total", "minibatch:generation_tokens_total"):
        assert metric(after, name) == metric(before, name), name  # neither the head nor the tail ran


@pytest.mark.parametrize(
    "framing, words",
    [
        (["Content-Length: 41", "Content-Length: 41"], "one Content-Length"),
        (["Content-Length: 41", "Content-Length: 7"], None),
        (["Content-Length: 41, 41"], None),
        (["Transfer-Encoding: chunked", "Transfer-Encoding: chunked"], "single `chunked`"),
        (["Transfer-Encoding: gzip, chunked"], "single `chunked`"),
        (["Transfer-Encoding: chunked, chunked"], "single `chunked`"),
    ],
)
def test_repeated_or_conflicting_framing_headers_are_one_400_and_a_close(server, framing, words):
    body = chunked(GENERATE) if "Transfer-Encoding" in framing[0] else GENERATE
    responses, closed = exchange(server.port, post("/generate", body, framing) + SMUGGLED)
    assert [status for status, _ in responses] == [400], responses
    if words:
        assert words in json.loads(responses[0][1])["error"]["message"]
    assert closed


def test_plain_chunked_bodies_and_pipelined_requests_still_work(server):
    plain = post("/generate", GENERATE, [f"Content-Length: {len(GENERATE)}"])
    piped = post("/generate", chunked(GENERATE), ["Transfer-Encoding: chunked"]) + plain
    responses, _ = exchange(server.port, piped + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert [status for status, _ in responses] == [200, 200, 200], responses
    assert json.loads(responses[0][1])["text"] == json.loads(responses[1][1])["text"]


def test_idle_connections_and_oversized_heads_are_refused(server):
    """HEADER_TIMEOUT_S 1: a connection that sends nothing is closed; MAX_HEADER_BYTES 4096: an 8 KB head is a 400."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    start = time.monotonic()
    assert sock.recv(10) == b"" and time.monotonic() - start < 3, "the idle connection was not closed"
    sock.close()
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8192 + b"\r\n\r\n"
    responses, closed = exchange(server.port, big)
    assert [status for status, _ in responses] == [400] and closed, responses


def test_uvicorn_server_app_runs_our_protocol_and_limits_even_with_httptools_asked_for():
    """``--http httptools`` (what auto picks where it is installed) still gets the h11 protocol with our defences,
    and LIMIT_CONCURRENCY reaches uvicorn: the third connection past a limit of 2 gets uvicorn's 503."""
    env = {**ENV, "LIMIT_CONCURRENCY": "2", "HEADER_TIMEOUT_S": "5"}
    with ProcessServer(env, uvicorn_args=["--http", "httptools"]) as srv:
        log = srv.output()
        assert "h11 with the header timeout and framing checks (for --http httptools), limit_concurrency 2" in log, log
        attack = post("/generate", chunked(GENERATE), ["Content-Length: 4", "Transfer-Encoding: chunked"])
        held = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(2)]
        try:
            time.sleep(0.3)
            responses, _ = exchange(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", timeout=3)
            assert [status for status, _ in responses] == [503], responses
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.3)
        responses, closed = exchange(srv.port, attack + SMUGGLED)
        assert [status for status, _ in responses] == [400] and closed, responses


@pytest.mark.parametrize("env", [{"MODEL_ID": "/no/such/model"}, {"MODEL_ID": "fake", "MAX_BATCH_SIZE": "0"}])
def test_a_start_that_fails_under_uvicorn_is_the_same_one_line_as_python_server_py(env):
    """Before: ``uvicorn server:app`` printed the lifespan's traceback for a model that could not load."""
    lines = []
    for command in ([sys.executable, "server.py"], [sys.executable, "-m", "uvicorn", "server:app", "--port", "1"]):
        proc = subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, (command, proc.returncode, proc.stderr[-2000:])
        err = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("error: "), (command, proc.stderr[-2000:])
        lines.append(err[0])
    assert lines[0] == lines[1], lines
