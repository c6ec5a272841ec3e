"""MiniBatch on Ray Serve (deploy/ray_serve.py): a local two-node Ray cluster in this process, everything on loopback.

One cluster and one Serve instance for the module (start-up costs ~30 s on 2 cores): the app ``fake`` (the gateway,
prefix-affinity routing, 2 replicas of MODEL_ID=fake with a step delay, API_KEY and limits set) at ``/``, and, when
the GPT-2 test is selected, ``gpt2`` (2 replicas of the tiny GPT-2, called by Serve's proxy directly: no gateway) at
``/gpt2``. The autoscaling test deploys and deletes its own app.
Traffic goes to the Serve proxy on 127.0.0.1 only. Ray runs in its single-machine mode
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0): every node address is 127.0.0.1, and a test asserts that no Ray process
listens outside 127.0.0.0/8. At the end every Ray process is stopped (serve.shutdown, ray.shutdown, cluster).
What needs no cluster (the options, the build, the health probe) is test_ray_serve_build.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest

from api.errors import error_code
from config import Config
from engine import FakeEngine

from conftest import metric, run
from live import free_port
from ray_harness import is_loopback, ray_listeners

APP, GPT2_APP = "fake", "gpt2"
KEY = "test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
STEP_DELAY_S = 0.02
BATCH = 8
FAKE_ENV = {
    "MODEL_ID": "fake",
    "FAKE_STEP_DELAY_S": str(STEP_DELAY_S),
    "MAX_BATCH_SIZE": str(BATCH),
    "API_KEY": KEY,
    "MAX_BODY_BYTES": "4096",
    "MAX_NEW_TOKENS_LIMIT": "200",
    "DRAIN_TIMEOUT_S": "10",
    "LOG_LEVEL": "WARNING",
}
# Ray's single-machine mode keeps every node on 127.0.0.1; no usage report leaves the box. Set before ray is
# imported (ray reads the first at import) and inherited by every Ray process this module starts.
os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"})


def fake_text(prompt: str, n: int) -> str:
    """What FakeEngine answers to ``prompt`` with a budget of ``n`` (its tokens never hit EOS)."""
    ids = FakeEngine().encode(prompt)
    return "".join(
        chr(FakeEngine.letter_token(SimpleNamespace(prompt_token_ids=ids, output_token_ids=[0] * i)) - 1)
        for i in range(n)
    )


# --- the cluster ------------------------------------------------------------------------------------------
@dataclass
class Fleet:
    url: str  # the Serve proxy
    metrics_ports: list[int]  # each node's Ray metrics export port
    test_pid: int


@pytest.fixture(scope="module")
def fleet(request):
    import ray
    from ray import serve
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    from deploy.ray_serve import build_app

    assert not ray_constants.ENABLE_RAY_CLUSTER, "ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set"
    fake = build_app({"num_replicas": 2, "env": FAKE_ENV, "health_check_period_s": 1, "routing": "prefix_affinity"})
    apps = [serve.RunTarget(fake, name=APP)]
    if any(item.name.startswith("test_tiny_gpt2") for item in request.session.items):  # not under -m "not model"
        gpt2_env = {
            "MODEL_ID": request.getfixturevalue("tiny_model_dir"),
            "MAX_BATCH_SIZE": "4",
            "MAX_NEW_TOKENS_LIMIT": "64",
            "LOG_LEVEL": "WARNING",
        }
        apps.append(
            serve.RunTarget(
                build_app({"num_replicas": 2, "env": gpt2_env, "gateway": False}), name=GPT2_APP, route_prefix="/gpt2"
            )
        )
    node = {"num_cpus": 3, "object_store_memory": 80 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        cluster.add_node(**node)
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run_many(apps)  # the apps start at once; returns when all are running
        wait_routed(f"http://127.0.0.1:{port}")
        yield Fleet(
            f"http://127.0.0.1:{port}", [n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]], os.getpid()
        )
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


def wait_routed(url: str, timeout: float = 30) -> None:
    """Until 10 new connections in a row reach the app: each node's proxy learns the routes on its own."""
    deadline, ok = time.monotonic() + timeout, 0
    while ok < 10:
        assert time.monotonic() < deadline, f"{url}/health not routed by every proxy within {timeout:.0f} s"
        with httpx.Client(timeout=10) as c:
            ok = ok + 1 if c.get(f"{url}/health").status_code == 200 else 0
        if ok == 0:
            time.sleep(0.2)


