"""What the scheduler tests share: sequences of the fake engine's tokens, a started Scheduler, the checks of a
finished sequence."""

from __future__ import annotations

import asyncio

from core.sequence import Sequence, SequenceStatus
from engine import FakeEngine
from scheduler import Scheduler

from conftest import fake_ids

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
