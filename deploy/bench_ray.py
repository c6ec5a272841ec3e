"""Ray Serve vs one process, on this machine: the proxy's added latency, tokens/s with 1 and 2 replicas, and the
prefix-cache hit rate under prefix-affinity routing against power of two choices.

    python deploy/bench_ray.py                          # tiny GPT-2 (built locally), seed-like workload
    python deploy/bench_ray.py --model fake --json out.json
    python deploy/bench_ray.py --model weights/d2 --requests 32 --repeats 3
    python deploy/bench_ray.py --systems ours,ours_ray1,ours_ray1_direct          # the gateway's cost
    python deploy/bench_ray.py --systems ours,ours_ray2,ours_ray2_affinity --workload prefix   # hit rates

Systems, all up at once over real HTTP on 127.0.0.1, fed the same requests:

* ``ours``: ``python server.py`` in a subprocess (NUM_THREADS = the machine's CPUs);
* ``ours_ray1``: Ray Serve (a local single-machine cluster, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), 1 replica with
  all the CPUs (so the same threads as ``ours``) behind the gateway (the default app), at ``/ray1``;
* ``ours_ray2``: 2 replicas with half the CPUs each (NUM_THREADS follows each replica's num_cpus), at ``/ray2``;
* ``ours_ray1_direct``: as ``ours_ray1`` without the gateway (``gateway: false``: Serve's proxy calls the replica);
* ``ours_ray2_affinity``: as ``ours_ray2`` with ``routing: prefix_affinity``.

Workloads: ``seed`` (the prompts of ``scripts/benchmark.py``) or ``prefix`` (4 long shared preambles, each followed
by one of the short seed prompts: what a prefix cache and affinity routing are for). Every system's prefix-cache hit
rate over the rounds is read from its replicas' ``/metrics`` (``minibatch:prefix_cache_hits_total`` over
``minibatch:prefix_cache_queries_total``, in tokens, summed over the replicas); "-" when the server exports no such
series (a build without prefix caching).

The machine may be shared and its speed may swing from minute to minute, so everything is measured side by side:

* **workload**: ``--repeats`` rounds; each round runs the seed-like workload (the prompts of
  ``scripts/benchmark.py``, budgets from {8, 16, 32, 48}, EOS ignored, MAX_BATCH_SIZE 8 per replica, every request
  sent at t0 and streamed) on every system in turn, in a rotating order, while the others idle. Tokens/s over the
  wall time, TTFT from t0 to the first event; ``x ours`` is the median over rounds of the ratio to ``ours`` in the
  same round;
* **idle TTFT**: ``--probes`` pairs of streamed one-token requests on idle servers, alternating between a Ray
  system and ``ours``; the p50 of the paired differences is the proxy's added latency per request (HTTP proxy ->
  router -> replica actor call, and back).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported: every socket on loopback
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import httpx  # noqa: E402

from scripts.bench.workloads import PROMPT_TEXTS  # noqa: E402  the seed workload's prompts (scripts/benchmark.py)

BATCH = 8
# Ray systems: the build_app args of each (beside num_cpus and env); all but the *_direct ones use the gateway.
RAY_SYSTEMS = {
    "ours_ray1": {"num_replicas": 1},
    "ours_ray2": {"num_replicas": 2},
    "ours_ray1_direct": {"num_replicas": 1, "gateway": False},
    "ours_ray2_affinity": {"num_replicas": 2, "routing": "prefix_affinity"},
}
SYSTEMS = ("ours", *RAY_SYSTEMS)
PREFIX_HITS, PREFIX_QUERIES = "minibatch:prefix_cache_hits_total", "minibatch:prefix_cache_queries_total"
# The prefix workload's shared preambles: each well over the affinity router's 128 characters, distinct from the start.
PREAMBLES = [
    f"{topic} Answer the question below in plain words, in at most three sentences, without lists, without "
    "repeating the question, and say so when you are not sure. Keep any numbers exact and name your units. "
    for topic in (
        "You are a support agent for a bicycle shop.",
        "You are a tutor for a first course in chemistry.",
        "You are a travel guide for a small coastal town.",
        "You are a reviewer of short Python programs.",
    )
]


def workload(n: int, seed: int, kind: str = "seed") -> list[tuple[str, int]]:
    """``seed``: the seed prompts; ``prefix``: a shared preamble (one of 4) before each. Budgets 8-48."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = rng.choice(PROMPT_TEXTS)
        if kind == "prefix":
            prompt = rng.choice(PREAMBLES) + prompt
        reqs.append((prompt, rng.choice([8, 16, 32, 48])))
    return reqs


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# --- one request, streamed: (ttft_s, tokens) measured by the client ----------------------------------
async def stream_one(c: httpx.AsyncClient, url: str, prompt: str, n: int, t0: float) -> tuple[float, int]:
    ttft, tokens = None, 0
    body = {"prompt": prompt, "max_new_tokens": n, "stream": True, "ignore_eos": True}
    async with c.stream("POST", f"{url}/generate", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if ttft is None:
                ttft = time.perf_counter() - t0
            tokens += len(event["token_ids"])
    assert ttft is not None and tokens == n, (tokens, n)
    return ttft, tokens


async def paired_idle_ttft(direct: str, other: str, probes: int) -> tuple[list[float], list[float]]:
    """One-token streamed requests on idle servers, alternating direct / other, so both see the same machine load."""
    async with httpx.AsyncClient(timeout=120) as c:
        for url in (direct, other):
            await stream_one(c, url, "warm up", 1, time.perf_counter())
        a, b = [], []
        for i in range(probes):
            for url, out in ((direct, a), (other, b)) if i % 2 == 0 else ((other, b), (direct, a)):
                t0 = time.perf_counter()
                ttft, _ = await stream_one(c, url, f"probe {i}", 1, t0)
                out.append(ttft * 1e3)
        return a, b


async def run_workload(url: str, reqs: list[tuple[str, int]]) -> dict:
    limits = httpx.Limits(max_connections=len(reqs) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream_one(c, url, p, n, t0) for p, n in reqs))
        wall = time.perf_counter() - t0
    tokens = sum(t for _, t in results)
    ttft = [f * 1e3 for f, _ in results]
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_ms": {"p50": percentile(ttft, 0.5), "p95": percentile(ttft, 0.95)},
    }


