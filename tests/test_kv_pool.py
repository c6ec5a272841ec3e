"""KV memory as a block pool: admission by memory, preemption with recompute, never-fit refusals, metrics.

Model-free tests use FakeEngine, whose n-th token depends only on its prompt and n: a sequence that is
preempted and recomputed must still produce exactly ``letters(prompt, n)``, nothing lost, nothing
repeated. The model gates (``-m model``) check greedy parity with HF ``generate`` under a pool so
small that sequences are preempted and recomputed several times.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from core.sequence import Sequence, SequenceStatus
from engine import AdmissionError, FakeEngine
from scheduler import Scheduler

from conftest import assert_error, assert_pool_full, bounded, fake_ids, pool_mb, run, serving


def letters(prompt, n):
    probe = Sequence(prompt_token_ids=list(prompt), max_new_tokens=n)
    out = []
    for _ in range(n):
        out.append(FakeEngine.letter_token(probe))
        probe.output_token_ids.append(out[-1])
    return out


def seq(prompt=(5, 6, 7, 8), max_new=10) -> Sequence:
    return Sequence(prompt_token_ids=list(prompt), max_new_tokens=max_new)


# --- engine: admission by memory and preemption -----------------------------------------------------


def test_admission_counts_blocks_not_just_slots():
    eng = FakeEngine(capacity=8, num_blocks=4, block_size=4)
    a, b, c = seq(prompt=range(1, 9), max_new=4), seq(prompt=range(1, 5), max_new=4), seq(prompt=(1,), max_new=4)
    assert eng.can_admit([a, b, c]) and not eng.can_admit([a, b, c, seq(prompt=(1,))])  # 2 + 1 + 1 (+ 1) blocks
    eng.admit([a, b])  # a: 8 tokens = 2 blocks, b: 1 block
    # Next step a (9 tokens) needs a third block and b (5) a second: no room for c.
    assert not eng.can_admit([c])
    with pytest.raises(AdmissionError, match="KV blocks"):
        eng.admit([c])
    assert c.status is SequenceStatus.WAITING and c.seq_id not in eng.blocks
    eng.blocks.check()


def test_preemption_frees_the_newest_and_recompute_continues_exactly():
    eng = FakeEngine(capacity=4, num_blocks=3, block_size=4)
    old, new = seq(prompt=(1, 2, 3), max_new=9), seq(prompt=(4, 5, 6), max_new=9)
    eng.admit([old])
    eng.admit([new])  # each holds 1 block; 1 free
    preempted = []
    while eng.num_active():
        preempted += eng.run_step().preempted
        eng.blocks.check()
        if preempted and eng.can_admit(preempted[:1]):
            eng.admit([preempted.pop(0)])
    assert eng.planner.num_preemptions >= 1 and not preempted
    for s in (old, new):
        assert s.output_token_ids == letters(s.prompt_token_ids, 9) and s.finish_reason == "length"
    assert_pool_full(eng)


def test_preempted_sequence_is_waiting_with_its_tokens_and_holds_nothing():
    eng = FakeEngine(capacity=4, num_blocks=3, block_size=2)
    first, second = seq(prompt=(1, 2), max_new=4), seq(prompt=(3, 4), max_new=2)
    eng.admit([first, second])  # each fed its prompt: 1 block each, 1 free
    # both (3 tokens now) need a second block: first, the oldest, takes it; second makes way
    gone = eng.run_step().preempted
    assert gone == [second]  # the most recently admitted goes first
    assert second.status is SequenceStatus.WAITING and len(second.output_token_ids) == 1
    assert second.seq_id not in eng.blocks and eng.active_sequences() == [first]
    eng.blocks.check()


def test_a_lone_sequence_that_cannot_grow_preempts_itself_only_if_something_else_holds_memory():
    """The never-fit check guarantees a sequence alone always fits: it is never preempted when alone."""
    eng = FakeEngine(capacity=2, num_blocks=3, block_size=4)
    s = seq(prompt=(1, 2, 3), max_new=9)  # 12 tokens = 3 blocks: fits alone exactly
    eng.admit([s])
    while eng.num_active():
        eng.step()
    assert eng.planner.num_preemptions == 0 and s.output_token_ids == letters((1, 2, 3), 9)
    assert_pool_full(eng)


def test_never_fit_is_refused_naming_the_numbers():
    eng = FakeEngine(capacity=2, max_context=1024, num_blocks=3, block_size=4)
    reason = eng.check_admissible(seq(prompt=(1,) * 10, max_new=3))  # 13 tokens -> 4 blocks > 3
    assert "prompt (10 tokens) + max_new_tokens (3) needs 4 KV blocks of 4 tokens" in reason
    assert "holds 3 blocks (12 tokens" in reason
    assert eng.check_admissible(seq(prompt=(1,) * 10, max_new=2)) is None


def test_reset_and_abort_return_every_block():
    eng = FakeEngine(capacity=4, num_blocks=8, block_size=2)
    seqs = [seq(prompt=(i + 1,) * 3, max_new=9) for i in range(3)]
    eng.admit(seqs)
    eng.step()
    assert eng.abort(seqs[1].seq_id)
    eng.blocks.check()
    eng.reset()
    assert_pool_full(eng)


# --- scheduler: queue order, streams, aborts ---------------------------------------------------------


def drive_scheduler(eng: FakeEngine, seqs: list[Sequence], abort_ids=(), stagger: int = 0):
    """Submit every sequence (with a listener recording its output length at each call), run to the end."""
    seen: dict[int, list[int]] = {s.seq_id: [] for s in seqs}

    async def main():
        sched = Scheduler(eng, max_queue_depth=10_000)
        sched.start()
        futures = []
        for i, s in enumerate(seqs):
            futures.append(sched.submit(s, lambda x: seen[x.seq_id].append(len(x.output_token_ids))))
            if stagger and i % stagger == 0:
                await asyncio.sleep(0)
        for seq_id in abort_ids:
            await asyncio.sleep(0.001)
            sched.abort(seq_id)
        done = await asyncio.wait_for(asyncio.gather(*futures), 30)
        await sched.stop()
        return sched, done

    sched, done = run(main())
    return sched, done, seen


def test_scheduler_requeues_preempted_first_and_every_stream_is_gapless():
    rng = random.Random(3)
    eng = FakeEngine(capacity=6, max_context=256, num_blocks=10, block_size=4)
    seqs = [
        seq(prompt=[rng.randint(1, 200) for _ in range(rng.randint(1, 12))], max_new=rng.randint(1, 24))
        for _ in range(40)
    ]
    sched, done, seen = drive_scheduler(eng, seqs, stagger=3)
    assert [d.seq_id for d in done] == [s.seq_id for s in seqs]
    for s in seqs:
        assert s.output_token_ids == letters(s.prompt_token_ids, s.max_new_tokens)
        assert seen[s.seq_id] == list(range(1, s.max_new_tokens + 1))  # one token per call: no gap, no repeat
    assert sched.num_preemptions > 0 and sched.num_preemptions == eng.planner.num_preemptions
    assert_pool_full(eng)


def test_abort_of_a_preempted_sequence_resolves_it():
    eng = FakeEngine(capacity=4, max_context=256, num_blocks=12, block_size=2, step_delay=0.001)
    seqs = [seq(prompt=(i + 1,) * 3, max_new=20) for i in range(4)]
    sched, done, _ = drive_scheduler(eng, seqs, abort_ids=[s.seq_id for s in seqs[2:]])
    assert all(d.is_finished for d in done)
    assert all(s.finish_reason == "length" for s in seqs[:2])
    assert all(s.finish_reason in ("abort", "length") for s in seqs[2:])
    assert_pool_full(eng)


def test_a_sequence_the_idle_engine_cannot_take_fails_instead_of_blocking_the_queue():
    """Submitted directly (skipping check_admissible): it ends with the reason, the next one runs."""
    eng = FakeEngine(capacity=2, max_context=1024, num_blocks=2, block_size=2)
    big, small = seq(prompt=(1,) * 9, max_new=1), seq(prompt=(2,), max_new=2)
    _, done, _ = drive_scheduler(eng, [big, small])
    assert big.status is SequenceStatus.FINISHED_ERROR and "KV blocks" in big.error
    assert small.output_token_ids == letters((2,), 2)
    assert_pool_full(eng)


# --- chunked prefill ---------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [1, 3, 4, 5, 64])
def test_chunked_prefill_streams_keep_decoding_and_outputs_are_exact(budget):
    """Long prompts load over several steps (budget 1, block size - 1, = , + 1, more than any prompt) while
    the running sequences keep getting one token per step; nothing is lost or repeated."""
    eng = FakeEngine(capacity=4, max_context=256, num_blocks=60, block_size=4, max_num_batched_tokens=budget)
    short = [seq(prompt=(i + 1,), max_new=30) for i in range(2)]
    long_ = [seq(prompt=[(7 * i + j) % 200 + 1 for j in range(40)], max_new=5) for i in range(2)]
    sched, done, seen = drive_scheduler(eng, short + long_)
    for s in short + long_:
        assert s.output_token_ids == letters(s.prompt_token_ids, s.max_new_tokens)
        assert seen[s.seq_id] == list(range(1, s.max_new_tokens + 1))
    assert_pool_full(eng)
    assert eng.stats()["num_prefilling"] == 0


@pytest.mark.parametrize("cap", [1, 3, 7])
def test_prompt_chunks_are_capped_while_streams_decode(cap):
    """MAX_PREFILL_TOKENS_WHILE_DECODING: a step that carries decode rows carries at most ``cap`` prompt tokens;
    a step with nothing decoding uses the whole budget. Outputs stay exact."""
    eng = FakeEngine(
        capacity=4,
        max_context=256,
        num_blocks=80,
        block_size=4,
        max_num_batched_tokens=64,
        max_prefill_while_decoding=cap,
    )
    steps: list[tuple[int, int]] = []  # (decode rows, prompt tokens) per forward
    execute = eng.execute

    def recorded(plan):
        steps.append((len(plan.decode), sum(end - start for _, start, end in plan.chunks)))
        return execute(plan)

    eng.execute = recorded
    first = [seq(prompt=[(3 * j) % 200 + 1 for j in range(50)], max_new=20) for _ in range(2)]
    late = [seq(prompt=[(7 * i + j) % 200 + 1 for j in range(30)], max_new=4) for i in range(2)]
    sched, done, seen = drive_scheduler(eng, first + late, stagger=3)
    for s in first + late:
        assert s.output_token_ids == letters(s.prompt_token_ids, s.max_new_tokens)
        assert seen[s.seq_id] == list(range(1, s.max_new_tokens + 1))
    assert all(tokens <= cap for n_decode, tokens in steps if n_decode)
    assert any(n_decode and tokens == cap for n_decode, tokens in steps)  # the late prompts did load while decoding
    assert steps[0] == (0, 50)  # the first step decodes nothing: a whole 50-token prompt, past the cap
    assert_pool_full(eng)


def test_chunked_prefill_gives_the_first_token_only_after_the_last_chunk():
    eng = FakeEngine(capacity=2, max_context=64, num_blocks=16, block_size=4, max_num_batched_tokens=4)
    s = seq(prompt=range(1, 11), max_new=3)  # 10 prompt tokens: chunks 4, 4, 2
    eng.admit([s])
    assert s.output_token_ids == [] and eng.num_active() == 1 and eng.stats()["num_prefilling"] == 1
    eng.step()
    assert s.output_token_ids == []
    eng.step()
    assert s.output_token_ids == letters(range(1, 11), 1) and eng.stats()["num_prefilling"] == 0
    while eng.num_active():
        eng.step()
    assert s.output_token_ids == letters(range(1, 11), 3)
    assert_pool_full(eng)


def test_chunked_prefill_with_preemption_and_aborts_returns_every_block():
    rng = random.Random(9)
    eng = FakeEngine(
        capacity=5, max_context=128, num_blocks=14, block_size=4, max_num_batched_tokens=6, step_delay=0.0005
    )
    seqs = [
        seq(prompt=[rng.randint(1, 200) for _ in range(rng.randint(1, 30))], max_new=rng.randint(1, 20))
        for _ in range(30)
    ]
    sched, done, seen = drive_scheduler(eng, seqs, abort_ids=[seqs[3].seq_id, seqs[17].seq_id], stagger=4)
    for s in seqs:
        if s.finish_reason == "abort":
            assert s.output_token_ids == letters(s.prompt_token_ids, len(s.output_token_ids))
        else:
            assert s.output_token_ids == letters(s.prompt_token_ids, s.max_new_tokens)
            assert seen[s.seq_id] == list(range(1, s.max_new_tokens + 1))
    assert eng.planner.num_preemptions > 0
    assert_pool_full(eng)


def test_a_failed_chunked_admission_leaves_nothing_behind():
    def boom(seqs):
        raise RuntimeError("boom")

    eng = FakeEngine(
        capacity=2, max_context=64, num_blocks=8, block_size=4, max_num_batched_tokens=50, admit_fault=boom
    )
    with pytest.raises(RuntimeError):
        eng.admit([seq(prompt=range(1, 6), max_new=2)])
    assert_pool_full(eng)


# --- HTTP ---------------------------------------------------------------------------------------------


def test_http_request_that_can_never_fit_gets_a_4xx_naming_the_numbers():
    async def body():
        eng = FakeEngine(capacity=2, num_blocks=4, block_size=4)
        async with serving(eng) as c:
            r = await c.post("/generate", json={"prompt": "x" * 10, "max_new_tokens": 7})  # 17 tokens > 16
            err = assert_error(r, 422, contains="needs 5 KV blocks of 4 tokens")
            assert "holds 4 blocks" in err["message"]
            r = await c.post("/generate", json={"prompt": "x" * 10, "max_new_tokens": 6})
            assert r.status_code == 200

    bounded(body)


def test_http_many_concurrent_requests_under_preemption_each_answered_once_and_exact():
    async def body():
        eng = FakeEngine(capacity=8, num_blocks=12, block_size=4)
        async with serving(eng) as c:
            prompts = [f"p{i}-" + "y" * (i % 7) for i in range(300)]
            rs = await asyncio.gather(
                *(c.post("/generate", json={"prompt": p, "max_new_tokens": 4 + i % 9}) for i, p in enumerate(prompts))
            )
            for i, (p, r) in enumerate(zip(prompts, rs)):
                assert r.status_code == 200, r.text
                assert r.json()["token_ids"] == fake_ids(p, 4 + i % 9)
            text = (await c.get("/metrics")).text
            assert "minibatch:num_preemptions_total" in text
        assert eng.planner.num_preemptions > 0
        assert_pool_full(eng)

    bounded(body, timeout=120)


# --- model gates: greedy parity with HF generate under memory pressure ----------------------------------


@pytest.mark.model
@pytest.mark.parametrize("small_gemm", [True, False])
def test_greedy_parity_under_memory_pressure(pressure_model, small_gemm):
    """A pool of 14 blocks x 4 tokens for up to 4 running sequences of up to 48 tokens each: sequences are
    preempted and recomputed many times, mid-batch and mid-stream; every output equals HF generate."""
    from test_parity import PROMPTS, Reference, expected

    from config import Config
    from models.runtime import HFEngine

    reference = Reference(pressure_model)
    engine = HFEngine(
        Config(
            model_id=pressure_model,
            max_batch_size=4,
            num_threads=2,
            small_gemm=small_gemm,
            kv_block_size=4,
            kv_cache_mb=pool_mb(pressure_model, 14, 4),
        )
    )
    assert engine.blocks.num_blocks == 14
    rng = random.Random(5)
    seqs = []
    for i in range(10):
        prompt = reference.encode(rng.choice(PROMPTS) + f" {i}")[:30]
        # EOS ignored: the preemption count below must not hinge on where this CPU's greedy output meets EOS
        budget = min(rng.choice([6, 12, 20]), 48 - len(prompt))
        seqs.append(Sequence(prompt_token_ids=prompt, max_new_tokens=budget, ignore_eos=True))

    async def main():
        sched = Scheduler(engine, max_queue_depth=100)
        sched.start()
        # All queued at t0, so the schedule (and the preemption count) does not depend on timing; the queued
        # ones still join mid-stream, as running sequences finish or are preempted.
        futures = [sched.submit(s) for s in seqs]
        done = await asyncio.wait_for(asyncio.gather(*futures), timeout=300)
        await sched.stop()
        return sched, done

    sched, done = run(main())
    stops = set(engine.stop_token_ids)
    for s in seqs:
        assert s.output_token_ids == expected(reference, s, stops), s.seq_id
    assert engine.planner.num_preemptions >= 3, engine.planner.num_preemptions
    assert_pool_full(engine)


@pytest.mark.model
@pytest.mark.parametrize(
    "budget, small_gemm, cap", [(1, True, 0), (3, False, 0), (4, True, 0), (5, False, 0), (16, True, 0), (64, True, 3)]
)
def test_greedy_parity_with_chunked_prefill(pressure_model, budget, small_gemm, cap):
    """Prompts split at every kind of boundary (block size 4: chunks of 1, 3, 4, 5 and 16 tokens, prompts up
    to 60 tokens, longer than the budget) while other sequences decode, in a pool of 24 blocks."""
    from test_parity import PROMPTS, Reference, expected

    from config import Config
    from models.runtime import HFEngine

    reference = Reference(pressure_model)
    engine = HFEngine(
        Config(
            model_id=pressure_model,
            max_batch_size=3,
            num_threads=2,
            small_gemm=small_gemm,
            kv_block_size=4,
            kv_cache_mb=pool_mb(pressure_model, 24, 4),
            max_num_batched_tokens=budget,
            max_prefill_tokens_while_decoding=cap,
        )
    )
    text = " ".join(PROMPTS)
    seqs = [
        Sequence(prompt_token_ids=reference.encode(PROMPTS[0]), max_new_tokens=12),
        Sequence(prompt_token_ids=reference.encode(text)[:60], max_new_tokens=8),
        Sequence(prompt_token_ids=reference.encode(PROMPTS[3]), max_new_tokens=10),
        Sequence(prompt_token_ids=reference.encode(text[40:])[:45], max_new_tokens=9),
        Sequence(prompt_token_ids=reference.encode(PROMPTS[2]), max_new_tokens=5),
    ]

    async def main():
        sched = Scheduler(engine, max_queue_depth=100)
        sched.start()
        futures = []
        for s in seqs:
            futures.append(sched.submit(s))
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*futures), timeout=300)
        await sched.stop()

    run(main())
    stops = set(engine.stop_token_ids)
    for s in seqs:
        assert s.output_token_ids == expected(reference, s, stops), s.seq_id
    assert_pool_full(engine)
