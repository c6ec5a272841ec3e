"""Shared fixtures: import paths, test checkpoints built once per session, reference generation."""

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
    """An httpx client on the app (FakeEngine by default) with its lifespan running; client.app is the app."""
    import httpx

    from config import Config
    from engine import FakeEngine
    from server import create_app

    config.setdefault("max_new_tokens_limit", 64)
    app = create_app(config=Config(model_id="fake", **config), engine=engine or FakeEngine(capacity=4))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


def bounded(coro_fn, timeout: float = TIMEOUT):
    return run(asyncio.wait_for(coro_fn(), timeout))


async def wait_until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
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