def client(timeout: float = 60) -> httpx.AsyncClient:
    """A new connection per request: each node runs a proxy on the same port (SO_REUSEPORT), the kernel spreads
    connections over them, and each proxy prefers the replica on its own node, so both replicas get traffic."""
    return httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=300, max_keepalive_connections=0))


async def generate(c: httpx.AsyncClient, url: str, prompt: str, n: int, **extra) -> httpx.Response:
    return await c.post(f"{url}/generate", json={"prompt": prompt, "max_new_tokens": n, **extra}, headers=AUTH)


def test_200_concurrent_requests_each_answered_once_by_both_replicas(fleet):
    n_requests = 200

    async def main():
        async with client() as c:
            prompts = [(f"request {i}", 1 + i % 8) for i in range(n_requests)]
            rs = await asyncio.gather(
                *(generate(c, fleet.url, p, n, request_id=f"r{i}") for i, (p, n) in enumerate(prompts))
            )
        by_replica: dict[str, int] = {}
        for i, ((prompt, n), r) in enumerate(zip(prompts, rs)):
            assert r.status_code == 200, (i, r.status_code, r.text)
            body = r.json()
            assert body["request_id"] == f"r{i}" and body["text"] == fake_text(prompt, n), (i, body)
            assert body["finish_reason"] == "length" and body["usage"]["completion_tokens"] == n
            replica = r.headers["x-minibatch-replica"]
            by_replica[replica] = by_replica.get(replica, 0) + 1
        assert len(rs) == n_requests and len({r.json()["request_id"] for r in rs}) == n_requests
        assert len(by_replica) == 2 and min(by_replica.values()) >= 20, by_replica

    run(asyncio.wait_for(main(), 90))


def test_api_key_and_limits_enforced_by_every_replica(fleet):
    async def main():
        async with client() as c:
            seen: dict[int, set[str]] = {}
            for i in range(12):  # a prompt of its own each time: under prefix affinity one prompt has one replica
                checks = [
                    (401, await c.post(f"{fleet.url}/generate", json={"prompt": f"x{i}", "max_new_tokens": 1})),
                    (401, await c.get(f"{fleet.url}/v1/models", headers={"authorization": "Bearer wrong"})),
                    (
                        413,
                        await c.post(
                            f"{fleet.url}/generate", headers=AUTH, json={"prompt": "x" * 5000, "max_new_tokens": 1}
                        ),
                    ),
                    (422, await generate(c, fleet.url, f"x{i}", 201)),
                ]
                for status, r in checks:
                    assert r.status_code == status, r.text
                    assert r.json()["error"]["code"] == error_code(status)
                    seen.setdefault(status, set()).add(r.headers["x-minibatch-replica"])
            open_probe = await c.get(f"{fleet.url}/health")  # probes stay open, as on one server
            assert open_probe.status_code == 200 and open_probe.json()["model"] == "fake"
        # 12 tries each, each on a new connection (so through either node's proxy): both replicas refused.
        assert all(len(replicas) == 2 for replicas in seen.values()), seen

    run(asyncio.wait_for(main(), 60))


