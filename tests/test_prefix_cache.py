"""Automatic prefix caching: the engine's use of the block manager's cache, its metrics and its admin reset.

Model-free tests use FakeEngine (tokens depend only on the prompt and n, so they check the bookkeeping:
what is shared, computed, deferred, cached after preemption, evicted). The model gates (``-m model``) check
that greedy output with caching on equals caching off equals HF ``generate`` for every kind of sharing.
"""

from __future__ import annotations

import asyncio

import pytest
from test_kv_pool import letters

from core.sequence import Sequence
from engine import FakeEngine
from scheduler import Scheduler

from conftest import assert_error, bounded, pool_mb, run, serving


def seq(prompt, max_new=4, **kw) -> Sequence:
    return Sequence(prompt_token_ids=list(prompt), max_new_tokens=max_new, **kw)


def submit_all(engine, groups, gap: float = 0.0) -> list[Sequence]:
    """Run each group of sequences through a Scheduler: a group is submitted at once, after the previous group
    finished (``gap`` 0) or ``gap`` seconds after it was submitted."""

    async def main():
        sched = Scheduler(engine, max_queue_depth=1000)
        sched.start()
        futures = []
        for group in groups:
            mine = [sched.submit(s) for s in group]
            futures += mine
            if gap:
                await asyncio.sleep(gap)
            else:
                await asyncio.wait_for(asyncio.gather(*mine), 300)
        await asyncio.wait_for(asyncio.gather(*futures), 300)
        await sched.stop()

    run(main())
    return [s for group in groups for s in group]


def full_again(engine) -> bool:
    engine.blocks.check()
    return engine.blocks.is_all_free() and engine.num_active() == 0


# --- engine bookkeeping (FakeEngine) ------------------------------------------------------------------


def test_a_repeated_prompt_computes_only_its_last_block():
    eng = FakeEngine(capacity=4, num_blocks=20, block_size=4)
    prompt = range(1, 15)  # 14 tokens: 3 full blocks + 2
    first, again = seq(prompt), seq(prompt)
    submit_all(eng, [[first], [again]])
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 12
    assert eng.planner.prefill_tokens_computed == 14 + 2
    assert again.output_token_ids == first.output_token_ids == letters(prompt, 4)
    assert eng.stats()["prefix_cache_queries"] == 28 and eng.stats()["prefix_cache_hits"] == 12
    assert full_again(eng) and eng.blocks.num_cached_blocks == 4  # the prompt's 3 blocks + 1 output block


def test_caching_off_computes_everything():
    eng = FakeEngine(capacity=4, num_blocks=20, block_size=4, prefix_caching=False)
    prompt = range(1, 15)
    a, b = seq(prompt), seq(prompt)
    submit_all(eng, [[a], [b]])
    assert eng.planner.prefill_tokens_computed == 28 and b.num_cached_tokens == 0 and eng.blocks.num_cached_blocks == 0
    assert a.output_token_ids == b.output_token_ids == letters(prompt, 4) and full_again(eng)


@pytest.mark.parametrize("budget", [0, 5])
def test_identical_prompts_in_one_step_prefill_their_prefix_once(budget):
    """Queued together: the first computes the prompt, the others wait for its blocks and compute only the
    last partial block (chunked or not)."""
    eng = FakeEngine(capacity=8, num_blocks=40, block_size=4, max_num_batched_tokens=budget)
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks + 2
    copies = [seq(prompt) for _ in range(4)]
    submit_all(eng, [copies])
    assert [s.num_cached_tokens for s in copies] == [0, 16, 16, 16]
    assert eng.planner.prefill_tokens_computed == 18 + 3 * 2
    assert all(s.output_token_ids == letters(prompt, 4) for s in copies) and full_again(eng)


def test_a_shared_system_prompt_is_computed_once_per_burst():
    """The shape of chat traffic: 12 requests at once, one 40-token preamble and their own tails, 4 slots."""
    eng = FakeEngine(capacity=4, num_blocks=80, block_size=4, max_num_batched_tokens=64)
    system = list(range(100, 140))
    seqs = [seq(system + [1 + i, 2 + i, 3 + i], max_new=3) for i in range(12)]
    submit_all(eng, [seqs])
    assert seqs[0].num_cached_tokens == 0 and all(s.num_cached_tokens == 40 for s in seqs[1:])
    assert eng.planner.prefill_tokens_computed == 40 + 12 * 3
    assert all(s.output_token_ids == letters(s.prompt_token_ids, 3) for s in seqs) and full_again(eng)


