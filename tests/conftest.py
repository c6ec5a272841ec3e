"""Shared helpers and fixtures: import paths, bounded async runs, the in-process app client
(``serving``), FakeEngine's expected answers (``fake_text``/``fake_ids``), the error-shape check,
and the test checkpoints built once per session. Real-socket servers are in ``live.py``."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from contextlib import asynccontextmanager

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]


def run(coro):
    """Run a coroutine to completion on a fresh event loop (no pytest-asyncio needed)."""
    return asyncio.run(coro)


TIMEOUT = 20.0  # seconds any single async test may take


def fake_text(prompt: str, n: int) -> str:
    """FakeEngine's default answer to ``prompt`` after ``n`` tokens, computed independently of its
    letter_token: the n-th letter is chosen by the prompt's byte sum and n."""
    s = sum(b + 1 for b in prompt.encode("utf-8"))
    return "".join(chr(ord("a") + (s * 7 + i * 3) % 26) for i in range(n))


def fake_ids(prompt: str, n: int) -> list[int]:
    """The token ids behind ``fake_text`` (FakeEngine's byte-level ids: byte + 1)."""
    return [ord(c) + 1 for c in fake_text(prompt, n)]


class Gate:
    """A switch the engine's worker thread waits on (pass ``gate.wait`` as a FakeEngine fault hook)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()

    def wait(self, *_):
        self.entered.set()
        assert self.open.wait(TIMEOUT), "gate never opened"


@asynccontextmanager
async def serving(engine=None, **config):
    """An httpx client on the app (FakeEngine by default) with its lifespan running; client.app is the app.
    ``config``: Config fields (MAX_NEW_TOKENS_LIMIT 64 unless given)."""
    import httpx

    from config import Config
    from engine import FakeEngine
    from server import create_app

    config.setdefault("max_new_tokens_limit", 64)
    app = create_app(config=Config(model_id="fake", **config), engine=engine or FakeEngine(capacity=4))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=TIMEOUT) as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


def bounded(coro_fn, timeout: float = TIMEOUT):
    return run(asyncio.wait_for(coro_fn(), timeout))


async def wait_until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``cond`` on the event loop until true; fail naming ``what`` after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.001)


def assert_error(r, status: int, kind: str | None = None, contains: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["code"] == status and err["message"].strip()
    if kind is not None:
        assert err["type"] == kind, err
    if contains is not None:
        assert contains in err["message"], err
    return err


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer random GPT-2 (initializer_range 0.15) with a trained BPE tokenizer; pad unset."""
    from make_test_model import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("tiny")), shape="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_pad_model_dir(tmp_path_factory) -> str:
    """Same shape, other weights, and a tokenizer whose pad id differs from EOS."""
    from make_test_model import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("tiny_pad")), shape="tiny", seed=1, with_pad=True)
