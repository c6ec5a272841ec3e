"""Hostile and malformed input against a real uvicorn (MODEL_ID=fake): no 5xx, no schema violations,
every rejection a 4xx with a message.

* A bounded ``schemathesis`` run over the app's own OpenAPI schema: schema-valid (positive) and
  schema-invalid (negative) requests for every operation, derandomized, ``max_examples`` per
  operation and mode. Checks: not a server error, status code documented, content type
  documented, body conforms to the documented response schema, and (negative mode) invalid data
  is rejected.
* Hand-written raw cases: malformed JSON, wrong types, huge/negative numbers, NaN/Infinity,
  emoji, unpaired surrogates (raw ``\\ud800`` escapes), a prompt far past the context window,
  over-long prompts, oversized bodies (declared and chunked), bad headers.
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from config import Config
from engine import FakeEngine
from server import create_app

from conftest import assert_error_body
from live import ThreadServer

MAX_EXAMPLES = 40  # per operation and mode: (7 positive + 3 negative) x 40 = 400 generated requests at most
CONTEXT = 256
MAX_BODY = 16_384
MAX_PROMPT_CHARS = 2_000
TRIED = {"schemathesis": 0, "raw": 0}


@pytest.fixture(scope="module")
def live():
    config = Config(
        model_id="fake",
        max_new_tokens_limit=32,
        max_body_bytes=MAX_BODY,
        max_prompt_chars=MAX_PROMPT_CHARS,
        log_level="WARNING",
    )
    with ThreadServer(create_app(config=config, engine=FakeEngine(capacity=4, max_context=CONTEXT))) as srv:
        yield srv


@pytest.fixture(scope="module")
def roomy():
    """Default body limit for schemathesis: it checks that invalid data is rejected with 400/422, and a
    413 for a generated body over a small MAX_BODY_BYTES would not count (413 has its own cases below)."""
    config = Config(model_id="fake", max_new_tokens_limit=32, max_prompt_chars=MAX_PROMPT_CHARS, log_level="WARNING")
    with ThreadServer(create_app(config=config, engine=FakeEngine(capacity=4, max_context=CONTEXT))) as srv:
        yield srv


@pytest.fixture(scope="module")
def schema(roomy):
    return schemathesis.openapi.from_url(f"{roomy.url}/openapi.json")


OPERATIONS = [
    ("/generate", "POST"),
    ("/v1/completions", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/v1/models", "GET"),
    ("/health", "GET"),
    ("/ready", "GET"),
    ("/metrics", "GET"),
]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


CASES = [
    (path, method, mode)
    for path, method in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if method == "POST" or mode is GenerationMode.POSITIVE
]  # a GET without parameters has no invalid form


@pytest.mark.parametrize("path, method, mode", CASES, ids=[f"{m} {p} {g.value}" for p, m, g in CASES])
def test_schemathesis(roomy, schema, path, method, mode):
    operation = schema[path][method]
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])
    seen = []

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run_case(case):
        response = case.call(base_url=roomy.url, timeout=15)
        seen.append(response.status_code)
        case.validate_response(response, checks=checks)

    run_case()
    TRIED["schemathesis"] += len(seen)
    assert seen and max(seen) < 500, seen
    if mode is GenerationMode.NEGATIVE and method == "POST":
        assert all(400 <= s < 500 for s in seen), seen


# --- hand-written raw cases ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(live):
    with httpx.Client(base_url=live.url, timeout=15) as c:
        yield c


def raw_post(client: httpx.Client, path: str, body: bytes, headers: dict | None = None) -> httpx.Response:
    TRIED["raw"] += 1
    h = {"content-type": "application/json", **(headers or {})}
    return client.post(path, content=body, headers=h)


def assert_4xx(r: httpx.Response, status: int | None = None, contains: str | None = None) -> dict:
    """A 4xx (``status`` when given) in OpenAI's error shape (``assert_error_body``), holding ``contains``."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    if status is not None:
        assert r.status_code == status, r.text
    return assert_error_body(r.json(), r.status_code, *([contains] if contains is not None else []))


