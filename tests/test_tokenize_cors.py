"""``POST /tokenize`` / ``POST /detokenize`` (vLLM's shapes) and CORS (``CORS_ALLOW_ORIGINS``).

The shapes, errors and token counts run through the ASGI app on the FakeEngine; the real tokenizer
and chat template, the API key and a browser's preflight run against a real uvicorn on 127.0.0.1
serving the tiny checkpoint (``live.ThreadServer``)."""

from __future__ import annotations

import httpx
import pytest

from config import Config
from server import create_app

from conftest import assert_error, bounded, serving
from live import ThreadServer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
KEY = "tokenize-key-0123456789"
ORIGIN = "http://localhost:5173"
TIMEOUT = 60.0


# --- shapes and counts on the FakeEngine -------------------------------------------------------------------------


def test_tokenize_counts_what_the_generating_endpoints_count():
    async def body():
        async with serving() as c:
            r = await c.post("/tokenize", json={"prompt": "héllo", "return_token_strs": True})
            assert r.status_code == 200, r.text
            b = r.json()
            assert b["tokens"] == [b + 1 for b in "héllo".encode()] and b["count"] == 6
            assert b["max_model_len"] == c.app.state.server.engine.max_context
            assert len(b["token_strs"]) == 6 and b["token_strs"][0] == "h"
            assert (await c.post("/tokenize", json={"prompt": "x"})).json()["token_strs"] is None
            usage = (await c.post("/v1/completions", json={"prompt": "héllo", "max_tokens": 1})).json()["usage"]
            assert usage["prompt_tokens"] == b["count"]

            chat = (await c.post("/tokenize", json={"messages": CHAT})).json()
            rendered = c.app.state.server.engine.apply_chat_template(CHAT)
            assert chat["tokens"] == [b + 1 for b in rendered.encode()]
            usage = (await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})).json()["usage"]
            assert usage["prompt_tokens"] == chat["count"]

    bounded(body)


def test_detokenize_round_trip_and_vocabulary():
    async def body():
        async with serving() as c:
            ids = (await c.post("/tokenize", json={"prompt": "round trip ✓"})).json()["tokens"]
            r = await c.post("/detokenize", json={"tokens": ids})
            assert r.status_code == 200 and r.json() == {"prompt": "round trip ✓"}
            assert (await c.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}
            err = assert_error(await c.post("/detokenize", json={"tokens": [5, 10**6]}), 422, contains="vocabulary")
            assert err["param"] == "tokens"
            assert_error(await c.post("/detokenize", json={"tokens": [-1]}), 422, contains="vocabulary")

    bounded(body)


@pytest.mark.parametrize(
    "path, payload, status, words",
    [
        ("/tokenize", {}, 422, "exactly one"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, 422, "exactly one"),
        ("/tokenize", {"prompt": 5}, 422, "prompt"),
        ("/tokenize", {"prompt": "a", "frobnicate": 1}, 422, "frobnicate"),
        ("/tokenize", {"messages": []}, 422, "messages"),
        ("/tokenize", {"prompt": "a", "model": "gpt-9"}, 404, "gpt-9"),
        ("/tokenize", {"messages": CHAT, "add_generation_prompt": False}, 400, "add_generation_prompt"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            400,
            "image_url",
        ),
        ("/tokenize", {"prompt": "x" * 101}, 422, "MAX_PROMPT_CHARS"),
        ("/detokenize", {"tokens": "abc"}, 422, "tokens"),
        ("/detokenize", {"tokens": [1.5]}, 422, "tokens"),
        ("/detokenize", {}, 422, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "gpt-9"}, 404, "gpt-9"),
    ],
)
def test_bad_requests(path, payload, status, words):
    async def body():
        async with serving(max_prompt_chars=100) as c:
            assert_error(await c.post(path, json=payload), status, contains=words)

    bounded(body)


def test_cors_is_off_by_default():
    async def body():
        async with serving() as c:
            preflight = await c.options(
                "/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
            )
            assert "access-control-allow-origin" not in preflight.headers
            r = await c.post("/tokenize", json={"prompt": "a"}, headers={"Origin": ORIGIN})
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers

    bounded(body)


# --- the real tokenizer, API_KEY and CORS over a real socket ---------------------------------------------------


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    config = Config(
        model_id=tiny_model_dir,
        chat_template=TEMPLATE,
        max_batch_size=2,
        api_key=KEY,
        cors_allow_origins=f"{ORIGIN}, https://app.example.com",
        log_level="WARNING",
    )
    with ThreadServer(create_app(config)) as server:
        yield server


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=TIMEOUT, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def test_real_tokenizer_and_chat_template(http, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "The quick brown fox, 東京"
    b = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert b["tokens"] == tok(text)["input_ids"] and b["count"] == len(b["tokens"])
    assert http.post("/detokenize", json={"tokens": b["tokens"]}).json()["prompt"] == text
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    expected = tok.apply_chat_template(CHAT, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok(expected, add_special_tokens=False)["input_ids"]
    done = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == chat["count"]


def test_tokenize_needs_the_api_key(live):
    for path, payload in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        r = httpx.post(f"{live.url}{path}", json=payload, timeout=TIMEOUT)
        assert r.status_code == 401, r.text
        assert r.headers["www-authenticate"] == "Bearer"


def test_preflight_and_cors_headers(live, http):
    """A browser's preflight (OPTIONS, no credentials) is answered without the API key; the actual request
    and its errors carry Access-Control-Allow-Origin for an allowed origin, and nothing for another."""
    asked = "authorization, content-type, x-stainless-os"
    preflight = httpx.options(
        f"{live.url}/v1/chat/completions",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked},
        timeout=TIMEOUT,
    )
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    allowed = preflight.headers["access-control-allow-headers"].lower()
    assert all(h in allowed for h in ("authorization", "content-type", "x-stainless-os"))

    ok = http.post("/tokenize", json={"prompt": "a"}, headers={"Origin": ORIGIN})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "retry-after" in ok.headers["access-control-expose-headers"].lower()
    no_key = httpx.post(f"{live.url}/tokenize", json={"prompt": "a"}, headers={"Origin": ORIGIN}, timeout=TIMEOUT)
    assert no_key.status_code == 401 and no_key.headers["access-control-allow-origin"] == ORIGIN

    other = "https://evil.example.org"
    refused = httpx.options(
        f"{live.url}/v1/completions",
        headers={"Origin": other, "Access-Control-Request-Method": "POST"},
        timeout=TIMEOUT,
    )
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    r = http.post("/tokenize", json={"prompt": "a"}, headers={"Origin": other})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
