"""Streaming (/generate as server-sent events), cancellation when clients leave, and time limits.

Model-free tests run FakeEngine through httpx's ASGI transport, or through a real uvicorn where a
real client disconnect matters; the test that closes streams mid-generation serves the tiny GPT-2
checkpoint (marked ``model``). Every wait is bounded; nothing asserts on durations.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from config import Config
from engine import FakeEngine
from server import create_app

from conftest import (
    RUNTIMES,
    assert_error_body,
    assert_pool_full,
    assert_runtime,
    bounded,
    runtime_knobs,
    serving,
    wait_until,
)
from live import ThreadServer, poll_until

TIMEOUT = 30.0  # seconds any HTTP call may take
HUGE = 100_000  # a budget no test waits for: such requests end by cancellation or a time limit
APP_CONFIG = {"max_new_tokens_limit": HUGE, "log_level": "WARNING"}
# Seconds added to every engine step where a test needs streams that cannot finish by themselves while it reads:
# a tiny model steps in well under a millisecond, so 900 tokens would otherwise end before a slow test closes them.
STEP_PACE_S = 0.004


class SpyEngine(FakeEngine):
    """FakeEngine that remembers every sequence it prefilled (in admission order)."""

    def __init__(self, **kw) -> None:
        kw.setdefault("max_context", 1_000_000)
        super().__init__(**kw)
        self.admitted = []

    def _prefill(self, seqs, first_row):
        self.admitted.extend(seqs)
        return super()._prefill(seqs, first_row)

    def admitted_ids(self) -> list[str]:
        return [s.request_id for s in self.admitted]


def spelling(text: str):
    """token_fn: the sequence's n-th token is the n-th UTF-8 byte of ``text`` (cycled)."""
    data = text.encode("utf-8")
    return lambda seq: data[len(seq.output_token_ids) % len(data)] + 1


def parse_sse(body: str) -> list:
    """The data payloads of an SSE body: dicts, and the string "[DONE]"."""
    out = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def text_events(events: list) -> list[dict]:
    return [e for e in events if isinstance(e, dict) and "finish_reason" not in e and "error" not in e]