def test_streaming_and_disconnects_through_the_proxy(fleet):
    """A stream arrives event by event; a client that leaves (streaming or not) aborts its sequence on the replica."""

    async def main():
        async with client() as c:
            events = []
            async with c.stream(
                "POST",
                f"{fleet.url}/generate",
                headers=AUTH,
                json={"prompt": "stream me", "max_new_tokens": 12, "stream": True},
            ) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert len(chunks) >= 12 and chunks[-1]["finish_reason"] == "length"
            assert "".join(ch["text"] for ch in chunks) == fake_text("stream me", 12)

            # Leave a long stream after two events, then a plain request by timing out: the replicas that ran
            # them must abort both sequences (each would run 200 x 20 ms otherwise).
            before = await fleet_aborts(c, fleet.url)
            async with c.stream(
                "POST",
                f"{fleet.url}/generate",
                headers=AUTH,
                json={"prompt": "long stream", "max_new_tokens": 200, "stream": True},
            ) as r:
                got = 0
                async for line in r.aiter_lines():
                    got += line.startswith("data: ")
                    if got == 2:
                        break
            async with client(timeout=0.5) as impatient:
                with pytest.raises(httpx.TimeoutException):
                    await generate(impatient, fleet.url, "plain long", 200)
            deadline = time.monotonic() + 3.0  # before either sequence could end by itself
            while True:
                after = await fleet_aborts(c, fleet.url)
                if after[0] == before[0] + 2 and after[1] == 0:
                    break
                assert time.monotonic() < deadline, (before, after)
                await asyncio.sleep(0.02)

    run(asyncio.wait_for(main(), 60))