PATHS = ["/generate", "/v1/completions", "/v1/chat/completions"]
MALFORMED = [
    b"",
    b"{",
    b"}",
    b"{{}}",
    b'{"prompt": ',
    b'{"prompt": "x",}',
    b"{'prompt': 'x'}",
    b"not json",
    b"[]",
    b"null",
    b"42",
    b'"prompt"',
    b"\xff\xfe\x00",
    b'{"prompt": "x"} trailing',
    b'{"prompt": "\\x41"}',
    b"\x00" * 64,
    b'{"prompt": "x", "prompt": 5}',
    b'{"messages": "hi"}',
    b'{"messages": [{"role": "robot", "content": "x"}]}',
    b'{"messages": []}',
    b'{"messages": [{"role": "user"}]}',
    b'{"messages": [{"role": "user", "content": 5}]}',
    b"[" * 10_000,  # deep nesting
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_bodies(client, path, body):
    assert_4xx(raw_post(client, path, body))


def _payload(path: str, **fields) -> dict:
    if path == "/v1/chat/completions":
        content = fields.pop("prompt", "hi")
        return {"messages": [{"role": "user", "content": content}], **fields}
    return {"prompt": "hi", **fields}


BAD_FIELDS = [
    {"prompt": 5},
    {"prompt": None},
    {"prompt": True},
    {"prompt": {"a": 1}},
    {"prompt": ""},
    {"max_tokens": "8"},
    {"max_tokens": 8.5},
    {"max_tokens": -1},
    {"max_tokens": 0},
    {"max_tokens": 10**30},
    {"max_tokens": 2**63},
    {"max_tokens": True},
    {"temperature": -0.1},
    {"temperature": 1e308},
    {"temperature": "hot"},
    {"top_p": 0},
    {"top_p": 1.5},
    {"top_k": -1},
    {"seed": -1},
    {"seed": 2**64},
    {"presence_penalty": 99},
    {"repetition_penalty": 0},
    {"stop": [""]},
    {"stop": ["x"] * 9},
    {"stop": 5},
    {"stop_token_ids": [-1]},
    {"stop_token_ids": list(range(65))},
    {"n": 9},  # beyond MAX_N (8)
    {"stream": "yes"},
    {"logprobs": 99},
    {"logit_bias": {"x": 5}},
    {"logit_bias": {"1": 500}},
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fields", BAD_FIELDS, ids=range(len(BAD_FIELDS)))
def test_wrong_types_and_out_of_range_numbers(client, path, fields):
    fields = dict(fields)
    if path == "/v1/chat/completions" and fields == {"prompt": ""}:
        assert raw_post(client, path, json.dumps(_payload(path, **fields)).encode()).status_code == 200
        return  # an empty chat message is fine: the template still renders a prompt
    if path == "/generate":
        if "max_tokens" in fields:
            fields["max_new_tokens"] = fields.pop("max_tokens")
        if any(k in fields for k in ("n", "logprobs")):
            fields["unknown_field"] = 1  # /generate forbids unknown fields
    assert_4xx(raw_post(client, path, json.dumps(_payload(path, **fields)).encode()))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty"])
def test_non_finite_numbers(client, path, literal, field):
    body = json.dumps(_payload(path)).encode()[:-1] + f', "{field}": {literal}}}'.encode()
    assert_4xx(raw_post(client, path, body), 422)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("escape", ["\\ud800", "\\udfff", "x\\ud83d", "\\ude00y", "\\ud800\\ud800"])
def test_unpaired_surrogates_are_422(client, path, escape):
    prompt_key = '"content"' if path == "/v1/chat/completions" else '"prompt"'
    if path == "/v1/chat/completions":
        body = ('{"messages": [{"role": "user", %s: "a%sb"}]}' % (prompt_key, escape)).encode()
    else:
        body = ('{%s: "a%sb", "max_tokens": 2}' % (prompt_key, escape)).encode()
    assert_4xx(raw_post(client, path, body), 422)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("text", ["😀", "\\ud83d\\ude00", "東京 café", "\u0000", "\u202e", "\\n\\t", "🚀" * 50])
def test_emoji_and_odd_unicode_are_fine(client, path, text):
    raw = text if "\\" in text else json.dumps(text)[1:-1]
    if path == "/v1/chat/completions":
        body = ('{"messages": [{"role": "user", "content": "%s"}], "max_tokens": 3}' % raw).encode()
    else:
        key = "max_new_tokens" if path == "/generate" else "max_tokens"
        body = ('{"prompt": "%s", "%s": 3}' % (raw, key)).encode()
    r = raw_post(client, path, body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", PATHS)
def test_prompt_far_past_the_context_window(client, path):
    err = assert_4xx(raw_post(client, path, json.dumps(_payload(path, prompt="word " * 300)).encode()), 422)
    assert "context window" in err["message"] or "MAX_PROMPT_CHARS" in err["message"]
    err = assert_4xx(raw_post(client, path, json.dumps(_payload(path, prompt="x" * (CONTEXT + 5))).encode()), 422)
    assert "context window" in err["message"]


@pytest.mark.parametrize("path", PATHS)
def test_prompt_over_max_prompt_chars(client, path):
    err = assert_4xx(
        raw_post(client, path, json.dumps(_payload(path, prompt="y" * (MAX_PROMPT_CHARS + 1))).encode()), 422
    )
    assert "MAX_PROMPT_CHARS" in err["message"]


def test_completion_token_ids_outside_the_vocabulary(client):
    for ids in ([300], [-1], [2**40], [1, 2, 10**9]):
        assert_4xx(raw_post(client, "/v1/completions", json.dumps({"prompt": ids}).encode()), 422)


@pytest.mark.parametrize("path", PATHS)
def test_oversized_body_declared(client, path):
    body = json.dumps(_payload(path, prompt="z" * (MAX_BODY + 10))).encode()
    assert_4xx(raw_post(client, path, body), 413, "MAX_BODY_BYTES")


@pytest.mark.parametrize("path", PATHS)
def test_oversized_body_chunked(client, path):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"z" * 1024
        yield b'"}'

    TRIED["raw"] += 1
    r = client.post(path, content=chunks(), headers={"content-type": "application/json"})
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert_4xx(r, 413, "MAX_BODY_BYTES")


def test_huge_declared_content_length_is_refused_before_reading(live):
    import socket

    TRIED["raw"] += 1
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as s:
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 99999999999\r\n\r\n{"prompt": '
        )
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]


def test_wrong_content_type_and_methods(client):
    assert_4xx(raw_post(client, "/generate", b'{"prompt": "x"}', {"content-type": "text/plain"}), 422)
    TRIED["raw"] += 3
    assert_4xx(client.get("/generate"), 405)
    assert_4xx(client.delete("/v1/models"), 405)
    assert_4xx(client.get("/does-not-exist"), 404)


def test_server_still_healthy_afterwards(live):
    r = httpx.post(f"{live.url}/generate", json={"prompt": "still fine", "max_new_tokens": 3})
    assert r.status_code == 200
    assert httpx.get(f"{live.url}/ready").status_code == 200
    runtime = live.state
    assert runtime.engine.num_active() == 0 and runtime.scheduler.num_unfinished == 0
    print(f"\nbad input tried: {TRIED['schemathesis']} schemathesis-generated requests, {TRIED['raw']} hand-written")