# --- (a) streaming /generate -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "token_fn, n",
    [
        (None, 12),  # FakeEngine's letters: one character per token
        (spelling("é😀 ab€"), 24),  # multi-byte characters split over byte tokens: text is held back
    ],
    ids=["letters", "split-utf8"],
)
def test_generate_stream_equals_non_streamed(token_fn, n):
    async def body():
        async with serving(FakeEngine(token_fn=token_fn), **APP_CONFIG) as c:
            req = {"prompt": "stream me", "max_new_tokens": n, "request_id": "s-1"}
            full = (await c.post("/generate", json=req)).json()
            r = await c.post("/generate", json={**req, "stream": True})
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = parse_sse(r.text)
            assert events[-1] == "[DONE]"
            *chunks, last = events[:-1]
            assert chunks and all(set(e) == {"request_id", "text", "token_ids"} for e in chunks)
            assert all(e["request_id"] == "s-1" for e in chunks)
            assert all("\ufffd" not in e["text"] for e in chunks), "a split character leaked as U+FFFD"
            assert "".join(e["text"] for e in chunks) + last["text"] == full["text"]
            assert sum((e["token_ids"] for e in chunks), []) + last["token_ids"] == full["token_ids"]
            assert set(last) == {"request_id", "text", "token_ids", "finish_reason", "usage", "metrics"}
            assert last["finish_reason"] == full["finish_reason"] == "length"
            assert last["usage"] == full["usage"] == {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": 9 + n}
            assert set(last["metrics"]) == {"queue_wait_ms", "ttft_ms", "generate_ms", "e2e_ms"}

    bounded(body)


def test_generate_stream_token_ids_include_the_eos():
    def token_fn(seq):
        return FakeEngine.EOS if len(seq.output_token_ids) == 3 else ord("k") + 1

    async def body():
        async with serving(FakeEngine(token_fn=token_fn), **APP_CONFIG) as c:
            req = {"prompt": "eos", "max_new_tokens": 10}
            full = (await c.post("/generate", json=req)).json()
            assert full["token_ids"] == [ord("k") + 1] * 3 + [FakeEngine.EOS] and full["finish_reason"] == "stop"
            events = parse_sse((await c.post("/generate", json={**req, "stream": True})).text)
            assert sum((e["token_ids"] for e in events if isinstance(e, dict)), []) == full["token_ids"]

    bounded(body)


STOP_TEXT = "say XYq then XYZ and more XYZ at the end"


def test_stream_never_emits_a_stop_string_even_partially():
    """A prefix of the stop string ("XY") is held back until ruled out ("XYq" goes out); the match
    ends the text right before it; the sequence stops generating and frees its slot."""

    async def body():
        eng = FakeEngine(token_fn=spelling(STOP_TEXT))
        async with serving(eng, **APP_CONFIG) as c:
            r = await c.post("/generate", json={"prompt": "p", "max_new_tokens": 200, "stop": ["XYZ"], "stream": True})
            chunks = text_events(parse_sse(r.text))
            texts = [e["text"] for e in chunks]
            assert "".join(texts) == "say XYq then "  # nothing of the match, nor after it
            assert "XYq" in texts, texts  # "X", "XY" waited (one token per step) until "q" ruled the stop out
            assert not any(t.endswith(("X", "XY")) for t in texts), texts  # a prefix of "XYZ" never went out alone
            await wait_until(lambda: eng.num_active() == 0, what="slot freed after the stop string")
            assert eng.stats()["generated_tokens"] < 200

    bounded(body)


def test_stop_string_ends_with_finish_reason_stop():
    async def body():
        async with serving(FakeEngine(token_fn=spelling(STOP_TEXT)), **APP_CONFIG) as c:
            req = {"prompt": "p", "max_new_tokens": 200, "stop": ["XYZ"]}
            r = await c.post("/generate", json=req)
            assert r.status_code == 200, r.text
            assert r.json()["text"] == "say XYq then " and r.json()["finish_reason"] == "stop"
            events = parse_sse((await c.post("/generate", json={**req, "stream": True})).text)
            assert events[-1] == "[DONE]" and events[-2]["finish_reason"] == "stop"

    bounded(body)


# --- (b) cancellation ------------------------------------------------------------------------------


class SSEStream:
    """One streamed /generate on its own connection, read event by event, closable mid-stream."""

    def __init__(self, url: str, payload: dict) -> None:
        self.client = httpx.Client(base_url=url, timeout=TIMEOUT)
        self.response = self.client.send(
            self.client.build_request("POST", "/generate", json={**payload, "stream": True}), stream=True
        )
        assert self.response.status_code == 200
        self._lines = self.response.iter_lines()
        self.events: list = []

    def next_event(self):
        for line in self._lines:
            if line.startswith("data: "):
                data = line[len("data: ") :]
                event = data if data == "[DONE]" else json.loads(data)
                self.events.append(event)
                return event
        raise AssertionError("stream ended without [DONE]")

    def read_to_end(self) -> list:
        while not self.events or self.events[-1] != "[DONE]":
            self.next_event()
        return self.events

    def close(self) -> None:
        self.response.close()
        self.client.close()


@pytest.mark.model
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_closing_half_the_streams_frees_their_slots(tiny_model_dir, runtime):
    """6 streams in 8 slots; 3 clients leave mid-generation: their sequences are aborted and their rows
    freed within a bounded wait, and the other 3 finish with exactly the tokens they produce alone (on the torch
    and the torch-free runtime)."""
    config = Config(
        model_id=tiny_model_dir,
        max_batch_size=8,
        max_new_tokens_limit=1000,
        log_level="WARNING",
        **runtime_knobs(runtime),
    )
    with ThreadServer(create_app(config)) as live:
        eng = live.state.engine
        assert_runtime(eng, runtime)
        step = eng.step

        def paced_step(*args, **kwargs):  # the dropped streams' 900 tokens must outlast the test's reading
            time.sleep(STEP_PACE_S)
            return step(*args, **kwargs)

        eng.step = paced_step
        prompts = {f"drop-{i}": f"Once upon a time {i}" for i in range(3)}
        prompts |= {f"keep-{i}": f"The capital of France is {i}" for i in range(3)}
        budget = {
            rid: (900 if rid.startswith("drop") else 128) for rid in prompts
        }  # dropped ones never end by themselves
        streams = {}
        seqs = {}  # request_id -> the engine's Sequence, seen in its rows

        def all_seen() -> bool:
            seqs.update((s.request_id, s) for s in eng.active_sequences())
            return len(seqs) == len(prompts)

        try:
            for rid, prompt in prompts.items():
                streams[rid] = SSEStream(
                    live.url, {"prompt": prompt, "max_new_tokens": budget[rid], "ignore_eos": True, "request_id": rid}
                )
            poll_until(all_seen, 10, "all six to be admitted")
            for s in streams.values():
                for _ in range(3):
                    event = s.next_event()
                    assert isinstance(event, dict) and "text" in event, event

            dropped = [rid for rid in prompts if rid.startswith("drop")]
            kept = [rid for rid in prompts if rid.startswith("keep")]
            assert not any(seqs[rid].is_finished for rid in dropped)  # mid-generation
            for rid in dropped:
                streams.pop(rid).close()

            def only_kept_rows() -> bool:
                rows = [s.request_id for s in eng.active_sequences()]
                unfinished = [rid for rid in kept if not seqs[rid].is_finished]
                return all(seqs[rid].is_finished for rid in dropped) and sorted(rows) == sorted(unfinished)

            poll_until(only_kept_rows, 10, "the dropped streams' rows to be freed")
            for rid in dropped:
                assert seqs[rid].finish_reason == "abort"
                assert len(seqs[rid].output_token_ids) < budget[rid]
            assert eng.num_active() <= len(kept)

            finished = {rid: streams.pop(rid).read_to_end() for rid in kept}
        finally:
            for s in streams.values():
                s.close()

        poll_until(lambda: eng.num_active() == 0, 10, "the kept streams to finish")
        for rid, events in finished.items():
            last = events[-2]
            assert last["finish_reason"] == "length" and last["usage"]["completion_tokens"] == budget[rid]
            text = "".join(e["text"] for e in events[:-1])
            ref = httpx.post(
                f"{live.url}/generate",
                timeout=TIMEOUT,
                json={"prompt": prompts[rid], "max_new_tokens": budget[rid], "ignore_eos": True},
            ).json()
            assert seqs[rid].output_token_ids == ref["token_ids"], rid
            assert text == ref["text"], rid
        assert eng.num_active() == 0
        assert_pool_full(eng)


def test_non_streaming_client_that_leaves_is_aborted():
    eng = SpyEngine(capacity=2, step_delay=0.002)
    with ThreadServer(create_app(Config(model_id="fake", **APP_CONFIG), eng)) as live:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{live.url}/generate",
                json={"prompt": "long", "max_new_tokens": HUGE, "request_id": "gone"},
                timeout=httpx.Timeout(TIMEOUT, read=0.5),
            )
        (seq,) = eng.admitted
        poll_until(lambda: seq.is_finished and eng.num_active() == 0, 5, "the abandoned request to be aborted")
        assert_pool_full(eng)
        assert seq.finish_reason == "abort"
        assert len(seq.output_token_ids) < HUGE
        health = httpx.get(f"{live.url}/health", timeout=TIMEOUT).json()
        assert health["running"] == 0 and health["waiting"] == 0
        r = httpx.post(f"{live.url}/generate", json={"prompt": "next", "max_new_tokens": 3}, timeout=TIMEOUT)
        assert r.status_code == 200 and len(r.json()["token_ids"]) == 3