async def fleet_aborts(c: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """(aborted sequences, running sequences) summed over both replicas, each read from its own /metrics."""
    abort = 'finished_reason="abort"'
    seen: dict[str, str] = {}
    for _ in range(40):
        r = await c.get(f"{url}/metrics")
        seen[r.headers["x-minibatch-replica"]] = r.text
        if len(seen) == 2:
            return (
                sum(metric(m, "minibatch:request_success_total", abort) for m in seen.values()),
                sum(metric(m, "minibatch:num_requests_running") for m in seen.values()),
            )
    raise AssertionError(f"only {list(seen)} answered /metrics")


@pytest.mark.model
def test_tiny_gpt2_greedy_through_ray_equals_the_single_process_server(fleet, tiny_model_dir):
    from server import create_app

    prompts = [
        ("Hello", 12),
        ("The quick brown fox jumps over", 20),
        ("a", 5),
        ("Paris Rome Tokyo", 16),
        ("1 2 3 4 5 6 7 8 9 10 11 12", 24),
        ("café 東京 😀", 10),
    ]

    copies = 4  # each prompt 4 times, all at once: both replicas answer, in batches of different make-up

    async def answers(c: httpx.AsyncClient, url: str, n_copies: int) -> tuple[list[dict], set[str]]:
        rs = await asyncio.gather(
            *(c.post(f"{url}/generate", json={"prompt": p, "max_new_tokens": n}) for p, n in prompts * n_copies)
        )
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        replicas = {r.headers.get("x-minibatch-replica", "") for r in rs}
        return [{k: r.json()[k] for k in ("text", "token_ids", "finish_reason", "usage")} for r in rs], replicas

    async def main():
        async with client() as c:
            via_ray, replicas = await answers(c, f"{fleet.url}/gpt2", copies)
        app = create_app(Config(model_id=tiny_model_dir, max_batch_size=4, max_new_tokens_limit=64))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as local:
                direct, _ = await answers(local, "http://t", 1)
        assert via_ray == direct * copies
        assert len(replicas) == 2, replicas
        assert any(a["token_ids"] for a in direct)

    run(asyncio.wait_for(main(), 120))


def ray_exported(ports: list[int], family: str) -> dict[tuple[str, str], float]:
    """(replica, le or "") -> value of ``ray_<family>`` for the fake app, from every node's Ray metrics export."""
    out = {}
    for port in ports:
        for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
            if line.startswith(f"ray_{family}{{") and f'application="{APP}"' in line:
                labels = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.rindex("}")].split(","))
                out[(labels["replica"].strip('"'), labels.get("le", "").strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


def test_metrics_of_every_replica_reach_rays_metrics_with_a_replica_label(fleet):
    """One scrape per node of Ray's metrics export shows each replica's own /metrics series, labelled by replica."""

    async def own_tokens() -> dict[str, float]:
        own: dict[str, float] = {}
        async with client() as c:
            for _ in range(40):
                r = await c.get(f"{fleet.url}/metrics")
                own[r.headers["x-minibatch-replica"]] = metric(r.text, "minibatch:generation_tokens_total")
                if len(own) == 2:
                    return own
        raise AssertionError(f"only {list(own)} answered /metrics")

    own = run(asyncio.wait_for(own_tokens(), 30))  # no traffic runs now: these are final
    # The 200-request test alone generated sum(1 + i % 8) = 900 tokens across the two replicas.
    assert sum(own.values()) >= 900 and min(own.values()) > 0, own
    deadline = time.monotonic() + 40  # Ray exports every few seconds
    want = {(replica, ""): value for replica, value in own.items()}
    exported = ray_exported(fleet.metrics_ports, "minibatch_generation_tokens_total")
    while exported != want and time.monotonic() < deadline:
        time.sleep(1)
        exported = ray_exported(fleet.metrics_ports, "minibatch_generation_tokens_total")
    assert exported == want
    # Histograms keep their buckets (le label): the +Inf bucket of TTFT per replica counts its answered requests.
    buckets = ray_exported(fleet.metrics_ports, "minibatch_time_to_first_token_seconds_bucket")
    assert {replica for replica, le in buckets if le == "+Inf"} == set(own)
    assert sum(v for (_, le), v in buckets.items() if le == "+Inf") >= 200


def test_no_ray_listener_outside_loopback(fleet):
    found = ray_listeners(fleet.test_pid)
    assert len({pid for _, _, pid in found}) >= 6, found  # GCS, raylets, proxies, replicas...: the probe sees them
    outside = [entry for entry in found if not is_loopback(entry[0])]
    assert not outside, f"Ray listens outside 127.0.0.0/8: {outside}"
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and is_loopback("::ffff:127.0.0.1")


def test_a_model_that_fails_to_load_fails_the_deploy_and_nothing_else(fleet):
    """A replica whose model cannot load never becomes healthy: the deploy fails, other apps keep serving."""
    from ray import serve

    from deploy.ray_serve import build_app

    broken = build_app(
        {"env": {"MODEL_ID": "/nonexistent/model", "LOG_LEVEL": "WARNING"}, "max_constructor_retry_count": 1}
    )
    with pytest.raises(RuntimeError, match="broken"):
        serve.run(broken, name="broken", route_prefix="/broken")
    assert serve.status().applications["broken"].status == "DEPLOY_FAILED"
    serve.delete("broken")

    async def still_serving():
        async with client() as c:
            r = await generate(c, fleet.url, "still here", 3)
            assert r.status_code == 200 and r.json()["text"] == fake_text("still here", 3), r.text

    run(asyncio.wait_for(still_serving(), 30))


async def stream_outcome(
    c: httpx.AsyncClient, url: str, prompt: str, n: int, on_event=lambda replica, events: None
) -> tuple[str, dict | None]:
    """A streamed /generate: (its text, the error body of its error event or None). Asserts it ended with [DONE].
    ``on_event(replica, events so far)`` is called at each event."""
    events = []
    body = {"prompt": prompt, "max_new_tokens": n, "stream": True}
    async with c.stream("POST", f"{url}/generate", headers=AUTH, json=body) as r:
        assert r.status_code == 200, (r.status_code, await r.aread())
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                on_event(r.headers["x-minibatch-replica"], len(events))
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    error = chunks[-1].get("error") if chunks else None
    return "".join(ch.get("text", "") for ch in chunks), error


async def replica_ids(c: httpx.AsyncClient, url: str, n: int = 2) -> set[str]:
    """The replicas that answer /health (no prompt: the router picks by load), asked until ``n`` have."""
    seen: set[str] = set()
    for _ in range(40):
        seen.add((await c.get(f"{url}/health")).headers["x-minibatch-replica"])
        if len(seen) == n:
            break
    return seen


def test_kill_one_replica_mid_load(fleet):
    """A replica killed under load: the gateway resends its plain requests (nothing had reached their clients) and
    ends its streams under way with a 503 error event and [DONE]; nothing is lost or answered twice; Serve replaces
    the replica and traffic reaches the new one."""
    import ray
    from ray import serve

    n_plain, n_streams, n_tokens = 60, 60, 30

    async def main():
        async with client() as c:
            before = await replica_ids(c, fleet.url)
            assert len(before) == 2
            # The victim: the replica of the first stream seen 3 events in (27 to go, >= 0.5 s): it dies mid-batch.
            under_way: asyncio.Future[str] = asyncio.get_running_loop().create_future()

            def on_event(replica: str, events: int) -> None:
                if events == 3 and not under_way.done():
                    under_way.set_result(replica)

            plain, streams = [], []
            for i in range(max(n_plain, n_streams)):  # interleaved: each replica's first batch holds both kinds
                if i < n_plain:
                    plain.append(asyncio.ensure_future(generate(c, fleet.url, f"load {i}", n_tokens)))
                if i < n_streams:
                    stream = stream_outcome(c, fleet.url, f"stream {i}", n_tokens, on_event)
                    streams.append(asyncio.ensure_future(stream))
            victim = await asyncio.wait_for(under_way, 30)
            name = next(
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(f"#{victim}")
            )
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            answers = await asyncio.gather(*plain)
            outcomes = await asyncio.gather(*streams)
            for i, r in enumerate(answers):  # every plain request answered once, correctly: resent if need be
                assert r.status_code == 200, (i, r.status_code, r.text)
                assert r.json()["text"] == fake_text(f"load {i}", n_tokens)
            assert len({r.json()["request_id"] for r in answers}) == n_plain
            cut = []
            for i, (text, error) in enumerate(outcomes):
                want = fake_text(f"stream {i}", n_tokens)
                if error is None:
                    assert text == want, (i, text)
                else:  # the events sent before the replica died are valid; then the API's error body and [DONE]
                    assert error["code"] == "unavailable" and "died" in error["message"], (i, error)
                    assert want.startswith(text), (i, error)
                    cut.append(len(text))
            # The victim ran a batch of 8 when it died, one of them (at least) the stream that chose it.
            assert 1 <= len(cut) <= 8, cut
            print(
                f"\nkill mid-load: {n_plain}/{n_plain} plain requests answered (resent when their replica died), "
                f"{n_streams - len(cut)} streams complete, {len(cut)} ended by the 503 error event + [DONE] after "
                f"{sorted(cut)} characters; lost 0"
            )

            # Serve brings a replacement up and traffic reaches it.
            deadline = time.monotonic() + 60
            fresh: set[str] = set()
            k = 0
            while time.monotonic() < deadline and not fresh:
                states = serve.status().applications[APP].deployments["MiniBatch"].replica_states
                if states.get("RUNNING", 0) == 2:
                    for _ in range(10):
                        k += 1  # a prompt of its own each time: prefix affinity spreads them over the replicas
                        r = await generate(c, fleet.url, f"after {k}", 3)
                        assert r.status_code == 200 and r.json()["text"] == fake_text(f"after {k}", 3), r.text
                        fresh |= {r.headers["x-minibatch-replica"]} - before
                await asyncio.sleep(0.5)
            assert fresh, "no new replica served traffic within 60 s"
            assert victim not in fresh

    run(asyncio.wait_for(main(), 120))


PREAMBLE = "You are a careful assistant. Answer in one short sentence and never repeat the question. " * 2


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica_and_spreads_the_rest(fleet):
    """The fake app routes on the first 128 characters of the prompt (a chat's system prompt): a shared prefix stays on
    one replica until that replica holds a full batch (8), different prefixes spread over both."""
    assert len(PREAMBLE) >= 128

    async def main():
        async with client() as c:

            async def replica_of(prompt: str, n: int = 2) -> str:
                r = await generate(c, fleet.url, prompt, n)
                assert r.status_code == 200 and r.json()["text"] == fake_text(prompt, n), r.text
                return r.headers["x-minibatch-replica"]

            async def chat_replica(question: str) -> str:
                messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": question}]
                body = {"model": "fake", "messages": messages, "max_tokens": 2}
                r = await c.post(f"{fleet.url}/v1/chat/completions", headers=AUTH, json=body)
                assert r.status_code == 200, r.text
                return r.headers["x-minibatch-replica"]

            shared: list[str] = []
            for wave in range(3):  # waves of 4: below the affinity bound of a full batch (8)
                shared += await asyncio.gather(*(replica_of(PREAMBLE + f"question {wave}.{i}") for i in range(4)))
            chat = await asyncio.gather(*(chat_replica(f"question {i}") for i in range(6)))
            distinct = await asyncio.gather(*(replica_of(f"{i}: " + PREAMBLE) for i in range(16)))
            assert len(set(shared)) == 1 and len(set(chat)) == 1, (shared, chat)
            assert len(set(distinct)) == 2, distinct
            # 16 long requests sharing a prefix at once: the owner takes them up to its affinity bound, then power of
            # two choices sends the rest to the other replica (pure affinity would queue all 16 on the owner).
            owner = shared[0]
            burst = Counter(await asyncio.gather(*(replica_of(PREAMBLE + f"burst {i}", 40) for i in range(16))))
            assert len(burst) == 2 and 8 <= burst[owner] <= 12, burst
            print(f"\nprefix affinity: shared prefix {Counter(shared)}, distinct {Counter(distinct)}, burst {burst}")

    run(asyncio.wait_for(main(), 60))


def test_autoscaling_adds_a_replica_under_a_burst_and_removes_it_after(fleet):
    """An app with min 1 and max 2 replicas, a target of a full batch (2) per replica and short delays: a burst of
    requests brings up the second replica, which serves; when the burst ends, it goes away. Nothing is lost."""
    from ray import serve

    from deploy.ray_serve import build_app

    autoscaling = {"upscale_delay_s": 0.5, "downscale_delay_s": 2.0, "metrics_interval_s": 0.5, "look_back_period_s": 1}
    env = {**FAKE_ENV, "MAX_BATCH_SIZE": "2"}
    args = {"min_replicas": 1, "max_replicas": 2, "autoscaling_config": autoscaling, "env": env}
    serve.run(build_app(args), name="auto", route_prefix="/auto")
    url = f"{fleet.url}/auto"

    def running() -> int:
        return serve.status().applications["auto"].deployments["MiniBatch"].replica_states.get("RUNNING", 0)

    async def main() -> tuple[float, float, Counter]:
        assert running() == 1
        t0 = time.monotonic()
        served: Counter = Counter()
        async with client() as c:

            async def one(i: int) -> None:
                r = await generate(c, url, f"auto {i}", 20)
                assert r.status_code == 200 and r.json()["text"] == fake_text(f"auto {i}", 20), r.text
                served[r.headers["x-minibatch-replica"]] += 1

            # Keep 12 requests in flight (6 x the target) until two replicas have answered, at most 45 s.
            pending, i, up = set(), 0, None
            while len(served) < 2 and time.monotonic() - t0 < 45:
                while len(pending) < 12:
                    pending.add(asyncio.ensure_future(one(i)))
                    i += 1
                done, pending = await asyncio.wait(pending, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
                if up is None and await asyncio.to_thread(running) == 2:
                    up = time.monotonic() - t0
            await asyncio.gather(*pending)
        assert len(served) == 2 and up is not None, (served, up)
        t1 = time.monotonic()
        while await asyncio.to_thread(running) != 1 and time.monotonic() - t1 < 30:
            await asyncio.sleep(0.25)
        assert await asyncio.to_thread(running) == 1, "the second replica was not removed within 30 s"
        return up, time.monotonic() - t1, served

    try:
        up, down, served = run(asyncio.wait_for(main(), 90))
        print(f"\nautoscaling: 2 replicas running {up:.1f} s into the burst; back to 1 {down:.1f} s after; {served}")
    finally:
        serve.delete("auto")


def test_graceful_shutdown_lets_in_flight_requests_finish(fleet):
    """Deleting the app (a scale-down or a rolling update does the same per replica): in-flight requests complete."""
    from ray import serve

    async def main():
        async with client() as c:
            tasks = [asyncio.ensure_future(generate(c, fleet.url, f"drain {i}", 40)) for i in range(10)]
            await asyncio.sleep(0.4)  # all ten admitted (10 < 2 x 16 in flight), none finished (40 x 20 ms)
            await asyncio.to_thread(serve.delete, APP, _blocking=False)
            rs = await asyncio.gather(*tasks)
        for i, r in enumerate(rs):
            assert r.status_code == 200, (i, r.status_code, r.text)
            assert r.json()["text"] == fake_text(f"drain {i}", 40)

    run(asyncio.wait_for(main(), 60))
