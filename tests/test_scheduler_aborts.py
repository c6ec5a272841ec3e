"""Scheduler over FakeEngine: aborts (waiting, running, unknown), shutdown with an engine call in flight or stuck,
and the regressions around admission in flight, queue expiry and a failing engine abort.

Every test body runs under ``asyncio.wait_for`` (``bounded``) so a stuck loop fails instead of hanging; every gated
engine's gate is opened in a ``finally``.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from core.fair_queue import FairQueue
from core.sequence import Sequence, SequenceStatus
from engine import FakeEngine
from scheduler import Scheduler

from conftest import Boom, Gate, RecordingEngine, bounded, fake_ids, wait_until
from scheduler_harness import assert_ok, gather_all, make_seq, started

# --- aborts, shutdown -----------------------------------------------------------------------------


def test_abort_waiting_sequence():
    async def body():
        gate = Gate()
        eng = FakeEngine(capacity=1, step_fault=gate.wait)
        sched = await started(eng)
        try:
            a, b, c = make_seq("a", 3), make_seq("b", 3), make_seq("c", 2)
            fa, fb, fc = sched.submit(a), sched.submit(b), sched.submit(c)
            await wait_until(lambda: a.seq_id in sched.running)
            sched.abort(b.seq_id)
            assert fb.done() and fb.result() is b
            assert b.status is SequenceStatus.FINISHED_ABORTED and b.output_token_ids == []
            assert b not in sched.waiting
            gate.open.set()
            await gather_all([fa, fc])
            assert_ok(a, "a")
            assert_ok(c, "c")
        finally:
            gate.open.set()
            await sched.stop()

    bounded(body)


def test_abort_running_sequence_frees_its_slot():
    async def body():
        eng = RecordingEngine(capacity=1, step_delay=0.002, max_context=1_000_000)
        sched = await started(eng)
        long = make_seq("long", 100_000)
        fl = sched.submit(long)
        nxt = make_seq("next", 3)
        fn = sched.submit(nxt)
        await wait_until(lambda: len(long.output_token_ids) >= 3, what="long generating")
        sched.abort(long.seq_id)
        assert (await gather_all([fl])) == [long]
        assert long.status is SequenceStatus.FINISHED_ABORTED
        assert long.finish_reason == "abort"
        assert 3 <= len(long.output_token_ids) < 100_000
        assert long.output_token_ids == fake_ids("long", len(long.output_token_ids))
        await gather_all([fn])
        assert_ok(nxt, "next")
        await sched.stop()
        assert eng.num_active() == 0
        assert max(eng.active_log) == 1

    bounded(body)


def test_abort_unknown_or_finished_is_harmless():
    async def body():
        eng = FakeEngine(capacity=1)
        sched = await started(eng)
        s = make_seq("s", 2)
        await gather_all([sched.submit(s)])
        sched.abort(s.seq_id)
        sched.abort(-1)
        t = make_seq("t", 2)
        await gather_all([sched.submit(t)])
        await sched.stop()
        assert_ok(s, "s")
        assert_ok(t, "t")

    bounded(body)


def test_stop_waits_for_the_engine_call_in_flight_then_resolves_everything_as_aborted():
    """No token may land on a sequence after it resolved: stop() waits for the step in flight."""

    async def body():
        gate = Gate()
        eng = FakeEngine(capacity=2, step_fault=gate.wait)
        sched = await started(eng)
        try:
            seqs = [make_seq(f"s{i}", 5) for i in range(5)]
            futs = [sched.submit(s) for s in seqs]
            await wait_until(lambda: gate.entered.is_set() and len(sched.running) == 2)
            stopping = asyncio.ensure_future(sched.stop())
            await asyncio.sleep(0.2)
            assert not stopping.done() and not any(f.done() for f in futs)  # the step is still running
            gate.open.set()
            await asyncio.wait_for(stopping, 5)
            tokens = [list(s.output_token_ids) for s in seqs]
            assert all(f.done() for f in futs)
            for f, s in zip(futs, seqs):
                assert f.result() is s
                assert s.status is SequenceStatus.FINISHED_ABORTED
                assert s.error == "server is shutting down"
            assert [len(t) for t in tokens] == [2, 2, 0, 0, 0]  # the step in flight counted, nothing after
            await asyncio.sleep(0.1)
            assert [list(s.output_token_ids) for s in seqs] == tokens
            assert not sched.alive
            assert not sched.waiting and not sched.running
        finally:
            gate.open.set()

    bounded(body)


def test_stop_gives_up_on_a_stuck_engine_call_after_stop_wait_s():
    async def body():
        gate = Gate()
        eng = FakeEngine(capacity=2, step_fault=gate.wait)
        sched = Scheduler(eng, max_queue_depth=10, stop_wait_s=0.3)
        sched.start()
        try:
            seqs = [make_seq(f"s{i}", 5) for i in range(3)]
            futs = [sched.submit(s) for s in seqs]
            await wait_until(lambda: gate.entered.is_set() and len(sched.running) == 2)
            await asyncio.wait_for(sched.stop(), 5)
            assert all(f.done() and f.result().status is SequenceStatus.FINISHED_ABORTED for f in futs)
        finally:
            gate.open.set()

    bounded(body)


def test_stop_when_idle_and_twice():
    async def body():
        sched = await started(FakeEngine())
        await asyncio.sleep(0)
        assert sched.alive
        await sched.stop()
        assert not sched.alive
        await sched.stop()

    bounded(body)


def test_on_tokens_sees_every_token():
    async def body():
        eng = FakeEngine(capacity=3, step_delay=0.001)
        sched = await started(eng)
        seen: dict[int, list[int]] = {}

        def on_tokens(seqs):
            for s in seqs:
                seen.setdefault(s.seq_id, []).append(len(s.output_token_ids))

        sched.on_tokens = on_tokens
        seqs = [make_seq(f"o{i}", 2 + i) for i in range(3)]
        await gather_all([sched.submit(s) for s in seqs])
        await sched.stop()
        for s in seqs:
            assert seen[s.seq_id] == list(range(1, s.max_new_tokens + 1))

    bounded(body)


# --- regressions: admission in flight, failing engine abort ---------------------------------------


def test_stop_during_admit_resolves_newcomers():
    async def body():
        gate = Gate()
        eng = FakeEngine(capacity=2, admit_fault=gate.wait)
        sched = await started(eng)
        try:
            seqs = [make_seq(f"s{i}", 5) for i in range(3)]
            futs = [sched.submit(s) for s in seqs]
            await wait_until(gate.entered.is_set, what="admit in flight")
            stopping = asyncio.ensure_future(sched.stop())
            await asyncio.sleep(0.1)
            gate.open.set()
            await asyncio.wait_for(stopping, 5)
            pending = [s.request_id or s.seq_id for f, s in zip(futs, seqs) if not f.done()]
            assert pending == [], f"futures never resolved after stop(): {pending}"
            assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in seqs)
        finally:
            gate.open.set()

    bounded(body)


class CountingSequence(Sequence):
    """Counts reads of seq_id across all instances: how much scanning ending a sequence costs."""

    reads = 0

    def __getattribute__(self, name):
        if name == "seq_id":
            CountingSequence.reads += 1
        return super().__getattribute__(name)


def test_expiring_a_full_queue_is_linear():
    """finish() and the expiry pass use the queue's index: expiring every other one of n queued
    sequences touches each a few times (a scan from the front per removal reads ~n * n / 4 seq_ids)."""
    n = 2_000
    sched = Scheduler(FakeEngine(capacity=1), max_queue_depth=n)
    seqs = [
        CountingSequence(prompt_token_ids=[1], max_new_tokens=2, queue_deadline=0.0 if i % 2 else None)
        for i in range(n)
    ]
    for s in seqs:
        sched.waiting.append(s)
    CountingSequence.reads = 0
    sched._expire(time.perf_counter())
    assert len(sched.waiting) == n // 2
    assert all(
        s.status is (SequenceStatus.FINISHED_TIMEOUT if i % 2 else SequenceStatus.WAITING) for i, s in enumerate(seqs)
    )
    assert CountingSequence.reads <= 10 * n, CountingSequence.reads


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_waiting_queue_is_fifo_and_indexed(policy):
    """Sequences that are each their own request come out first come, first served under either policy."""
    q = FairQueue(policy)
    seqs = [make_seq(f"w{i}") for i in range(5)]
    for s in seqs:
        q.append(s)
    assert q.remove(seqs[2].seq_id) is seqs[2] and q.remove(seqs[2].seq_id) is None
    assert seqs[2] not in q and seqs[3] in q and len(q) == 4
    assert list(q.admission_order([])) == [seqs[0], seqs[1], seqs[3], seqs[4]]
    assert [q.remove(s.seq_id) for s in seqs[:2]] == seqs[:2]
    assert list(q) == [seqs[3], seqs[4]]


def test_abort_during_admit_is_not_lost():
    async def body():
        gate = Gate()
        eng = FakeEngine(capacity=1, admit_fault=gate.wait, step_delay=0.001, max_context=100_000)
        sched = await started(eng)
        try:
            s = make_seq("victim", 300)
            fut = sched.submit(s)
            await wait_until(gate.entered.is_set, what="admit in flight")
            sched.abort(s.seq_id)  # e.g. the HTTP client disconnected during prefill
            gate.open.set()
            await asyncio.wait_for(asyncio.shield(fut), 10)
            assert s.status is SequenceStatus.FINISHED_ABORTED, (s.status, len(s.output_token_ids))
        finally:
            gate.open.set()
            await sched.stop()

    bounded(body)


def test_failing_engine_abort_still_resolves_the_sequence():
    class AbortFails(FakeEngine):
        def abort(self, seq_id):
            raise Boom("abort exploded")

    async def body():
        eng = AbortFails(capacity=2, step_delay=0.002, max_context=100_000)
        sched = await started(eng)
        s = make_seq("victim", 10_000)
        fut = sched.submit(s)
        await wait_until(lambda: s.seq_id in sched.running)
        sched.abort(s.seq_id)
        try:
            await asyncio.wait_for(asyncio.shield(fut), 2)
        except asyncio.TimeoutError:
            raise AssertionError(
                f"future never resolved; status {s.status}, in _futures: {s.seq_id in sched._pending}"
            ) from None
        finally:
            await sched.stop()
        assert s.is_finished

    bounded(body)