def test_queued_request_whose_client_leaves_never_runs():
    """Capacity 1, a long request running: queued requests whose clients leave (one plain, one
    streamed) are dropped from the queue and never prefilled; the next request runs normally."""
    eng = SpyEngine(capacity=1, step_delay=0.002)
    with ThreadServer(create_app(Config(model_id="fake", **APP_CONFIG), eng)) as live:
        sched = live.state.scheduler
        long = SSEStream(live.url, {"prompt": "long", "max_new_tokens": HUGE, "request_id": "long"})
        try:
            long.next_event()
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    f"{live.url}/generate",
                    json={"prompt": "queued", "max_new_tokens": 3, "request_id": "queued"},
                    timeout=httpx.Timeout(TIMEOUT, read=0.3),
                )
            queued_stream = SSEStream(
                live.url, {"prompt": "queued too", "max_new_tokens": 3, "request_id": "queued-stream"}
            )
            poll_until(lambda: len(sched.waiting) == 1, 5, "the streamed request to queue")
            queued_stream.close()
            poll_until(lambda: len(sched.waiting) == 0, 5, "the queue to drop both requests")
            assert eng.num_active() == 1 and eng.admitted_ids() == ["long"]
        finally:
            long.close()
        poll_until(lambda: eng.num_active() == 0 and not sched.running, 5, "the long request to be aborted")
        assert_pool_full(eng)
        r = httpx.post(
            f"{live.url}/generate",
            json={"prompt": "after", "max_new_tokens": 2, "request_id": "after"},
            timeout=TIMEOUT,
        )
        assert r.status_code == 200
        assert eng.admitted_ids() == ["long", "after"]


