"""The Ray Serve gateway and prefix-affinity router (deploy/gateway.py, deploy/routing.py), without a cluster.

The gateway's replica calls go to a scripted stand-in for the DeploymentHandle, so each failure (a replica dying
before its answer, in the middle of a stream, every replica dying) happens exactly where the test puts it; the
cluster test in test_ray_serve.py kills a real replica.
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from conftest import run, sse_events

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported (as in test_ray_serve)

from ray.exceptions import ActorDiedError  # noqa: E402

from config import Config  # noqa: E402
from deploy.gateway import GatewayApp, GatewaySettings, prefix_key, prompt_prefix  # noqa: E402
from deploy.ray_serve import build_app, deployment_options, gateway_options, gateway_settings, run_asgi  # noqa: E402
from deploy.routing import owner  # noqa: E402
from engine import FakeEngine  # noqa: E402
from server import create_app  # noqa: E402

SETTINGS = GatewaySettings(max_body_bytes=4096, body_timeout_s=2.0, replica_retries=2)
JSON_START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
SSE_START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


def body(data: bytes, more: bool = False) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


class Attempt:
    """One replica call: yields its message lists, then raises ``dies`` (if given). Records cancellation."""

    def __init__(self, batches: list[list[dict]], dies: BaseException | None = None) -> None:
        self.batches, self.dies, self.cancelled = batches, dies, False

    async def _gen(self):
        for batch in self.batches:
            await asyncio.sleep(0)
            yield batch
        if self.dies is not None:
            raise self.dies

    def __aiter__(self):
        return self._gen()

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedHandle:
    """Stands in for the replica deployment's DeploymentHandle: each ``remote`` call is the next Attempt."""

    def __init__(self, attempts: list[Attempt]) -> None:
        self.attempts, self.calls = attempts, []

    def options(self, **_):
        return self

    def remote(self, request: dict, prefix_key: str | None = None) -> Attempt:
        self.calls.append((request, prefix_key))
        return self.attempts[len(self.calls) - 1]