def replica_count(name: str) -> int:
    return RAY_SYSTEMS[name]["num_replicas"] if name in RAY_SYSTEMS else 1


async def prefix_cache_counts(url: str, replicas: int) -> tuple[float, float] | None:
    """(hits, queries) of the prefix cache summed over the ``replicas`` replicas behind ``url``, each read from its
    own /metrics (asked until every replica has answered; the router picks one per request). None: no such series."""
    seen: dict[str, tuple[float, float] | None] = {}
    async with httpx.AsyncClient(timeout=30) as c:
        for _ in range(20 * replicas):
            r = await c.get(f"{url}/metrics")
            seen[r.headers.get("x-minibatch-replica", "direct")] = prefix_counts(r.text)
            if len(seen) == replicas:
                break
    if len(seen) < replicas:
        raise RuntimeError(f"only {len(seen)} of {replicas} replicas behind {url} answered /metrics")
    if any(v is None for v in seen.values()):
        return None
    return sum(v[0] for v in seen.values()), sum(v[1] for v in seen.values())  # type: ignore[index]


def prefix_counts(text: str) -> tuple[float, float] | None:
    """(hits, queries) from one Prometheus page, summed over label sets; None when it has no queries series."""
    sums = {PREFIX_HITS: 0.0, PREFIX_QUERIES: 0.0}
    found = False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
            found |= name == PREFIX_QUERIES
    return (sums[PREFIX_HITS], sums[PREFIX_QUERIES]) if found else None


