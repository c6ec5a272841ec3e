"""The continuous batcher: decides who runs, between engine steps, on the event loop.

Each iteration, on the loop: apply pending aborts and time limits, then ask the planner
(``engine.planner``, ``core/planner.py``) for the step, once: it reserves every running sequence's next
slot (preempting while KV blocks are missing), gives a slot to a client or request owed its fair share
(preempting one sequence of the most-served one), admits waiting sequences in the queue's order
(``core/fair_queue.py``: fair between clients and requests, or FCFS) while they fit (slots, KV blocks
for what they do not find in the prefix cache, a watermark; the queue never skips its next) and picks
the step's prompt chunks. The plan (``core.step.BatchPlan``) runs in the engine's single
worker thread (``engine.execute``: newcomers' prompts ride in the decode step's forward, so the weights
stream once), never on the event loop, so HTTP keeps flowing while the model computes; its output is
applied back on the loop (``planner.update_from_output``), where sequences take their tokens and change
status. Every submitted sequence's future resolves exactly once, with the sequence itself, the moment it
finishes (its status says why: stop, length, abort or error).

Preemption: the plan names the sequences it preempted (for KV blocks the most recently admitted first to go,
vLLM's rule; for fair share, the most-served client's or request's newest);
they go back to the front of the queue with their tokens and are readmitted (recomputed) before anything
newer. Their futures and listeners stay as they are: a stream sees no gap and no repeat, only a pause.

Failure isolation: a failing step that admits nobody fails the active set, resets the engine, and the
loop goes on serving the queue; one that only admits fails only its newcomers. A failing step that does
both commits nothing, so the scheduler runs the two apart to apply those rules. The failed sequences'
error is a stable sentence ("engine step failed"); the exception itself goes to the log (its text can
hold internals no client should see). A hook or listener that raises is logged and ignored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from core.fair_queue import FairQueue, QueueFullError
from core.sequence import Sequence, SequenceStatus
from core.step import AdmissionError, BatchPlan, StepOutput
from engine import InferenceEngine

__all__ = ["EngineCall", "QueueFullError", "Scheduler", "engine_thread"]

log = logging.getLogger("minibatch.scheduler")


@dataclass
class EngineCall:
    """One successful engine call, as the ``on_engine_call`` hook sees it."""

    seconds: float  # wall time of the call
    prefilled: list[Sequence] = field(default_factory=list)  # newcomers that got their first token
    decoded: list[Sequence] = field(default_factory=list)  # running sequences that got one more token (or several)
    tokens: int | None = None  # tokens the call generated (a row verifying drafts may emit several, a stop string may
    # cut some of them afterwards); None: unknown

    @property
    def phase(self) -> str:
        """ "prefill", "decode", or "mixed" (both in one call)."""
        if self.prefilled and self.decoded:
            return "mixed"
        return "prefill" if self.prefilled else "decode"


def engine_thread() -> ThreadPoolExecutor:
    """The one thread that makes every call into an engine, from building it to its last step.

    Why one thread for all of it: libgomp keeps a pool of OpenMP workers per thread that starts parallel
    work, and its workers spin between parallel regions only while the process's pooled workers fit its
    cores. An engine built on one thread and stepped on another leaves two pools (4 threads on a 2-core
    box), so every worker sleeps after each region and a decode step pays a futex wake-up for each of its
    ~120 regions (measured: SmolLM2 batch-1 step 9.5 ms on one thread, 19-20 ms built on another).
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