def test_a_waiter_does_not_wait_for_an_owner_that_is_aborted_mid_prefill():
    eng = FakeEngine(capacity=4, num_blocks=40, block_size=4, max_num_batched_tokens=4)
    owner, waiter = seq(range(1, 41), max_new=2), seq([*range(1, 33), 99], max_new=3)
    eng.admit([owner])  # 4 of 40 tokens computed: block 0 cached, blocks 1.. still to come
    assert eng.blocks.num_cached_blocks == 1 and eng.can_admit([]) and not eng.can_admit([waiter])
    eng.abort(owner.seq_id)
    assert eng.can_admit([waiter])
    eng.admit([waiter])
    while eng.num_active():
        eng.step()
    assert waiter.num_cached_tokens == 4 and waiter.output_token_ids == letters(waiter.prompt_token_ids, 3)
    assert full_again(eng)


def test_prefix_waiting_is_policy_not_a_refusal():
    """An engine asked to admit both at once (no scheduler) computes both: correct, just not shared."""
    eng = FakeEngine(capacity=4, num_blocks=40, block_size=4)
    a, b = seq(range(1, 20)), seq(range(1, 20))
    assert eng.can_admit([a]) and not eng.can_admit([a, b])
    eng.admit([a, b])
    assert eng.planner.prefill_tokens_computed == 38 and a.num_cached_tokens == b.num_cached_tokens == 0
    while eng.num_active():
        eng.step()
    assert full_again(eng)


def test_a_preempted_sequence_recomputes_mostly_from_the_cache():
    """Preemption frees the victim's blocks but leaves its full ones cached: readmitted, it finds them."""
    eng = FakeEngine(capacity=4, num_blocks=8, block_size=4)
    old, new = seq(range(1, 9), max_new=14), seq(range(50, 63), max_new=6)  # 2 blocks + 1 growing; 4 blocks
    submit_all(eng, [[old, new]], gap=0.01)
    assert eng.planner.num_preemptions >= 1
    assert old.output_token_ids == letters(old.prompt_token_ids, 14)
    assert new.output_token_ids == letters(new.prompt_token_ids, 6)
    recomputed = eng.stats()["prefix_cache_hits"]
    assert recomputed >= 8, recomputed  # the readmitted victim found at least 2 of its blocks
    assert full_again(eng)


def test_admission_counts_only_the_blocks_a_newcomer_takes():
    """A pool that holds one copy of a long prompt plus small tails admits the second copy while the first
    runs: it needs only its tail's blocks."""
    eng = FakeEngine(capacity=4, num_blocks=8, block_size=4)
    prompt = list(range(1, 21))  # 5 blocks
    first, second = seq(prompt, max_new=8), seq([*prompt, 7], max_new=4)  # total 7 blocks without sharing
    eng.admit([first])
    assert eng.can_admit([second])  # 5 shared + 1 of its own + first's growth
    assert FakeEngine(capacity=4, num_blocks=8, block_size=4, prefix_caching=False).can_admit([first, second]) is False
    eng.admit_and_step([second])
    assert second.num_cached_tokens == 20
    while eng.num_active():
        eng.step()
    assert first.output_token_ids == letters(prompt, 8)
    assert second.output_token_ids == letters(second.prompt_token_ids, 4)
    assert full_again(eng)


def test_eviction_under_pressure_only_takes_free_cached_blocks():
    eng = FakeEngine(capacity=2, num_blocks=6, block_size=4)
    prompts = [[i * 10 + j for j in range(1, 10)] for i in range(1, 6)]  # 9 tokens each, distinct
    seqs = [seq(p, max_new=3) for p in prompts]
    submit_all(eng, [[s] for s in seqs])
    assert eng.blocks.evictions > 0
    again = seq(prompts[-1], max_new=3)  # the most recent prompt is still cached
    old = seq(prompts[0], max_new=3)  # the oldest was evicted
    submit_all(eng, [[again], [old]])
    assert again.num_cached_tokens == 8 and old.num_cached_tokens == 0
    assert all(s.output_token_ids == letters(s.prompt_token_ids, 3) for s in [*seqs, again, old])
    assert full_again(eng)