def hit_rate(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def interleaved(urls: dict[str, str], reqs: list[tuple[str, int]], repeats: int) -> dict[str, dict]:
    """``repeats`` rounds of the workload on every system in turn (rotating order); medians and paired ratios, and
    each system's prefix-cache hit rate over the rounds (None: not exported)."""
    for url in urls.values():
        asyncio.run(run_workload(url, reqs[:BATCH]))  # warm-up
    names = list(urls)
    before = {name: asyncio.run(prefix_cache_counts(urls[name], replica_count(name))) for name in names}
    rounds: list[dict[str, dict]] = []
    for k in range(repeats):
        order = names[k % len(names) :] + names[: k % len(names)]
        rounds.append({name: asyncio.run(run_workload(urls[name], reqs)) for name in order})
    out = {}
    for name in names:
        runs = [r[name] for r in rounds]
        after = asyncio.run(prefix_cache_counts(urls[name], replica_count(name)))
        out[name] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "runs_tokens_per_s": [r["tokens_per_s"] for r in runs],
            "ttft_ms": {q: statistics.median(r["ttft_ms"][q] for r in runs) for q in ("p50", "p95")},
            "tokens": runs[0]["tokens"],
            "prefix_cache_hit_rate": hit_rate(before[name], after),
        }
        if "ours" in urls:
            out[name]["x_ours"] = statistics.median(r[name]["tokens_per_s"] / r["ours"]["tokens_per_s"] for r in rounds)
    return out


def proxy_overhead(direct: str, other: str, probes: int) -> dict:
    """Idle TTFT p50 through ``other`` and directly, measured side by side, and the paired difference."""
    a, b = asyncio.run(paired_idle_ttft(direct, other, probes))
    diffs = [y - x for x, y in zip(a, b)]
    return {
        "idle_ttft_ms": {"p50": percentile(b, 0.5), "p95": percentile(b, 0.95)},
        "direct_idle_ttft_ms": {"p50": percentile(a, 0.5), "p95": percentile(a, 0.95)},
        "added_ms_p50": percentile(diffs, 0.5),
    }


# --- the systems ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"server exited before {url}/ready answered")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}/ready not 200 within {timeout:.0f}s")


