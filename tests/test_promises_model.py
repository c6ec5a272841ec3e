"""Documented promises (README and docs/) that need a real tokenizer and model (the FakeEngine ignores them),
checked through HTTP on the tiny GPT-2
checkpoint: MAX_MODEL_LEN (0, N, past the window), `/v1`'s default temperature, and a
chat template that fails to render. The app is built from its config alone, as `python server.py`
builds it, and served through the ASGI transport with its lifespan. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import httpx
import pytest

from config import Config
from server import create_app

from conftest import assert_error, bounded

pytestmark = pytest.mark.model

WINDOW = 1024  # the tiny checkpoint's n_positions
PROMPT = "Once upon a time, in a small village by the sea"
# A template that renders user/assistant turns and refuses a system message, the way many real templates do.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
)
USER = [{"role": "user", "content": "Tell me about the quick brown fox."}]


@asynccontextmanager
async def served(model_dir: str, **config):
    """The app on ``model_dir`` (engine built by its lifespan) and an httpx client on it."""
    config.setdefault("log_level", "WARNING")
    app = create_app(config=Config(model_id=model_dir, **config))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60) as c:
            yield c


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


# --- MAX_MODEL_LEN ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_model_len, window", [(0, WINDOW), (48, 48), (5000, WINDOW)], ids=["0", "N", "beyond"])
def test_max_model_len_bounds_prompt_plus_budget(tiny_model_dir, max_model_len, window):
    """Docs: MAX_MODEL_LEN is the "KV-cache tokens per slot (prompt + output); 0 = the model's context window".
    A value past the model's window is held to the window (the model has no positions beyond it)."""

    async def body():
        async with served(tiny_model_dir, max_model_len=max_model_len, max_new_tokens_limit=2048) as c:
            assert ok(await c.get("/v1/models"))["data"][0]["max_model_len"] == window
            p = ok(await c.post("/generate", json={"prompt": PROMPT, "max_new_tokens": 1}))["usage"]["prompt_tokens"]
            r = await c.post("/generate", json={"prompt": PROMPT, "max_new_tokens": window - p + 1})
            assert_error(r, 422, "invalid_request_error", f"context window of {window} tokens")
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": window - p + 1})
            assert_error(r, 422, "invalid_request_error", f"context window of {window} tokens")
            if window < WINDOW:  # fill the slot's KV cache to its last position
                b = ok(
                    await c.post("/generate", json={"prompt": PROMPT, "max_new_tokens": window - p, "ignore_eos": True})
                )
                assert b["usage"] == {"prompt_tokens": p, "completion_tokens": window - p, "total_tokens": window}
                assert b["finish_reason"] == "length"

    bounded(body, timeout=120)


def test_chat_default_budget_fills_max_model_len(tiny_model_dir):
    """Docs: without a budget, chat gets "what is left of the context window" (here MAX_MODEL_LEN)."""

    async def body():
        async with served(tiny_model_dir, max_model_len=40, chat_template=STRICT_TEMPLATE) as c:
            b = ok(await c.post("/v1/chat/completions", json={"messages": USER, "temperature": 0, "ignore_eos": True}))
            assert b["usage"]["total_tokens"] == 40 and b["choices"][0]["finish_reason"] == "length", b["usage"]

    bounded(body, timeout=120)


# --- /v1's default temperature ------------------------------------------------------------------------------


def test_v1_default_temperature_is_1_and_generate_default_is_greedy(tiny_model_dir):
    """Docs: `temperature` defaults to "0 on `/generate`, 1 on `/v1` (OpenAI's default)". With a seed the
    draws are reproducible, so a request without a temperature must equal the same request at 1, and not
    the greedy one or one at another temperature."""

    async def body():
        async with served(tiny_model_dir, chat_template=STRICT_TEMPLATE) as c:
            for path, payload in [
                ("/v1/completions", {"prompt": PROMPT}),
                ("/v1/chat/completions", {"messages": USER}),
            ]:
                base = {**payload, "max_tokens": 16, "seed": 1234, "ignore_eos": True}

                async def answer(**extra) -> str:
                    choice = ok(await c.post(path, json={**base, **extra}))["choices"][0]
                    return choice["text"] if "text" in choice else choice["message"]["content"]

                default, at_1, greedy, at_half = await asyncio.gather(
                    answer(), answer(temperature=1.0), answer(temperature=0), answer(temperature=0.5)
                )
                assert default == at_1, path
                assert default != greedy and default != at_half, (path, default, greedy, at_half)
            plain = ok(
                await c.post(
                    "/generate", json={"prompt": PROMPT, "max_new_tokens": 16, "seed": 1234, "ignore_eos": True}
                )
            )
            greedy = ok(
                await c.post(
                    "/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
                )
            )
            assert plain["text"] == greedy["choices"][0]["text"]

    bounded(body, timeout=120)


# --- chat template failures ---------------------------------------------------------------------------------


def test_chat_template_that_fails_to_render_is_400(tiny_model_dir):
    """Docs: 400 for "chat template missing or failing"; the template's own message reaches the client."""

    async def body():
        async with served(tiny_model_dir, chat_template=STRICT_TEMPLATE) as c:
            b = ok(await c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3}))
            assert b["usage"]["completion_tokens"] >= 1
            system = [{"role": "system", "content": "Be brief."}, *USER]
            for stream in (False, True):
                r = await c.post("/v1/chat/completions", json={"messages": system, "max_tokens": 3, "stream": stream})
                err = assert_error(r, 400, "invalid_request_error", "System role not supported")
                assert "chat template" in err["message"] and err["param"] == "messages", err
        async with served(tiny_model_dir, chat_template="{% for m in messages %}{{ m['content'] }}") as c:  # no endfor
            r = await c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3})
            assert_error(r, 400, "invalid_request_error", "chat template")
            assert (
                ok(await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))["usage"][
                    "completion_tokens"
                ]
                >= 1
            )

    bounded(body, timeout=120)