def test_prompt_logprobs_skip_the_cache_but_fill_it():
    eng = FakeEngine(capacity=4, num_blocks=20, block_size=4)
    prompt = range(1, 11)
    scored, plain, scored_again = seq(prompt, prompt_logprobs_k=1), seq(prompt), seq(prompt, prompt_logprobs_k=0)
    submit_all(eng, [[scored], [plain], [scored_again]])
    assert [s.num_cached_tokens for s in (scored, plain, scored_again)] == [0, 8, 0]
    assert len(scored_again.prompt_logprobs) == 10 and full_again(eng)


# --- HTTP: usage, metrics, admin reset ----------------------------------------------------------------


def test_usage_reports_cached_tokens_and_metrics_count_queries_and_hits():
    async def body():
        async with serving(FakeEngine(capacity=4, block_size=4)) as c:
            req = {"prompt": "a prompt of some thirty-odd bytes.", "max_tokens": 2}  # 34 byte tokens
            first = (await c.post("/v1/completions", json=req)).json()["usage"]
            second = (await c.post("/v1/completions", json=req)).json()["usage"]
            assert first["prompt_tokens_details"] == {"cached_tokens": 0}
            assert second["prompt_tokens_details"] == {"cached_tokens": 32}
            chat = {"messages": [{"role": "user", "content": "hello there, how are you?"}], "max_tokens": 2}
            await c.post("/v1/chat/completions", json=chat)
            again = (await c.post("/v1/chat/completions", json=chat)).json()["usage"]
            assert again["prompt_tokens_details"]["cached_tokens"] > 0
            text = (await c.get("/metrics")).text
            samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
            assert float(samples["minibatch:prefix_cache_hits_total"]) >= 32
            assert float(samples["minibatch:prefix_cache_queries_total"]) >= 68
            assert float(samples["minibatch:kv_cache_cached_blocks"]) > 0
            assert float(samples["minibatch:kv_cache_usage_perc"]) == 0.0  # cached but free blocks are free

    bounded(body)


def test_admin_reset_drops_the_cache_behind_the_api_key():
    async def body():
        engine = FakeEngine(capacity=4, block_size=4)
        async with serving(engine, api_key="sekrit") as c:
            auth = {"Authorization": "Bearer sekrit"}
            req = {"prompt": "x" * 40, "max_tokens": 2}
            await c.post("/v1/completions", json=req, headers=auth)
            assert engine.blocks.num_cached_blocks == 10
            assert_error(await c.post("/admin/reset_prefix_cache"), 401)
            r = await c.post("/admin/reset_prefix_cache", headers=auth)
            assert r.status_code == 200 and r.json() == {"status": "ok", "dropped_blocks": 10, "cached_blocks": 0}
            again = (await c.post("/v1/completions", json=req, headers=auth)).json()["usage"]
            assert again["prompt_tokens_details"] == {"cached_tokens": 0}
            assert engine.blocks.is_all_free()

    bounded(body)


# --- model gates: caching on == caching off == HF generate -------------------------------------------


def hf_engine(model_dir: str, blocks: int = 64, **config):
    from config import Config
    from models.runtime import HFEngine

    config = {"max_batch_size": 4, "num_threads": 2, "kv_block_size": 4, "kv_cache_dtype": "fp32", **config}
    return HFEngine(Config(model_id=model_dir, kv_cache_mb=pool_mb(model_dir, blocks, 4), **config))


def assert_parity(reference, engine, seqs) -> None:
    from conftest import expected

    stops = set(engine.stop_token_ids)
    for s in seqs:
        assert s.output_token_ids == expected(reference, s, stops), (s.seq_id, s.num_cached_tokens)