@contextmanager
def direct_server(env: dict[str, str], cpus: int):
    """``python server.py`` on a free loopback port; yields its URL and stops it (SIGTERM) afterwards."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="bench-ray-direct-", suffix=".log", delete=False)
    full = {**os.environ, **env, "HOST": "127.0.0.1", "PORT": str(port), "NUM_THREADS": str(cpus)}
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "server.py")], cwd=ROOT, env=full, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 180, alive=lambda: proc.poll() is None)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ray_fleet(env: dict[str, str], cpus: int, replica_counts: list[int]):
    """``ray_systems`` for ``ours_ray1`` and/or ``ours_ray2`` (the default app: the gateway, power of two choices)."""
    return ray_systems(env, cpus, [f"ours_ray{n}" for n in replica_counts])


@contextmanager
def ray_systems(env: dict[str, str], cpus: int, names: list[str]):
    """A Serve app per system of ``names`` (RAY_SYSTEMS) at ``/<name>`` on a local single-machine cluster; yields
    {system: url}.

    Ray gets the machine's CPUs once per app as logical CPUs so all apps fit at once; each replica still gets
    NUM_THREADS = its share of the real CPUs (all for 1 replica, half for 2)."""
    if not names:
        yield {}
        return
    import ray
    from ray import serve

    from deploy.ray_serve import build_app

    ray.init(num_cpus=len(names) * cpus, include_dashboard=False, log_to_driver=False, object_store_memory=80 * 2**20)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        apps = []
        for name in names:
            spec = RAY_SYSTEMS[name]
            args = {**spec, "num_cpus": cpus / spec["num_replicas"], "env": env}
            apps.append(serve.RunTarget(build_app(args), name=name, route_prefix=f"/{name}"))
        serve.run_many(apps)
        urls = {name: f"http://127.0.0.1:{port}/{name}" for name in names}
        for url in urls.values():
            wait_ready(url, 180)
        yield urls
    finally:
        serve.shutdown()
        ray.shutdown()


def resolve_model(name: str) -> str:
    if name != "tiny":
        return name
    from scripts.make_test_model import build_checkpoint

    return build_checkpoint(tempfile.mkdtemp(prefix="bench-ray-tiny-"), shape="tiny", seed=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--systems",
        default="ours,ours_ray",
        help=f"comma-separated: {', '.join(SYSTEMS)} (ours_ray: ours_ray1 and ours_ray2)",
    )
    p.add_argument("--workload", choices=("seed", "prefix"), default="seed")
    p.add_argument("--model", default="tiny", help="tiny (built locally), fake, or a MODEL_ID")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--probes", type=int, default=30, help="sequential one-token requests for the idle TTFT")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fake-step-delay", type=float, default=0.02, help="MODEL_ID=fake: seconds per decode step")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    systems = set()
    for name in filter(None, (n.strip() for n in args.systems.split(","))):
        if name not in SYSTEMS and name != "ours_ray":
            p.error(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)} or ours_ray (both Ray systems)")
        systems |= {"ours_ray1", "ours_ray2"} if name == "ours_ray" else {name}
    model = resolve_model(args.model)
    env = {"MODEL_ID": model, "MAX_BATCH_SIZE": str(BATCH), "LOG_LEVEL": "WARNING"}
    if model == "fake":
        env["FAKE_STEP_DELAY_S"] = str(args.fake_step_delay)
    cpus = os.cpu_count() or 1
    reqs = workload(args.requests, args.seed, args.workload)
    ray_names = [name for name in RAY_SYSTEMS if name in systems]
    with direct_server(env, cpus) as direct, ray_systems(env, cpus, ray_names) as ray_urls:
        urls = {**({"ours": direct} if "ours" in systems else {}), **ray_urls}
        results = interleaved(urls, reqs, args.repeats)
        for name, url in ray_urls.items():  # the direct server answers the paired probes even if not benchmarked
            results[name].update(proxy_overhead(direct, url, args.probes))
    print_table(results, f"{args.model}, workload {args.workload}", cpus)
    if args.json:
        with open(args.json, "w") as f:
            out = {"model": args.model, "workload": args.workload, "cpus": cpus, "requests": len(reqs)}
            json.dump({**out, "results": results}, f, indent=1)
    return 0


def print_table(results: dict, model: str, cpus: int) -> None:
    print(f"\nmodel {model}, {cpus} CPUs, MAX_BATCH_SIZE {BATCH} per replica; medians over the rounds")
    print(
        f"{'system':<18} {'tok/s':>7} {'x ours':>6} {'TTFT p50':>9} {'TTFT p95':>9} {'prefix hits':>11}   "
        f"{'idle TTFT p50: via Ray / direct':>31} {'added p50':>9}"
    )
    for name, r in results.items():
        idle = ""
        if "idle_ttft_ms" in r:
            idle = (
                f"{r['idle_ttft_ms']['p50']:>20.1f} / {r['direct_idle_ttft_ms']['p50']:>6.1f} ms "
                f"{r['added_ms_p50']:>+8.1f} ms"
            )
        ratio = f"{r['x_ours']:>6.2f}" if "x_ours" in r else f"{'-':>6}"
        hits = r.get("prefix_cache_hit_rate")
        hits = f"{hits:>11.1%}" if hits is not None else f"{'-':>11}"
        print(
            f"{name:<18} {r['tokens_per_s']:>7.1f} {ratio} {r['ttft_ms']['p50']:>9.0f} {r['ttft_ms']['p95']:>9.0f} "
            f"{hits}   " + idle
        )


if __name__ == "__main__":
    sys.exit(main())
