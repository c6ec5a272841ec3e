"""Real uvicorn servers on 127.0.0.1 for tests that need real sockets, started and stopped by the test.

* ``ProcessServer``: ``python server.py`` (or ``uvicorn server:app``) in a subprocess configured by environment
  variables (what an operator runs; receives real signals; its RSS and its limits are its own). It picks a
  free port, waits for ``/ready``, and stops by its own pid: SIGTERM, then SIGKILL if it does not
  exit in time.
* ``ThreadServer``: ``uvicorn.Server`` in a thread of the test process, serving an app object (so a
  test can inject a ``FakeEngine`` with faults and look at the engine and scheduler afterwards,
  read-only, through ``.state``). It binds its own socket (port 0: no race for a free port), waits
  (bounded) until the lifespan has started, and stops with ``should_exit``.

Also: ``poll_until`` (a bounded wait from a test thread), ``scrape_url`` and ``metric`` (one Prometheus sample), and
``fake_text`` (FakeEngine's expected answer, from conftest).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from conftest import fake_text, metric  # noqa: F401  (re-exported: tests import them from here with the servers)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def openai_client(server, timeout: float = 60.0):
    """The `openai` package's client for a live server's ``/v1``; no retries, so a test sees every failure."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def wait_ready(url: str, timeout: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"server exited before {url}/ready answered 200")
        try:
            r = httpx.get(f"{url}/ready", timeout=2)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.05)
    raise TimeoutError(f"{url}/ready not 200 within {timeout:.0f}s (last: {last})")


class ProcessServer:
    def __init__(
        self, env: dict[str, str], ready_timeout: float = 60.0, preexec_fn=None, uvicorn_args: list[str] | None = None
    ) -> None:
        """``uvicorn_args``: run ``uvicorn server:app`` with these arguments (and the port) instead of
        ``python server.py``: the other documented way of running."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {k: v for k, v in os.environ.items() if k not in CONFIG_VARS}
        full_env.update({"HOST": "127.0.0.1", "PORT": str(self.port), "PYTHONUNBUFFERED": "1"})
        full_env["ACTIVATIONS"] = "fp32"  # the exact path, as in-process tests run it (conftest._exact_activations)
        full_env["KV_CACHE_DTYPE"] = "fp32"  # the exact pool, as in-process tests run it (conftest._exact_kv_pool)
        full_env.update(env)
        self.log = tempfile.NamedTemporaryFile(prefix="minibatch-server-", suffix=".log", delete=False)
        command = [sys.executable, os.path.join(ROOT, "server.py")]
        if uvicorn_args is not None:
            command = [sys.executable, "-m", "uvicorn", "server:app", "--port", str(self.port), *uvicorn_args]
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=full_env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
        )
        try:
            wait_ready(self.url, ready_timeout, alive=lambda: self.proc.poll() is None)
        except Exception:
            self.stop()
            raise RuntimeError(f"server did not come up; its log:\n{self.output()}") from None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_kib(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def __enter__(self) -> ProcessServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


class ThreadServer:
    def __init__(self, app, ready_timeout: float = 120.0) -> None:
        """``ready_timeout``: model load included (a tiny checkpoint takes a few seconds)."""
        import uvicorn

        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=3)
        self.server = uvicorn.Server(config)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=f"uvicorn-{self.port}", daemon=True)
        self._thread.start()
        try:
            poll_until(self._started, ready_timeout, "uvicorn to start", interval=0.02)
        except BaseException:
            self.stop()
            raise

    def _serve(self) -> None:
        try:
            self.server.run(sockets=[self._sock])
        except BaseException as exc:  # reported by _started / stop
            self._error = exc

    def _started(self) -> bool:
        if not self._thread.is_alive() and not self.server.started:
            raise RuntimeError(f"uvicorn exited before it started (lifespan failed?): {self._error!r}")
        return self.server.started

    @property
    def state(self):
        """The app's Runtime (config, engine, scheduler) while the lifespan runs."""
        return self.app.state.server

    def stop(self, timeout: float = 20.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(5.0)
        self._sock.close()
        assert not self._thread.is_alive(), "uvicorn thread did not stop"

    def __enter__(self) -> ThreadServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def poll_until(cond, timeout: float, what: str, interval: float = 0.005) -> None:
    """Poll ``cond`` from a test thread until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def scrape_url(url: str) -> str:
    """``GET {url}/metrics`` of a real server: the Prometheus text (read values with ``metric``)."""
    return httpx.get(f"{url}/metrics", timeout=10).text


def config_vars() -> set[str]:
    import dataclasses

    from config import Config

    return {f.name.upper() for f in dataclasses.fields(Config)}


CONFIG_VARS = config_vars()