@pytest.mark.model
@pytest.mark.parametrize("caching, budget", [(False, 0), (True, 0), (True, 5)], ids=["off", "on", "on-chunked"])
def test_greedy_parity_for_every_kind_of_sharing(pressure_model, caching, budget):
    """Block size 4. A 24-token prompt runs first; then prompts that share 0 tokens, a partial block, exactly 2
    blocks, 3 blocks, all of it (its last block is recomputed for the logits) and all but 2 tokens arrive
    together; then 3 identical new prompts in one step (the later two wait for the first's blocks)."""
    from conftest import PROMPTS, Reference

    reference = Reference(pressure_model)
    engine = hf_engine(pressure_model, prefix_caching=caching, max_num_batched_tokens=budget)
    base = reference.encode(" ".join(PROMPTS))[:24]
    tail = reference.encode(" zebra quilt xylophone")[:5]
    other = reference.encode(PROMPTS[4])[:18]
    first = [seq(base, 8)]
    shared = [seq(p, 8) for p in ([*tail, *tail], [*base[:2], *tail], [*base[:8], *tail], [*base[:12], *tail])]
    shared += [seq(base, 8), seq(base[:22], 8)]
    same_step = [seq(other, 8) for _ in range(3)]
    submit_all(engine, [first, shared, same_step])
    assert_parity(reference, engine, first + shared + same_step)
    cached = [s.num_cached_tokens for s in first + shared + same_step]
    if caching:
        assert cached == [0, 0, 0, 8, 12, 20, 20, 0, 16, 16], cached
        prompts = sum(s.prompt_len for s in first + shared + same_step)
        assert engine.planner.prefill_tokens_computed == prompts - sum(cached)
    else:
        assert not any(cached) and engine.blocks.num_cached_blocks == 0
    assert full_again(engine)


@pytest.mark.model
def test_greedy_parity_when_the_owner_of_a_shared_prefix_leaves_mid_flight(pressure_model):
    """The owner of a prefix is aborted mid-prefill (the waiter computes what was not cached yet), and aborted
    mid-decode while another sequence shares its blocks (they stay, held by the sharer)."""
    from conftest import PROMPTS, Reference

    reference = Reference(pressure_model)
    engine = hf_engine(pressure_model, max_num_batched_tokens=4)
    prompt = (reference.encode(" ".join(PROMPTS)) * 2)[:40]
    owner, waiter = seq(prompt, 6), seq([*prompt[:32], *reference.encode(" again")], 8)
    engine.admit([owner])  # 4 tokens computed
    assert not engine.can_admit([waiter])
    engine.abort(owner.seq_id)
    engine.admit([waiter])
    for _ in range(10):  # the waiter's prompt fully in, a few tokens decoded
        engine.step()
    sharer = seq([*waiter.prompt_token_ids[:28], *reference.encode(" third")], 8)
    engine.admit_and_step([sharer])
    assert sharer.num_cached_tokens == 28 and waiter.num_cached_tokens == 4
    engine.abort(waiter.seq_id)  # the sharer holds its blocks now
    while engine.num_active():
        engine.step()
    assert_parity(reference, engine, [sharer])
    assert full_again(engine)


@pytest.mark.model
def test_greedy_parity_with_preemption_and_eviction_under_pressure(pressure_model):
    """10 sequences over 3 shared prefixes in a pool of 16 blocks of 4 tokens, 4 running: sequences are preempted
    (their full blocks stay cached, so recompute mostly hits) and free cached blocks are evicted; every output
    equals HF generate."""
    import random

    from conftest import PROMPTS, Reference

    reference = Reference(pressure_model)
    engine = hf_engine(pressure_model, blocks=16)
    rng = random.Random(7)
    stems = [reference.encode(p + " and then")[:12] for p in PROMPTS[:3]]
    # EOS ignored: the pressure asserted below must not hinge on where this CPU's greedy output meets EOS
    seqs = [
        seq(rng.choice(stems) + reference.encode(f" {i}")[:2], rng.choice([10, 16, 20]), ignore_eos=True)
        for i in range(10)
    ]
    submit_all(engine, [seqs])
    assert_parity(reference, engine, seqs)
    preemptions = engine.planner.num_preemptions
    assert preemptions >= 1 and engine.blocks.evictions >= 1, (preemptions, engine.blocks)
    assert engine.blocks.hit_tokens > 0
    assert full_again(engine)
