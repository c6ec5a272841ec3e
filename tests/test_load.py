"""Load far above capacity on a real uvicorn serving a tiny locally built GPT-2 (greedy), on both runtimes.

300 requests at once into 8 slots (100 distinct prompt/budget pairs, 3 copies each, one of the three
streamed): every request is answered exactly once, each answer equals what its prompt gives when
it runs alone, and afterwards nothing is left in the engine (no active sequence, no KV row held).
"""

from __future__ import annotations

import asyncio
import collections
import random
import time

import httpx
import pytest

from config import Config
from server import create_app

from conftest import RUNTIMES, assert_pool_full, assert_runtime, read_sse, run, runtime_knobs
from live import ThreadServer, metric

pytestmark = pytest.mark.model

CAPACITY = 8
PAIRS = 100
COPIES = 3  # the first copy of each pair is streamed
WORDS = (
    "the quick brown fox jumps over a lazy dog while batching requests into slots of a small cache "
    "Paris Rome Tokyo numbers 1 2 3 fibonacci emoji café 東京 😀"
).split()


def make_pairs(seed: int = 5) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    pairs = []
    for i in range(PAIRS):
        prompt = f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
        pairs.append((prompt, rng.randint(1, 32)))
    return pairs


async def post(c: httpx.AsyncClient, url: str, rid: str, prompt: str, n: int, stream: bool) -> tuple[str, dict]:
    payload = {"request_id": rid, "prompt": prompt, "max_new_tokens": n}
    if not stream:
        r = await c.post(f"{url}/generate", json=payload)
        assert r.status_code == 200, (rid, r.status_code, r.text)
        return rid, r.json()
    texts, final = [], None
    async with c.stream("POST", f"{url}/generate", json={**payload, "stream": True}) as r:
        assert r.status_code == 200, (rid, r.status_code)
        for event in [e for e in await read_sse(r) if e != "[DONE]"]:
            assert "error" not in event, (rid, event)
            assert event["request_id"] == rid
            texts.append(event["text"])
            if "finish_reason" in event:
                final = event
    assert final is not None, rid
    return rid, {
        "request_id": rid,
        "text": "".join(texts),
        "finish_reason": final["finish_reason"],
        "usage": final["usage"],
    }


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_300_concurrent_requests_far_above_capacity(tiny_model_dir, runtime):
    config = Config(
        model_id=tiny_model_dir,
        max_batch_size=CAPACITY,
        max_new_tokens_limit=64,
        num_threads=1,
        log_level="WARNING",
        **runtime_knobs(runtime),
    )
    app = create_app(config=config)
    with ThreadServer(app, ready_timeout=120) as srv:
        sched, engine = srv.state.scheduler, srv.state.engine
        assert_runtime(engine, runtime)
        resolved: collections.Counter[str] = collections.Counter()
        inner = sched.on_resolved

        def on_resolved(seq) -> None:  # the server's event loop
            resolved[seq.request_id] += 1
            inner(seq)

        sched.on_resolved = on_resolved
        pairs = make_pairs()

        async def body():
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=400)) as c:
                alone = {}
                for i, (prompt, n) in enumerate(pairs):  # one at a time: the reference
                    alone[i] = (await post(c, srv.url, f"alone-{i}", prompt, n, stream=False))[1]
                jobs = [(f"load-{i}-{k}", i, k == 0) for i in range(PAIRS) for k in range(COPIES)]
                random.Random(1).shuffle(jobs)
                start = time.monotonic()
                results = await asyncio.gather(
                    *(post(c, srv.url, rid, *pairs[i], stream=stream) for rid, i, stream in jobs)
                )
                return alone, jobs, dict(results), time.monotonic() - start

        alone, jobs, results, seconds = run(asyncio.wait_for(body(), 150))
        print(
            f"\n{len(jobs)} requests into {CAPACITY} slots in {seconds:.1f}s; peak batch "
            f"{engine.stats()['peak_batch']}, steps {engine.stats()['steps']}"
        )

        assert len(results) == len(jobs) == PAIRS * COPIES
        for rid, i, stream in jobs:
            got, ref = results[rid], alone[i]
            assert got["request_id"] == rid
            assert got["text"] == ref["text"], (rid, pairs[i], got["text"], ref["text"])
            assert got["finish_reason"] == ref["finish_reason"], rid
            assert got["usage"] == ref["usage"], rid
            if not stream:
                assert got["token_ids"] == ref["token_ids"], rid
        # Exactly once on the server too: each request id resolved one time, nothing else.
        assert set(resolved) == {rid for rid, _, _ in jobs} | {f"alone-{i}" for i in range(PAIRS)}
        assert set(resolved.values()) == {1}
        # Nothing left behind: no active sequence, no KV row held, nothing queued or in flight.
        assert engine.num_active() == 0 and engine.active_sequences() == []
        assert_pool_full(engine)
        assert sched.num_unfinished == 0 and not sched.running and not sched.waiting
        assert engine.stats()["peak_batch"] == CAPACITY
        text = httpx.get(f"{srv.url}/metrics").text
        assert metric(text, "minibatch:kv_cache_usage_perc") == 0
        assert metric(text, "minibatch:num_requests_in_flight") == 0
        total = sum(
            metric(text, "minibatch:request_success_total", f'finished_reason="{r}"')
            for r in ("stop", "length", "abort", "timeout", "error")
        )
        assert total == PAIRS * (COPIES + 1)
        assert metric(text, "minibatch:request_success_total", 'finished_reason="error"') == 0
