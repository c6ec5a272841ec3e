"""The continuous batcher: decides who runs, between engine steps, on the event loop.

Each iteration: apply pending aborts, admit waiting sequences FCFS into free capacity,
then run one ``engine.step()``. Engine calls run in a single worker thread, never on
the event loop, so HTTP keeps flowing while the model computes. Every submitted
sequence's future resolves exactly once, with the sequence itself, the moment it
finishes (its status says why: stop, length, abort or error).

Failure isolation: a failing ``admit`` fails only its newcomers; a failing ``step``
fails the active set, resets the engine, and the loop goes on serving the queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from engine import InferenceEngine
from sequence import Sequence, SequenceStatus

log = logging.getLogger("minibatch.scheduler")


class QueueFullError(Exception):
    """The waiting queue is at MAX_QUEUE_DEPTH."""


class Scheduler:
    def __init__(self, engine: InferenceEngine, max_queue_depth: int) -> None:
        self.engine = engine
        self.max_queue_depth = max_queue_depth
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # seq_id -> sequence holding an engine slot
        self.on_tokens: Callable[[list[Sequence]], None] | None = None  # after each step, for streaming
        # Every submitted, unresolved sequence (waiting, being admitted, or running) and its future.
        self._pending: dict[int, tuple[Sequence, asyncio.Future[Sequence]]] = {}
        self._aborts: set[int] = set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.failed_admits = 0  # sequences failed by admit errors
        self.failed_steps = 0  # step calls that raised

    # --- public API (event loop only) ----------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="scheduler")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def submit(self, seq: Sequence) -> asyncio.Future[Sequence]:
        """Queue a sequence; the future resolves with it once finished. Raises QueueFullError."""
        if len(self.waiting) >= self.max_queue_depth:
            raise QueueFullError(f"queue is full ({self.max_queue_depth} waiting)")
        future: asyncio.Future[Sequence] = asyncio.get_running_loop().create_future()
        self._pending[seq.seq_id] = (seq, future)
        self.waiting.append(seq)
        self._wakeup.set()
        return future

    def abort(self, seq_id: int) -> None:
        """Cancel a sequence: dropped from the queue now, or freed at the next step boundary."""
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                seq.finish(SequenceStatus.FINISHED_ABORTED)
                self._resolve(seq)
                return
        if seq_id in self._pending:  # running, or being admitted right now
            self._aborts.add(seq_id)
            self._wakeup.set()

    async def stop(self) -> None:
        """Stop the loop; everything still queued or running finishes as aborted."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for seq, _ in list(self._pending.values()):  # waiting, mid-admission or running
            seq.finish(SequenceStatus.FINISHED_ABORTED, error="server is shutting down")
            self._resolve(seq)
        self.waiting.clear()
        self.running.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- the loop ------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            if not self.waiting and not self.running and not self._aborts:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                await self._apply_aborts()
                newcomers = self._schedule()
                if newcomers:
                    await self._admit(newcomers)
                if self.running:
                    await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not strand requests: fail the active set, go on
                log.exception("scheduler iteration failed; failing %d running sequences", len(self.running))
                await self._fail_running("internal scheduler error")

    def _schedule(self) -> list[Sequence]:
        """FCFS: take the oldest waiting sequences that fit in the free slots."""
        free = self.engine.capacity - len(self.running)
        return [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]

    async def _call_engine(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _admit(self, newcomers: list[Sequence]) -> None:
        try:
            await self._call_engine(self.engine.admit, newcomers)
        except Exception as exc:
            self.failed_admits += len(newcomers)
            log.error(
                "admit failed for %d sequences (%d admit failures so far): %s",
                len(newcomers), self.failed_admits, exc, exc_info=True,
            )
            for seq in newcomers:
                seq.finish(SequenceStatus.FINISHED_ERROR, error=f"admission failed: {exc}")
                self._resolve(seq)
            return
        for seq in newcomers:
            if seq.is_finished:  # finished on its first token: never held a slot
                self._resolve(seq)
            else:
                self.running[seq.seq_id] = seq
        if self.on_tokens:
            self.on_tokens(newcomers)

    async def _step(self) -> None:
        try:
            finished = await self._call_engine(self.engine.step)
        except Exception as exc:
            self.failed_steps += 1
            log.error(
                "engine step failed with %d active sequences (%d step failures so far): %s",
                len(self.running), self.failed_steps, exc, exc_info=True,
            )
            await self._fail_running(f"engine step failed: {exc}")
            return
        if self.on_tokens:
            self.on_tokens(list(self.running.values()))
        for seq in finished:
            self.running.pop(seq.seq_id, None)
            self._resolve(seq)

    async def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, set()
        for seq_id in aborts:
            seq = self.running.get(seq_id)
            if seq is None:  # finished meanwhile
                continue
            try:
                await self._call_engine(self.engine.abort, seq_id)
            except Exception as exc:  # engine state is suspect: treat like a failed step
                log.error("engine abort of sequence %d failed: %s", seq_id, exc, exc_info=True)
                await self._fail_running(f"engine abort failed: {exc}")
                return
            del self.running[seq_id]
            seq.finish(SequenceStatus.FINISHED_ABORTED)
            self._resolve(seq)

    async def _fail_running(self, error: str) -> None:
        for seq in self.running.values():
            seq.finish(SequenceStatus.FINISHED_ERROR, error=error)
            self._resolve(seq)
        self.running.clear()
        try:
            await self._call_engine(self.engine.reset)
        except Exception:
            log.exception("engine reset failed")

    def _resolve(self, seq: Sequence) -> None:
        _, future = self._pending.pop(seq.seq_id, (None, None))
        if future is not None and not future.done():
            future.set_result(seq)
