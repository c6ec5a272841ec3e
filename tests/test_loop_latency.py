"""The event loop stays free while a hostile client sends oversized prompts (issue 11, item 4).

A real ``python server.py`` serves the tiny GPT-2. One client streams greedy tokens and records the
gap between consecutive events; two others meanwhile send prompts the server must refuse (text that
tokenizes far past the context window, chat messages that render to it, and token-id lists far
longer than the window). Refusing them must not stall the stream: tokenizing and template rendering
run off the event loop, and the cheap limits (characters, number of ids) come before any tokenizer call.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import httpx
import pytest

from scripts.reliability_attacks import health_while_scoring

from conftest import run
from live import ProcessServer

pytestmark = pytest.mark.model

# Bound on the worst gap between two stream events while the hostile clients run. Unloaded, a gap is
# a few ms; with tokenizing on the loop the hostile clients pushed it to 3.3 s (p50 0.43 s). Off the
# loop the worst seen was 0.18-0.26 s (the bodies are still parsed on the loop). Generous: the machine is shared.
WORST_GAP_S = 1.0
HOSTILE_SECONDS = 6.0


def hostile_payloads(rng: random.Random) -> list[tuple[str, dict]]:
    words = [f"w{rng.randrange(10**6)}" for _ in range(2000)]
    text = " ".join(rng.choice(words) for _ in range(14_000))[:99_000]  # under MAX_PROMPT_CHARS, ~30k tokens
    return [
        ("/generate", {"prompt": text, "max_new_tokens": 4}),
        ("/v1/completions", {"prompt": text, "max_tokens": 4}),
        ("/v1/completions", {"prompt": [rng.randrange(900) for _ in range(120_000)], "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 4}),
    ]


async def hostile(url: str, stop: asyncio.Event, counts: dict[int, int], seed: int) -> None:
    payloads = hostile_payloads(random.Random(seed))
    bodies = [(path, json.dumps(p).encode()) for path, p in payloads]
    async with httpx.AsyncClient(timeout=30) as c:
        i = 0
        while not stop.is_set() and i < 400:
            path, body = bodies[i % len(bodies)]
            r = await c.post(f"{url}{path}", content=body, headers={"Content-Type": "application/json"})
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
            i += 1


async def stream_gaps(url: str, seconds: float) -> list[float]:
    gaps: list[float] = []
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=30) as c:
        n = 0
        while time.monotonic() < deadline and n < 50:
            payload = {"prompt": f"stream {n}", "max_new_tokens": 200, "ignore_eos": True, "stream": True}
            last = None
            async with c.stream("POST", f"{url}/generate", json=payload) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    if now > deadline:  # bounded even when every gap is long
                        break
            n += 1
    return gaps


def test_a_stream_stays_smooth_while_another_client_sends_oversized_prompts(tiny_model_dir):
    env = {
        "MODEL_ID": tiny_model_dir,
        "MAX_NEW_TOKENS_LIMIT": "512",
        "MAX_BODY_BYTES": str(4 << 20),
        "LOG_LEVEL": "WARNING",
        "CHAT_TEMPLATE": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    with ProcessServer(env, ready_timeout=120) as srv:

        async def scenario():
            quiet = await stream_gaps(srv.url, 1.0)
            stop = asyncio.Event()
            counts: dict[int, int] = {}
            attackers = [asyncio.create_task(hostile(srv.url, stop, counts, seed)) for seed in (1, 2)]
            await asyncio.sleep(0.3)  # the hostile traffic is under way
            try:
                loud = await stream_gaps(srv.url, HOSTILE_SECONDS)
            finally:
                stop.set()
                await asyncio.gather(*attackers)
            return quiet, loud, counts

        quiet, loud, counts = run(scenario())
    print(
        f"\nstream gaps quiet: p50 {statistics.median(quiet) * 1e3:.1f} ms, max {max(quiet) * 1e3:.1f} ms; "
        f"under hostile prompts: p50 {statistics.median(loud) * 1e3:.1f} ms, "
        f"p99 {sorted(loud)[int(len(loud) * 0.99)] * 1e3:.1f} ms, max {max(loud) * 1e3:.1f} ms "
        f"({len(loud)} gaps; hostile answers {counts})"
    )
    assert counts and set(counts) == {422}, counts
    assert sum(counts.values()) >= 8, counts
    assert max(loud) < WORST_GAP_S, max(loud)


HEALTH_BOUND_S = 0.25


def test_health_answers_within_250ms_while_two_10mb_logprob_answers_are_built(tiny_model_dir):
    """Decoding the tokens and alternatives of a logprobs answer and encoding it run off the event loop (the JSON in
    one bounded piece per choice, each token's text decoded once per server, startup's heap left out of garbage
    collections): /health's worst latency stays under 250 ms while two ~10 MB answers are built (before: 4,125 ms on
    the issue's run, everything on the loop)."""
    env = {"MODEL_ID": tiny_model_dir, "LOG_LEVEL": "WARNING", "MAX_LOGPROBS": "20"}
    with ProcessServer(env, ready_timeout=120) as srv:
        latencies, answers = health_while_scoring(srv.url, timeout=120)  # the attack of scripts/reliability_attacks.py
    sizes = [len(r.content) for r in answers]
    print(
        f"\n/health while two logprob answers ({sizes} bytes) were built: max {max(latencies) * 1e3:.0f} ms, "
        f"p50 {statistics.median(latencies) * 1e3:.1f} ms over {len(latencies)} probes"
    )
    for r in answers:
        assert r.status_code == 200, r.text[:300]
        choices = r.json()["choices"]
        assert len(choices) == 256 and all(len(c["logprobs"]["tokens"]) == 90 for c in choices)
        # 20 alternatives each (fewer where two decode to the same text: the format's keys are texts)
        tops = [len(top) for c in choices for top in c["logprobs"]["top_logprobs"][1:]]
        assert max(tops) == 20 and sum(tops) > 0.6 * 20 * len(tops), statistics.mean(tops)
    assert min(sizes) > 9_000_000, sizes
    assert max(latencies) <= HEALTH_BOUND_S, f"/health took {max(latencies) * 1e3:.0f} ms"
