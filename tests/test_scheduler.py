"""Scheduler over FakeEngine: capacity, FCFS, churn without loss, backpressure, failure isolation, aborts.

Every test body runs under ``asyncio.wait_for`` so a stuck loop fails instead of hanging. Engines
that must hold still block on a ``threading.Event`` (the "gate") in their worker thread; every such
test opens the gate in a ``finally`` so no thread is left behind.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import pytest

from core.fair_queue import FairQueue
from core.sequence import Sequence, SequenceStatus
from engine import FakeEngine
from scheduler import QueueFullError, Scheduler

from conftest import Boom, Gate, RecordingEngine, bounded, fake_ids, wait_until

_fake = FakeEngine()


def make_seq(prompt: str = "hello", max_new: int = 4, request_id: str = "") -> Sequence:
    return Sequence(prompt_token_ids=_fake.encode(prompt), max_new_tokens=max_new, request_id=request_id)


async def gather_all(futures, timeout: float = 15.0):
    return await asyncio.wait_for(asyncio.gather(*futures), timeout)


async def started(engine, depth: int = 1024) -> Scheduler:
    sched = Scheduler(engine, max_queue_depth=depth)
    sched.start()
    return sched


def assert_ok(s: Sequence, prompt: str) -> None:
    assert s.status is SequenceStatus.FINISHED_LENGTH, (s.status, s.error)
    assert s.output_token_ids == fake_ids(prompt, s.max_new_tokens)


# --- capacity, order, eviction ---------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [1, 3, 8])
def test_capacity_never_exceeded(capacity):
    async def body():
        eng = RecordingEngine(capacity=capacity, step_delay=0.001)
        sched = await started(eng)
        rng = random.Random(capacity)
        seqs = [make_seq(f"p{i}", rng.randint(2, 6)) for i in range(40)]
        futs = [sched.submit(s) for s in seqs]
        await gather_all(futs)
        await sched.stop()
        assert max(eng.active_log) <= capacity
        assert max(eng.active_log) == capacity  # the batch was actually filled
        assert eng.stats()["peak_batch"] == capacity
        assert sched.failed_admits == 0

    bounded(body)


@pytest.mark.parametrize("capacity", [1, 2, 5])
def test_fcfs_admission_order(capacity):
    async def body():
        eng = RecordingEngine(capacity=capacity, step_delay=0.001)
        sched = await started(eng)
        rng = random.Random(7)
        seqs = []
        futs = []
        for i in range(30):  # submitted in bursts while the loop runs
            s = make_seq(f"q{i}", rng.randint(1, 5))
            seqs.append(s)
            futs.append(sched.submit(s))
            if i % 4 == 3:
                await asyncio.sleep(0.002)
        await gather_all(futs)
        await sched.stop()
        assert eng.admitted == [s.seq_id for s in seqs]

    bounded(body)


def test_eviction_frees_a_slot_for_the_next_request():
    async def body():
        eng = RecordingEngine(capacity=1, step_delay=0.001)
        sched = await started(eng)
        a, b, c = make_seq("a", 3), make_seq("b", 2), make_seq("c", 1)
        futs = [sched.submit(s) for s in (a, b, c)]
        await gather_all(futs)
        await sched.stop()
        assert eng.events == [
            ("admit", a.seq_id),
            ("finish", a.seq_id),
            ("admit", b.seq_id),
            ("finish", b.seq_id),
            ("admit", c.seq_id),
            ("finish", c.seq_id),
        ]
        assert b.admit_time >= a.finish_time and c.admit_time >= b.finish_time
        for s, p in ((a, "a"), (b, "b"), (c, "c")):
            assert_ok(s, p)

    bounded(body)


@pytest.mark.parametrize("budgets", [[5, 1, 3, 2, 4], [2, 7, 4, 9, 3, 6], [1, 2, 3], [3, 2, 1]])
def test_staggered_budgets_evict_in_budget_order(budgets):
    async def body():
        eng = RecordingEngine(capacity=len(budgets), step_delay=0.001)
        sched = await started(eng)
        seqs = [make_seq(f"s{i}", b) for i, b in enumerate(budgets)]
        done_order: list[int] = []
        futs = []
        for s in seqs:  # all submitted before the loop runs: one admission group
            f = sched.submit(s)
            f.add_done_callback(lambda f: done_order.append(f.result().max_new_tokens))
            futs.append(f)
        await gather_all(futs)
        await sched.stop()
        assert len(eng.admit_groups) == 1
        assert done_order == sorted(budgets)
        finishes = [i for kind, i in eng.events if kind == "finish"]
        assert finishes == [s.seq_id for s in sorted(seqs, key=lambda s: s.max_new_tokens)]

    bounded(body)


@pytest.mark.parametrize("capacity, n", [(4, 300), (8, 300), (1, 60)])
def test_no_loss_or_duplication_under_churn(capacity, n):
    async def body():
        eng = RecordingEngine(capacity=capacity, step_delay=0.001)
        sched = await started(eng)
        rng = random.Random(n * 31 + capacity)
        resolved: dict[int, int] = {}
        orig = sched._resolve

        def counting_resolve(seq):
            resolved[seq.seq_id] = resolved.get(seq.seq_id, 0) + 1
            orig(seq)

        sched._resolve = counting_resolve
        prompts = [f"prompt-{rng.randint(0, 40)}" for _ in range(n)]  # repeats on purpose
        seqs = [make_seq(p, rng.randint(1, 12), request_id=f"r{i % 7}") for i, p in enumerate(prompts)]
        futs = []
        for s in seqs:
            futs.append(sched.submit(s))
            if rng.random() < 0.1:
                await asyncio.sleep(rng.random() * 0.003)
        results = await gather_all(futs, timeout=60)
        await sched.stop()
        for s, p, r in zip(seqs, prompts, results):
            assert r is s
            assert_ok(s, p)
        assert resolved == {s.seq_id: 1 for s in seqs}
        assert not sched.waiting and not sched.running and not sched._pending
        assert eng.num_active() == 0
        assert max(eng.active_log) <= capacity
        assert sorted(eng.admitted) == sorted(s.seq_id for s in seqs)
        assert eng.stats()["generated_tokens"] == sum(s.max_new_tokens for s in seqs)

    bounded(body, timeout=90)


def test_first_token_finisher_resolves_without_holding_a_slot():
    async def body():
        eng = RecordingEngine(capacity=1, step_delay=0.001)
        sched = await started(eng)
        quick = [make_seq(f"x{i}", 1) for i in range(5)]
        results = await gather_all([sched.submit(s) for s in quick])
        await sched.stop()
        assert results == quick
        for i, s in enumerate(quick):
            assert_ok(s, f"x{i}")
        assert eng.step_calls == 0
        assert max(eng.active_log) == 0

    bounded(body)


# --- backpressure ------------------------------------------------------------------------------------


def test_queue_full_when_waiting_at_depth():
    async def body():
        gate = Gate()
        eng = FakeEngine(capacity=1, step_fault=gate.wait)
        sched = await started(eng, depth=2)
        try:
            first = make_seq("first", 3)
            f1 = sched.submit(first)
            await wait_until(lambda: first.seq_id in sched.running, what="first admitted")
            queued = [make_seq("w1", 2), make_seq("w2", 2)]
            fq = [sched.submit(s) for s in queued]
            assert len(sched.waiting) == 2
            extra = make_seq("extra", 2)
            with pytest.raises(QueueFullError, match="2"):
                sched.submit(extra)
            assert extra.seq_id not in sched._pending
            assert len(sched.waiting) == 2
            gate.open.set()
            results = await gather_all([f1, *fq])
            assert results == [first, *queued]
            assert_ok(first, "first")
            assert_ok(queued[0], "w1")
            # Room again once the queue drained.
            later = make_seq("later", 2)
            assert (await gather_all([sched.submit(later)])) == [later]
            assert_ok(later, "later")
            assert extra.status is SequenceStatus.WAITING  # never entered the system
        finally:
            gate.open.set()
            await sched.stop()

    bounded(body)


def test_queue_depth_does_not_count_running():
    async def body():
        gate = Gate()
        eng = FakeEngine(capacity=3, step_fault=gate.wait)
        sched = await started(eng, depth=1)
        try:
            running = [make_seq(f"r{i}", 3) for i in range(3)]
            futs = [sched.submit(running[0])]
            await wait_until(lambda: running[0].seq_id in sched.running)
            futs.append(sched.submit(running[1]))  # the running one does not count: 1 of 1 waiting
            assert len(sched.waiting) == 1
            with pytest.raises(QueueFullError):
                sched.submit(running[2])
            gate.open.set()
            await gather_all(futs)
        finally:
            gate.open.set()
            await sched.stop()

    bounded(body)


# --- failure isolation ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [{0}, {2}, {1, 3}, {5}])
def test_admit_exception_fails_only_its_newcomers(bad, caplog):
    async def body():
        def fault(seqs):
            if any(s.request_id in {f"id{i}" for i in bad} for s in seqs):
                raise Boom("prefill exploded")

        eng = FakeEngine(capacity=1, admit_fault=fault, step_delay=0.001)
        sched = await started(eng)
        seqs = [make_seq(f"p{i}", 3, request_id=f"id{i}") for i in range(6)]
        results = await gather_all([sched.submit(s) for s in seqs])
        after = make_seq("after", 2)
        await gather_all([sched.submit(after)])
        await sched.stop()
        assert results == seqs
        for i, s in enumerate(seqs):
            if i in bad:
                assert s.status is SequenceStatus.FINISHED_ERROR
                assert s.finish_reason == "error"
                assert s.error == "admission failed"  # stable: the exception's text goes to the log only
                assert s.output_token_ids == []
            else:
                assert_ok(s, f"p{i}")
        assert_ok(after, "after")
        assert sched.failed_admits == len(bad)
        assert eng.num_active() == 0
        assert eng.resets == 0  # an admit failure does not disturb the batch

    with caplog.at_level(logging.ERROR, logger="minibatch.scheduler"):
        bounded(body)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "minibatch.scheduler"]
    assert len(errors) == len(bad)
    assert all("admit failed" in r.getMessage() and "prefill exploded" in r.getMessage() and r.exc_info for r in errors)


def test_admit_exception_fails_the_whole_group_but_not_the_running_batch():
    """The newcomers join a running batch, so they first ride in a mixed admit+step call; its
    failure commits nothing, the retry apart fails only the group, the old batch finishes."""

    async def body():
        groups = []

        def fault(seqs):
            groups.append([s.request_id for s in seqs])
            if any(s.request_id.startswith("new") for s in seqs):
                raise Boom("new group cannot prefill")

        gate = Gate()
        eng = FakeEngine(capacity=4, admit_fault=fault, step_fault=gate.wait)
        sched = await started(eng)
        try:
            old = [make_seq(f"old{i}", 4) for i in range(2)]
            futs_old = [sched.submit(s) for s in old]
            await wait_until(lambda: gate.entered.is_set(), what="first step")
            new = [
                make_seq(f"new{i}", 4, request_id=f"new{i}") for i in range(2)
            ]  # admitted together at the next boundary
            futs_new = [sched.submit(s) for s in new]
            gate.open.set()
            await gather_all(futs_old + futs_new)
        finally:
            gate.open.set()
            await sched.stop()
        for i, s in enumerate(old):
            assert_ok(s, f"old{i}")
        for s in new:
            assert s.status is SequenceStatus.FINISHED_ERROR and s.error == "admission failed"
            assert s.output_token_ids == []
        assert groups[1:] == [["new0", "new1"], ["new0", "new1"]]  # the mixed call, then the retry apart
        assert sched.failed_admits == 2 and sched.failed_steps == 0 and eng.resets == 0

    bounded(body)


@pytest.mark.parametrize("fail_step", [1, 2, 4])
def test_step_exception_fails_active_set_and_loop_goes_on(fail_step, caplog):
    async def body():
        victims: set[Sequence] = set()

        def fault(step_no):
            # From step fail_step on, any decode holding long0 explodes. A newcomer joining then
            # rides in a mixed admit+step call first: it fails, commits nothing, and the retry
            # apart (admit, then step) fails with the newcomer in the active set.
            if step_no >= fail_step and any(s is first[1] for s in eng.planner.rows):
                victims.update(eng.planner.rows)  # the active set of the failing step
                raise Boom(f"decode exploded at {fail_step}+")

        eng = RecordingEngine(capacity=4, step_fault=fault)
        sched = await started(eng)
        early = make_seq("early", fail_step)  # its last token comes from step fail_step - 1
        first = [early] + [make_seq(f"long{i}", 10) for i in range(3)]
        queued = [make_seq(f"q{i}", 5) for i in range(6)]
        prompts = {
            s.seq_id: p
            for s, p in zip(first + queued, ["early", "long0", "long1", "long2"] + [f"q{i}" for i in range(6)])
        }
        futs = [sched.submit(s) for s in first + queued]
        results = await gather_all(futs)
        later = make_seq("later", 3)
        await gather_all([sched.submit(later)])
        await sched.stop()
        assert results == first + queued
        assert_ok(early, "early")
        assert early not in victims
        assert set(first[1:]) <= set(victims)
        for s in victims:
            assert s.status is SequenceStatus.FINISHED_ERROR
            assert s.error == "engine step failed"
            n = len(s.output_token_ids)
            assert 1 <= n < s.max_new_tokens
            assert s.output_token_ids == fake_ids(prompts[s.seq_id], n)  # nothing from the failed step
        for s in first[1:]:
            assert len(s.output_token_ids) == fail_step  # first token + the good steps
        for s in first + queued:
            if s not in victims:
                assert_ok(s, prompts[s.seq_id])
        assert sum(s not in victims for s in queued) >= 5
        assert_ok(later, "later")
        assert eng.resets == 1
        assert sched.failed_steps == 1
        assert eng.num_active() == 0

    with caplog.at_level(logging.ERROR, logger="minibatch.scheduler"):
        bounded(body)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "minibatch.scheduler"]
    assert len(errors) == 1
    message = errors[0].getMessage()
    assert "engine step failed" in message and f"decode exploded at {fail_step}+" in message and errors[0].exc_info


def test_repeated_step_failures_keep_the_loop_alive():
    async def body():
        def fault(step_no):
            if step_no % 2:
                raise Boom("odd step")

        eng = FakeEngine(capacity=2, step_fault=fault)
        sched = await started(eng)
        seqs = [make_seq(f"z{i}", 3) for i in range(10)]
        await gather_all([sched.submit(s) for s in seqs])
        assert sched.alive
        # Futures resolve before the engine reset that follows a failure: wait for the loop to settle.
        await wait_until(lambda: eng.resets == sched.failed_steps, what="resets to catch up")
        await sched.stop()
        assert all(s.is_finished for s in seqs)
        assert sched.failed_steps == eng.resets >= 1
        assert any(s.status is SequenceStatus.FINISHED_ERROR for s in seqs)

    bounded(body)


# --- identity, metrics ---------------------------------------------------------------------------


def test_duplicate_request_ids_do_not_cross_talk():
    async def body():
        eng = FakeEngine(capacity=4, step_delay=0.001)
        sched = await started(eng)
        a = make_seq("abc", 5, request_id="same")
        b = make_seq("xyz", 7, request_id="same")
        c = make_seq("abc", 3, request_id="same")
        fa, fb, fc = (sched.submit(s) for s in (a, b, c))
        ra, rb, rc = await gather_all([fa, fb, fc])
        await sched.stop()
        assert (ra, rb, rc) == (a, b, c)
        assert_ok(a, "abc")
        assert_ok(b, "xyz")
        assert_ok(c, "abc")
        assert a.output_token_ids != b.output_token_ids

    bounded(body)


def test_metrics_are_sane():
    async def body():
        eng = FakeEngine(capacity=2, step_delay=0.001)
        sched = await started(eng)
        seqs = [make_seq(f"m{i}", 1 + i % 5) for i in range(12)]
        await gather_all([sched.submit(s) for s in seqs])
        await sched.stop()
        for s in seqs:
            m = s.metrics_ms()
            assert set(m) == {"queue_wait_ms", "ttft_ms", "generate_ms", "e2e_ms"}
            assert all(v >= 0 for v in m.values()), m
            assert m["queue_wait_ms"] <= m["ttft_ms"] <= m["e2e_ms"], m
            assert m["generate_ms"] <= m["e2e_ms"], m
            assert s.arrival_time <= s.admit_time <= s.first_token_time <= s.finish_time

    bounded(body)


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