class Scheduler:
    def __init__(
        self,
        engine: InferenceEngine,
        max_queue_depth: int,
        stop_wait_s: float = 10.0,
        executor: ThreadPoolExecutor | None = None,
        waiting: FairQueue | None = None,
    ) -> None:
        """``stop_wait_s``: how long ``stop()`` waits for an engine call in flight. ``executor``: the
        ``engine_thread()`` that built ``engine``, which stays its caller's to shut down (by default the
        scheduler makes one of its own, and shuts it down in ``stop``). ``waiting``: the queue and its admission
        policy (``core/fair_queue.py``; by default fair, with no per-client limit)."""
        self.engine = engine
        self.planner = engine.planner  # the books: read and written on the loop only
        self.max_queue_depth = max_queue_depth
        self.stop_wait_s = stop_wait_s
        self.waiting = waiting if waiting is not None else FairQueue()
        self.running: dict[int, Sequence] = {}  # seq_id -> sequence holding an engine slot
        # Hooks; one that raises is logged and never stops the loop.
        # on_tokens(seqs) after each engine call that gave seqs a token each (benchmarks);
        # on_engine_call(EngineCall) after each successful admit/step/admit_and_step;
        # on_resolved(seq) exactly once per submitted sequence, as its future resolves.
        self.on_tokens: Callable[[list[Sequence]], None] | None = None
        self.on_engine_call: Callable[[EngineCall], None] | None = None
        self.on_resolved: Callable[[Sequence], None] | None = None
        # Every submitted, unresolved sequence (waiting, being admitted, or running) and its future.
        self._pending: dict[int, tuple[Sequence, asyncio.Future[Sequence]]] = {}
        # Per-sequence callbacks after each admit/step that gave it tokens (streaming, stop strings).
        self._listeners: dict[int, Callable[[Sequence], None]] = {}
        self._heard: dict[int, int] = {}  # seq_id -> output tokens its listener has been told of
        # Running sequences to end at the next step boundary: seq_id -> (status, error).
        self._aborts: dict[int, tuple[SequenceStatus, str | None]] = {}
        self._executor = executor or engine_thread()
        self._owns_executor = executor is None
        self._engine_call: Future | None = None  # the call in the worker thread now, if any
        self._in_flight: BatchPlan | None = None  # the plan it executes, until its output is applied
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.failed_admits = 0  # sequences failed by admit errors
        self.failed_steps = 0  # step calls that raised
        self.num_preemptions = 0  # sequences sent back to the queue by the planner (KV cache full, or fair share)

    # --- public API (event loop only) ----------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="scheduler")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def num_unfinished(self) -> int:
        """Submitted sequences not yet resolved (waiting, being admitted, or running)."""
        return len(self._pending)

    def unfinished(self) -> list[Sequence]:
        """The submitted sequences not yet resolved (waiting, being admitted, or running)."""
        return [seq for seq, _ in self._pending.values()]

    def submit(self, seq: Sequence, listener: Callable[[Sequence], None] | None = None) -> asyncio.Future[Sequence]:
        """Queue a sequence; the future resolves with it once finished. Raises QueueFullError.

        ``listener(seq)`` runs on the event loop after every admit/step that gave ``seq`` tokens.
        """
        if len(self.waiting) >= self.max_queue_depth:
            raise QueueFullError(f"queue is full ({self.max_queue_depth} waiting)")
        self.waiting.append(seq)  # raises QueueFullError past the client's share of the queue
        future: asyncio.Future[Sequence] = asyncio.get_running_loop().create_future()
        self._pending[seq.seq_id] = (seq, future)
        if listener is not None:
            self._listeners[seq.seq_id] = listener
        self._wakeup.set()
        return future

    def abort(self, seq_id: int) -> None:
        """Cancel a sequence: dropped from the queue now, or freed at the next step boundary."""
        self.finish(seq_id, SequenceStatus.FINISHED_ABORTED)

    def finish(self, seq_id: int, status: SequenceStatus, error: str | None = None) -> None:
        """End a sequence early with ``status`` (abort, a matched stop string, a timeout)."""
        seq = self.waiting.remove(seq_id)
        if seq is not None:
            seq.finish(status, error=error)
            self._resolve(seq)
            return
        if seq_id in self._pending and seq_id not in self._aborts:  # running, or being admitted now
            self._aborts[seq_id] = (status, error)
            self._wakeup.set()

    def stop_string_matched(self, seq: Sequence) -> None:
        """A stop string matched in ``seq``'s text (``core/generation.py``): it ends as stopped, at the next step
        boundary if it still runs; one whose last token brought the match, and so ended by length, ends as
        stopped instead."""
        if not seq.is_finished:
            self.finish(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
        elif seq.status is SequenceStatus.FINISHED_LENGTH:
            seq.status = SequenceStatus.FINISHED_STOPPED

    async def call_engine(self, fn, *args):
        """``fn(*args)`` in the engine's worker thread, between two engine calls (never during one): for
        operations on the engine's tensor state from outside the loop."""
        return await asyncio.wrap_future(self._executor.submit(fn, *args))

    async def stop(self) -> None:
        """Stop the loop; everything still queued or running finishes as aborted. An engine call in
        flight is waited for first (up to ``stop_wait_s``), so that no token lands on a sequence
        already resolved."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        call = self._engine_call
        if call is not None and not call.done():
            done, _ = await asyncio.wait({asyncio.wrap_future(call)}, timeout=self.stop_wait_s)
            if not done:
                log.warning(
                    "engine call still running %.1fs after stop; resolving its sequences anyway", self.stop_wait_s
                )
        plan = self._in_flight
        if plan is not None and call is not None and call.done() and not call.cancelled() and not call.exception():
            self.planner.update_from_output(plan, call.result())  # the step in flight counts
        for seq, _ in list(self._pending.values()):  # waiting, mid-admission or running
            seq.finish(SequenceStatus.FINISHED_ABORTED, error="server is shutting down")
            self._resolve(seq)
        self.waiting.clear()
        self.running.clear()
        if self._owns_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # --- the loop ------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            if not self.waiting and not self.running and not self._aborts:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                self._expire(time.perf_counter())
                await self._apply_aborts()
                plan = self.planner.schedule(self.waiting)
                self._dequeue(plan)
                if plan.is_empty:
                    if self.waiting and not self.running and not plan.preempted:
                        self._refuse_head()  # an empty engine cannot take it: it would wait forever
                    continue
                await self._step(plan)
                if plan.newcomers and not plan.decode and self.running:
                    await self._apart([], decode=True)  # an admission alone: the batch it made steps at once
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not strand requests: fail the active set, go on
                log.exception("scheduler iteration failed; failing %d running sequences", len(self.running))
                await self._fail_running("internal scheduler error")

    def _expire(self, now: float) -> None:
        """End what is past its time limits: waiting ones now, running ones at this boundary."""
        for seq in [s for s in self.waiting if _overdue(s, now, waiting=True)]:
            self.finish(seq.seq_id, SequenceStatus.FINISHED_TIMEOUT, _timeout_message(seq, now))
        for seq in self.running.values():
            if _overdue(seq, now, waiting=False):
                self.finish(seq.seq_id, SequenceStatus.FINISHED_TIMEOUT, _timeout_message(seq, now))

    def _dequeue(self, plan: BatchPlan) -> None:
        """A new plan's newcomers leave the queue; the sequences it preempted leave ``running`` for its front."""
        for seq in plan.newcomers:
            self.waiting.remove(seq.seq_id)
        if plan.preempted:
            for seq in plan.preempted:
                self.running.pop(seq.seq_id, None)
            self.waiting.extendleft(plan.preempted)
            self.num_preemptions += len(plan.preempted)

    @property
    def fair_preemptions(self) -> int:
        """Of ``num_preemptions``, those the planner made for another client's or request's fair share."""
        return self.planner.num_fair_preemptions

    def _refuse_head(self) -> None:
        """The next waiting sequence does not fit even in an idle engine (callers that skipped
        ``check_admissible``): it ends with the engine's reason instead of blocking the queue."""
        seq = self.waiting.remove(next(self.waiting.admission_order(())).seq_id)
        reason = self.engine.check_admissible(seq) or "does not fit in the KV cache"
        self.failed_admits += 1
        log.error("sequence %d can never be admitted: %s", seq.seq_id, reason)
        seq.finish(SequenceStatus.FINISHED_ERROR, error=reason)
        self._resolve(seq)

    async def _call_engine(self, fn, *args):
        self._engine_call = self._executor.submit(fn, *args)
        return await asyncio.wrap_future(self._engine_call)

    async def _step(self, plan: BatchPlan) -> None:
        """Execute ``plan`` in the worker thread and apply its output here. A failure commits nothing; when the
        plan both admitted and decoded, admission and step run again apart, so that an admission failure fails
        only the newcomers and a step failure only the batch."""
        batch = list(self.running.values())
        before = sum(len(s.output_token_ids) for s in batch) + sum(len(s.output_token_ids) for s in plan.newcomers)
        start = time.perf_counter()
        self._in_flight = plan
        try:
            output: StepOutput = await self._call_engine(self.engine.execute, plan)
        except Exception as exc:
            self._in_flight = None
            self.planner.abandon(plan)
            if plan.newcomers and plan.decode:
                log.warning("a step that admits failed (%s); running admission and step apart", exc)
                await self._apart(plan.newcomers, decode=False)
                if self.running:
                    await self._apart([], decode=True)
                return
            await self._failed(plan, exc)
            return
        self._in_flight = None
        result = self.planner.update_from_output(plan, output)
        after = sum(len(s.output_token_ids) for s in batch) + sum(len(s.output_token_ids) for s in plan.newcomers)
        call = EngineCall(time.perf_counter() - start, prefilled=plan.newcomers, decoded=batch, tokens=after - before)
        self._hook(self.on_engine_call, call)
        self._deliver_tokens(batch + plan.newcomers, result.finished)

    async def _apart(self, newcomers: list[Sequence], decode: bool) -> None:
        """One step of just these newcomers (``decode`` False) or just the running batch (True)."""
        try:
            plan = self.planner.plan(newcomers, decode)
        except AdmissionError as exc:
            await self._failed(BatchPlan(newcomers=newcomers), exc)
            return
        self._dequeue(BatchPlan(preempted=plan.preempted))
        if plan.is_empty:
            return
        await self._step(plan)

    async def _failed(self, plan: BatchPlan, exc: Exception) -> None:
        """A step failed: its newcomers fail when it admitted (the running batch was not in it), else the batch."""
        if plan.newcomers:
            self.failed_admits += len(plan.newcomers)
            log.error(
                "admit failed for %d sequences (%s; %d admit failures so far): %s",
                len(plan.newcomers),
                _ids(plan.newcomers),
                self.failed_admits,
                exc,
                exc_info=True,
            )
            for seq in plan.newcomers:
                seq.finish(SequenceStatus.FINISHED_ERROR, error="admission failed")
                self._resolve(seq)
            return
        self.failed_steps += 1
        log.error(
            "engine step failed with %d active sequences (%s; %d step failures so far): %s",
            len(self.running),
            _ids(self.running.values()),
            self.failed_steps,
            exc,
            exc_info=True,
        )
        await self._fail_running("engine step failed")

    def _deliver_tokens(self, seqs: list[Sequence], finished: list[Sequence]) -> None:
        """After a step that ran ``seqs``: the unfinished hold slots, those that got a token (not a sequence
        still prefilling its prompt in chunks) are heard, the finished resolve."""
        for seq in seqs:
            if not seq.is_finished:
                self.running[seq.seq_id] = seq
        fresh = [s for s in seqs if len(s.output_token_ids) > self._heard.get(s.seq_id, 0)]
        for seq in fresh:
            self._heard[seq.seq_id] = len(seq.output_token_ids)
        self._notify(fresh)
        for seq in finished:
            self.running.pop(seq.seq_id, None)
            self._resolve(seq)

    def _notify(self, seqs: list[Sequence]) -> None:
        self._hook(self.on_tokens, seqs)
        for seq in seqs:
            listener = self._listeners.get(seq.seq_id)
            if listener is not None:
                try:
                    listener(seq)
                except Exception:  # a listener's bug must not take the batch down
                    log.exception("listener of sequence %d failed", seq.seq_id)

    async def _apply_aborts(self) -> None:
        """At a step boundary: running sequences that were ended meanwhile leave the books (``engine.abort``)."""
        aborts, self._aborts = self._aborts, {}
        for seq_id, (status, error) in aborts.items():
            seq = self.running.get(seq_id)
            if seq is None:  # finished meanwhile, or preempted back into the queue
                self.finish(seq_id, status, error)
                continue
            # The scheduler says why it ends (abort, stop string, timeout); the books only free the
            # slot, and their own "aborted" mark does not override a status already set.
            seq.finish(status, error=error)
            try:
                self.engine.abort(seq_id)
            except Exception as exc:  # the books are suspect: treat like a failed step
                log.error("engine abort of sequence %d failed: %s", seq_id, exc, exc_info=True)
                await self._fail_running("engine abort failed")
                return
            del self.running[seq_id]
            self._resolve(seq)

    async def _fail_running(self, error: str) -> None:
        """Every admitted sequence fails with ``error``; the books start afresh, and the engine's tensor state
        is dropped in its thread."""
        for seq in self.running.values():
            seq.finish(SequenceStatus.FINISHED_ERROR, error=error)
            self._resolve(seq)
        self.running.clear()
        try:
            self.planner.reset()
            await self._call_engine(self.engine.reset_state)
        except Exception:
            log.exception("engine reset failed")

    def _resolve(self, seq: Sequence) -> None:
        self._listeners.pop(seq.seq_id, None)
        self._heard.pop(seq.seq_id, None)
        _, future = self._pending.pop(seq.seq_id, (None, None))
        if future is not None:
            self._hook(self.on_resolved, seq)
        if future is not None and not future.done():
            future.set_result(seq)

    @staticmethod
    def _hook(fn, *args) -> None:
        if fn is not None:
            try:
                fn(*args)
            except Exception:
                log.exception("scheduler hook %r failed", fn)


def _ids(seqs) -> str:
    """The request ids of ``seqs`` for a log line (the client's labels, not the internal seq_ids)."""
    return "request_ids=" + ",".join(s.request_id or f"#{s.seq_id}" for s in seqs)


def _overdue(seq: Sequence, now: float, waiting: bool) -> bool:
    if seq.deadline is not None and now > seq.deadline:
        return True
    # The queue limit is for getting started: a preempted sequence waiting again was admitted once.
    return waiting and seq.admit_time is None and seq.queue_deadline is not None and now > seq.queue_deadline


def _timeout_message(seq: Sequence, now: float) -> str:
    waited = now - seq.arrival_time
    if seq.status is SequenceStatus.WAITING:
        return f"timed out after {waited:.1f}s waiting in the queue"
    return f"timed out after {waited:.1f}s (request time limit)"