# --- (c) time limits -------------------------------------------------------------------------------


def test_queue_time_limit_is_504_and_the_request_never_runs():
    async def body():
        eng = SpyEngine(capacity=1, step_delay=0.002)
        async with serving(eng, max_queue_time_s=0.2, **APP_CONFIG) as c:
            long = asyncio.create_task(
                c.post("/generate", json={"prompt": "long", "max_new_tokens": HUGE, "request_id": "long"})
            )
            await wait_until(lambda: eng.num_active() == 1, what="the long request to run")
            r, o = await asyncio.gather(
                c.post("/generate", json={"prompt": "late", "max_new_tokens": 2, "request_id": "late"}),
                c.post("/v1/completions", json={"model": "fake", "prompt": "late too", "max_tokens": 2}),
            )
            for resp in (r, o):
                assert resp.status_code == 504, resp.text
                err = assert_error_body(resp.json(), 504, "timed out", "waiting in the queue")
                assert err["type"] == "timeout"
            assert eng.admitted_ids() == ["long"]
            assert not long.done(), "the running request has no queue limit to hit"
            long.cancel()
            with pytest.raises(asyncio.CancelledError):
                await long
            await wait_until(lambda: eng.num_active() == 0, what="the slot to be released")
            assert_pool_full(eng)
            ok = await c.post("/generate", json={"prompt": "fresh", "max_new_tokens": 2})
            assert ok.status_code == 200

    bounded(body)


def test_request_time_limit_is_504_and_releases_the_slot():
    """REQUEST_TIMEOUT_S ends a running request at a step boundary: 504 on /generate and on
    /v1/completions, an error event on a stream; the slot is free again."""

    async def body():
        eng = SpyEngine(capacity=2, step_delay=0.002)
        async with serving(eng, request_timeout_s=0.2, **APP_CONFIG) as c:
            r = await c.post("/generate", json={"prompt": "slow", "max_new_tokens": HUGE})
            assert r.status_code == 504, r.text
            err = assert_error_body(r.json(), 504, "timed out", "request time limit")
            assert err["type"] == "timeout"
            (seq,) = eng.admitted
            assert seq.finish_reason == "timeout" and len(seq.output_token_ids) < HUGE
            await wait_until(lambda: eng.num_active() == 0, what="the slot to be released")

            o = await c.post("/v1/completions", json={"model": "fake", "prompt": "slow", "max_tokens": HUGE})
            assert o.status_code == 504, o.text
            assert_error_body(o.json(), 504, "request time limit")
            events = parse_sse(
                (await c.post("/generate", json={"prompt": "slow", "max_new_tokens": HUGE, "stream": True})).text
            )
            assert events[-1] == "[DONE]"  # after an error too, as on /v1
            assert_error_body(events[-2], 504, "request time limit")
            await wait_until(lambda: eng.num_active() == 0, what="the slot to be released")
            assert_pool_full(eng)
            ok = await c.post("/generate", json={"prompt": "quick", "max_new_tokens": 2})
            assert ok.status_code == 200

    bounded(body)
