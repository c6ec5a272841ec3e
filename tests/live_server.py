"""A real uvicorn server on 127.0.0.1, in-process, for tests that need real sockets.

``LiveServer(app)`` runs ``uvicorn.Server`` in a background thread on a socket it binds itself
(port 0: no race for a free port), waits (bounded) until the lifespan has started, and stops it
with ``should_exit`` at exit. The app object stays reachable for white-box checks
(``live.state.engine``, ``live.state.scheduler``) — read-only from the test thread.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

import uvicorn

START_TIMEOUT = 120.0  # model load included; a tiny checkpoint takes a few seconds


class LiveServer:
    def __init__(self, app, start_timeout: float = START_TIMEOUT) -> None:
        self.app = app
        self.start_timeout = start_timeout
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=3,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name=f"uvicorn-{self.port}", daemon=True)
        self._error: BaseException | None = None

    def _serve(self) -> None:
        try:
            self.server.run(sockets=[self._sock])
        except BaseException as exc:  # reported by __enter__ / stop
            self._error = exc

    @property
    def state(self):
        """The app's ServerState (config, engine, scheduler) while the lifespan runs."""
        return self.app.state.server

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"uvicorn exited before it started (lifespan failed?): {self._error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"uvicorn did not start within {self.start_timeout:.0f}s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout: float = 20.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(5.0)
        self._sock.close()
        assert not self._thread.is_alive(), "uvicorn thread did not stop"


def wait_until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.005) -> None:
    """Poll ``cond`` until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
