"""Scheduler over FakeEngine: capacity, FCFS, churn without loss, backpressure, failure isolation, identity and
metrics (aborts, shutdown and their regressions: test_scheduler_aborts.py).

Every test body runs under ``asyncio.wait_for`` so a stuck loop fails instead of hanging. Engines
that must hold still block on a ``threading.Event`` (the "gate") in their worker thread; every such
test opens the gate in a ``finally`` so no thread is left behind.
"""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from core.sequence import Sequence, SequenceStatus
from engine import FakeEngine
from scheduler import QueueFullError

from conftest import Boom, Gate, RecordingEngine, bounded, fake_ids, wait_until
from scheduler_harness import assert_ok, gather_all, make_seq, started

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
