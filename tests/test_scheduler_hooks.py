"""The scheduler's observability hooks: on_resolved exactly once per sequence whatever ends it,
on_engine_call after each successful prefill/decode, and a raising hook never hurting the loop."""

from __future__ import annotations

import asyncio
import collections

from core.sequence import Sequence
from engine import FakeEngine
from scheduler import Scheduler

from conftest import run

_fake = FakeEngine()


def seq(prompt: str, n: int) -> Sequence:
    return Sequence(prompt_token_ids=_fake.encode(prompt), max_new_tokens=n, request_id=prompt)


async def until(cond, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.001)


def test_on_resolved_once_per_sequence_for_every_way_of_ending():
    async def body():
        admits = {"n": 0}

        def admit_fault(seqs):
            admits["n"] += 1
            if any(s.request_id == "admit-fails" for s in seqs):
                raise RuntimeError("admit boom")

        def step_fault(step_no):
            if step_no == 6:
                raise RuntimeError("step boom")

        eng = FakeEngine(
            capacity=2, step_delay=0.002, admit_fault=admit_fault, step_fault=step_fault, max_context=100_000
        )
        sched = Scheduler(eng, max_queue_depth=100)
        resolved = collections.Counter()
        sched.on_resolved = lambda s: resolved.update([s.seq_id])
        sched.start()
        seqs = [
            seq("one-token", 1),
            seq("normal", 4),
            seq("admit-fails", 3),
            seq("step-fails", 50),
            seq("aborted-waiting", 5),
            seq("aborted-running", 50_000),
            seq("left-at-stop", 50_000),
        ]
        futures = [sched.submit(s) for s in seqs]
        sched.abort(seqs[4].seq_id)  # still waiting
        # Aborted while running, or failed first by the step-6 fault it may share: either way it ends once.
        await until(lambda: seqs[5].seq_id in sched.running or seqs[5].is_finished)
        sched.abort(seqs[5].seq_id)
        await until(lambda: seqs[6].seq_id in sched.running)
        await sched.stop()
        assert all(f.done() for f in futures)
        assert resolved == collections.Counter({s.seq_id: 1 for s in seqs}), resolved
        reasons = {s.request_id: s.finish_reason for s in seqs}
        assert reasons["one-token"] == "length" and reasons["normal"] == "length"
        assert reasons["admit-fails"] == "error" and reasons["aborted-waiting"] == "abort"
        assert reasons["left-at-stop"] == "abort"

    run(asyncio.wait_for(body(), 30))


def test_on_engine_call_reports_prefill_and_decode_batches():
    async def body():
        sched = Scheduler(FakeEngine(capacity=3), max_queue_depth=10)
        calls = []
        sched.on_engine_call = lambda call: calls.append(
            (call.phase, len(call.prefilled), len(call.decoded), call.seconds)
        )
        sched.start()
        futures = [sched.submit(seq(f"p{i}", 3)) for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*futures), 10)
        await sched.stop()
        assert calls[0][:3] == ("prefill", 3, 0)
        assert [c[:3] for c in calls[1:]] == [("decode", 0, 3), ("decode", 0, 3)]
        assert all(c[3] >= 0 for c in calls)

    run(asyncio.wait_for(body(), 30))


def test_a_newcomer_joining_a_running_batch_rides_in_one_mixed_call():
    """capacity 2: "short" leaves after 2 tokens and "late" joins the running "long" in one call."""

    async def body():
        eng = FakeEngine(capacity=2)
        sched = Scheduler(eng, max_queue_depth=10)
        calls = []
        sched.on_engine_call = lambda call: calls.append(
            (call.phase, [s.request_id for s in call.prefilled], [s.request_id for s in call.decoded])
        )
        sched.start()
        long, short, late = seq("long", 5), seq("short", 2), seq("late", 3)
        done = await asyncio.wait_for(asyncio.gather(*(sched.submit(s) for s in (long, short, late))), 10)
        await sched.stop()
        assert [len(d.output_token_ids) for d in done] == [5, 2, 3]
        assert calls[:3] == [
            ("prefill", ["long", "short"], []),
            ("decode", [], ["long", "short"]),  # short finishes: its slot frees
            ("mixed", ["late"], ["long"]),  # late's prefill and long's decode in one engine call
        ]
        assert all(phase != "prefill" for phase, _, _ in calls[1:])
        assert len(calls) == 5 and eng.stats()["generated_tokens"] == 10

    run(asyncio.wait_for(body(), 30))


def test_a_raising_hook_is_logged_and_ignored(caplog):
    async def body():
        sched = Scheduler(FakeEngine(capacity=2), max_queue_depth=10)

        def bad(*_):
            raise ValueError("hook bug")

        sched.on_engine_call = bad
        sched.on_resolved = bad
        sched.on_tokens = bad
        sched.start()
        s = seq("fine", 4)
        done = await asyncio.wait_for(sched.submit(s), 10)
        assert done.finish_reason == "length" and len(done.output_token_ids) == 4
        assert sched.alive and sched.num_unfinished == 0
        await sched.stop()

    run(asyncio.wait_for(body(), 30))
    assert "scheduler hook" in caplog.text and "hook bug" in caplog.text