async def ask(handle: ScriptedHandle, settings: GatewaySettings = SETTINGS, **req) -> httpx.Response:
    app = GatewayApp(handle, settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        return await c.post("/generate", json={"prompt": "hi", "max_new_tokens": 2, **req})


def test_a_replica_that_dies_before_answering_is_replaced_by_another_and_the_client_sees_one_answer():
    answer = json.dumps({"text": "ok"}).encode()
    handle = ScriptedHandle(
        [
            Attempt([], ActorDiedError()),  # died before anything
            Attempt([[JSON_START]], ActorDiedError()),  # died after its start, before its body (held back)
            Attempt([[JSON_START, body(answer)]]),
        ]
    )
    r = run(ask(handle))
    assert r.status_code == 200 and r.json() == {"text": "ok"}
    assert len(handle.calls) == 3 and all(call == handle.calls[0] for call in handle.calls)  # the same request
    assert not handle.attempts[2].cancelled and handle.attempts[0].cancelled


def test_when_every_try_dies_the_answer_is_a_503_in_the_api_error_shape():
    handle = ScriptedHandle([Attempt([], ActorDiedError()) for _ in range(3)])
    r = run(ask(handle))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert error["code"] == "unavailable" and error["type"] == "unavailable"
    assert "replica serving this request died" in error["message"] and "tried on 3 replicas" in error["message"]
    assert len(handle.calls) == 3


def test_a_stream_under_way_ends_with_an_error_event_and_done_and_is_not_resent():
    first = b'data: {"text": "a"}\n\n'
    handle = ScriptedHandle([Attempt([[SSE_START, body(first, more=True)]], ActorDiedError())])
    r = run(ask(handle, stream=True))
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[0] == {"text": "a"} and events[-1] == "[DONE]" and len(events) == 3
    error = events[1]["error"]
    assert error["code"] == "unavailable" and "the request was not completed" in error["message"]
    assert len(handle.calls) == 1


def test_a_stream_whose_replica_dies_before_its_first_event_is_resent():
    event = b'data: {"text": "a"}\n\n'
    handle = ScriptedHandle(
        [Attempt([[SSE_START]], ActorDiedError()), Attempt([[SSE_START], [body(event, True)], [body(b"", False)]])]
    )
    r = run(ask(handle, stream=True))
    assert r.status_code == 200 and sse_events(r.text) == [{"text": "a"}]
    assert len(handle.calls) == 2


def test_an_unexpected_failure_is_a_500_in_the_api_error_shape():
    r = run(ask(ScriptedHandle([Attempt([], ValueError("boom"))])))
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "boom" not in r.text  # the exception's text stays in the log


def test_an_oversized_body_reaches_the_replica_without_its_bytes_so_it_refuses_it_as_one_server_would():
    handle = ScriptedHandle([Attempt([[JSON_START, body(b"{}")]])])
    run(ask(handle, prompt="x" * 5000))
    request, key = handle.calls[0]
    headers = dict(request["scope"]["headers"])
    assert request["body"] == b"" and headers[b"content-length"] == b"4097" and key is None


def test_the_prefix_key_follows_the_prompt_start_and_the_system_prompt():
    def key(path: str, data: dict, chars: int = 16) -> str | None:
        return prefix_key(path, json.dumps(data).encode(), chars)

    long_a, long_b = "A shared preamble. " + "question one", "A shared preamble. " + "question two"
    assert key("/generate", {"prompt": long_a}) == key("/v1/completions", {"prompt": long_b})  # first 16 chars
    assert key("/generate", {"prompt": long_a}, chars=40) != key("/generate", {"prompt": long_b}, chars=40)
    assert key("/gpt2/generate", {"prompt": [long_a, "x"]}) == key("/generate", {"prompt": long_a})
    system = {"role": "system", "content": "You are terse."}
    chat_a = {"messages": [system, {"role": "user", "content": "one"}]}
    chat_b = {"messages": [system, {"role": "user", "content": "two"}]}
    assert key("/v1/chat/completions", chat_a, 200) == key("/v1/chat/completions", chat_b, 200)
    no_system = {"messages": [{"role": "user", "content": "one"}]}
    assert key("/v1/chat/completions", no_system, 200) != key("/v1/chat/completions", chat_a, 200)
    assert prompt_prefix("/generate", b"not json") is None and prompt_prefix("/metrics", b"") is None
    assert prompt_prefix("/generate", json.dumps({"prompt": [1, 2, 3]}).encode()) == "1 2 3"


def test_rendezvous_owner_is_stable_and_moves_only_the_keys_of_a_removed_replica():
    keys = [f"k{i}" for i in range(400)]
    three = {k: owner(k, ["r1", "r2", "r3"]) for k in keys}
    assert {k: owner(k, ["r3", "r1", "r2"]) for k in keys} == three  # order of the replicas does not matter
    counts = {r: list(three.values()).count(r) for r in ("r1", "r2", "r3")}
    assert min(counts.values()) > 80, counts  # spread
    two = {k: owner(k, ["r1", "r2"]) for k in keys}
    assert all(two[k] == three[k] for k in keys if three[k] != "r3")  # only r3's keys moved


def test_run_asgi_yields_the_apps_messages_and_a_caller_that_leaves_aborts_the_sequence():
    async def main():
        engine = FakeEngine(capacity=2)
        engine.step_delay = 0.01  # 500 tokens would take 5 s
        app = create_app(Config(model_id="fake"), engine=engine)
        async with app.router.lifespan_context(app):
            scope = {
                "type": "http",
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "method": "POST",
                "scheme": "http",
                "path": "/generate",
                "raw_path": b"/generate",
                "root_path": "",
                "query_string": b"",
                "headers": [(b"content-type", b"application/json")],
            }
            req = json.dumps({"prompt": "hi", "max_new_tokens": 3}).encode()
            messages = [m async for batch in run_asgi(app, scope, req) for m in batch]
            assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]
            assert messages[0]["status"] == 200 and len(json.loads(messages[1]["body"])["token_ids"]) == 3
            # A long stream whose caller leaves after the first event: the sequence is aborted at once.
            req = json.dumps({"prompt": "hi", "max_new_tokens": 500, "stream": True}).encode()
            stream = run_asgi(app, scope, req)
            async for batch in stream:
                if any(m["type"] == "http.response.body" and m["body"] for m in batch):
                    break
            await stream.aclose()
            scheduler = app.state.server.scheduler
            for _ in range(100):
                if not scheduler.running and not scheduler.waiting:
                    break
                await asyncio.sleep(0.02)
            assert not scheduler.running and not scheduler.waiting

    run(asyncio.wait_for(main(), 30))


def test_options_of_the_gateway_and_the_affinity_router():
    cfg = Config(model_id="fake", max_batch_size=4, max_queue_depth=50, drain_timeout_s=10)
    args = {"num_replicas": 3, "routing": "prefix_affinity", "affinity_prefix_chars": 64}
    model = deployment_options(cfg, args)
    router = model["request_router_config"]
    assert router["request_router_class"].__name__ == "PrefixAffinityRouter"
    assert router["request_router_kwargs"] == {"max_affinity_load": 4}  # a full batch
    gw = gateway_options(cfg, args, model)
    assert gw["max_ongoing_requests"] == 3 * 8 + 50 and gw["num_replicas"] == 1
    assert gw["graceful_shutdown_timeout_s"] > model["graceful_shutdown_timeout_s"]
    assert gateway_settings(cfg, args)["affinity_prefix_chars"] == 64
    assert gateway_settings(cfg, {})["affinity_prefix_chars"] == 0  # pow2: no key
    assert "request_router_config" not in deployment_options(cfg, {})
    auto = deployment_options(cfg, {"min_replicas": 1, "max_replicas": 5})
    assert gateway_options(cfg, {}, auto)["max_ongoing_requests"] == 5 * 8 + 50
    with pytest.raises(ValueError, match="routing must be one of"):
        build_app({"env": {"MODEL_ID": "fake"}, "routing": "random"})
    with pytest.raises(ValueError, match="needs the gateway"):
        build_app({"env": {"MODEL_ID": "fake"}, "routing": "prefix_affinity", "gateway": False})
