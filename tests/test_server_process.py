"""`python server.py` as an operator runs it, in a subprocess on 127.0.0.1: a bad environment value stops
it with a message naming the variable, and it accepts no connection before the model has loaded.
Each subprocess is stopped by its own pid (SIGTERM, then SIGKILL) and every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from config import Config

from live import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_VARS = {f.name.upper() for f in dataclasses.fields(Config)}

# (variable, bad value, what the message must say)
BAD_VALUES = [
    ("MAX_BATCH_SIZE", "abc", "MAX_BATCH_SIZE must be an integer (got 'abc')"),
    ("PORT", "70000", "PORT must be in [1, 65535]"),
    ("LOG_LEVEL", "LOUD", "LOG_LEVEL must be one of"),
    ("MAX_QUEUE_TIME_S", "soon", "MAX_QUEUE_TIME_S must be a number (got 'soon')"),
]


def server_env(**values: str) -> dict[str, str]:
    """The test's environment without any server setting, then 127.0.0.1 on a free port and ``values``."""
    env = {k: v for k, v in os.environ.items() if k not in CONFIG_VARS}
    env.update({"HOST": "127.0.0.1", "PORT": str(free_port()), "PYTHONUNBUFFERED": "1", "MODEL_ID": "fake"})
    env.update(values)
    return env


def stop(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    """SIGTERM our own child by its pid, SIGKILL if it outlives ``timeout``; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def run_bad_values() -> dict[str, tuple[int, str]]:
    """Start `python server.py` once per bad value (in parallel); {variable: (exit code, output)}."""
    procs = {
        var: subprocess.Popen(
            [sys.executable, "server.py"],
            cwd=ROOT,
            env=server_env(**{var: raw}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for var, raw, _ in BAD_VALUES
    }
    out = {}
    try:
        for var, proc in procs.items():
            try:
                text, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                stop(proc)
                text, _ = proc.communicate()
                raise AssertionError(f"server.py with a bad {var} kept running:\n{text}") from None
            out[var] = (proc.returncode, text)
    finally:
        for proc in procs.values():
            stop(proc)
    return out


@pytest.fixture(scope="module")
def bad_value_runs():
    return run_bad_values()


@pytest.mark.parametrize("var, raw, message", BAD_VALUES, ids=[v for v, _, _ in BAD_VALUES])
def test_bad_environment_value_stops_the_server(bad_value_runs, var, raw, message):
    """Docs: "A bad value stops startup with a message naming the variable"."""
    code, text = bad_value_runs[var]
    assert code != 0, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines and message in lines[-1], text  # the last word is the reason, naming the variable
    assert "Uvicorn running" not in text, text


def test_bad_environment_value_is_one_line_without_a_traceback(bad_value_runs):
    for var, _, message in BAD_VALUES:
        _, text = bad_value_runs[var]
        lines = [line for line in text.splitlines() if line.strip()]
        assert "Traceback" not in text and len(lines) == 1 and message in lines[0], text


@pytest.mark.model
def test_no_connection_is_accepted_before_the_model_has_loaded(tiny_model_dir):
    """Docs: "uvicorn accepts no connections until the model has loaded". While main() loads the
    checkpoint (torch import included: seconds), connecting is refused; the first connection that is
    accepted finds the server ready, never "loading"."""
    env = server_env(MODEL_ID=tiny_model_dir, MAX_BATCH_SIZE="2", LOG_LEVEL="INFO")
    port = int(env["PORT"])
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen([sys.executable, "server.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

        def output() -> str:
            log.seek(0)
            return log.read()

        try:
            refused_while_loading = 0
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, f"server.py exited:\n{output()}"
                assert time.monotonic() < deadline, f"server.py never listened:\n{output()}"
                # The process is up (interpreter, torch import, checkpoint load) and the engine has not said it
                # has loaded yet: main() loads the model before uvicorn opens its socket.
                loading = "minibatch.engine: loaded" not in output()
                try:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                    break
                except ConnectionRefusedError:
                    refused_while_loading += loading
                    time.sleep(0.01)
            with sock:
                sock.sendall(b"GET /ready HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            head, _, body = answer.decode().partition("\r\n\r\n")
            assert head.startswith("HTTP/1.1 200") and '"ready"' in body, answer
            assert refused_while_loading > 0, f"no connection attempt fell in the model load:\n{output()}"
            log_text = output()
            order = [
                log_text.find(s)
                for s in ("Waiting for application startup.", "Application startup complete.", "Uvicorn running on")
            ]
            assert -1 not in order and order == sorted(order), log_text
        finally:
            stop(proc)
