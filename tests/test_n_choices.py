"""``n`` > 1 on /v1: n choices per prompt, forked from one prefill of the prompt.

Model-free tests (FakeEngine, greedy-like: its choices are equal) check the shape: indices, usage counted
once per prompt, streamed frames, MAX_N, and that the prompt is computed once. The fork at engine level runs on
the FakeEngine with ``check_kv`` (every slot a sequence reads holds its own token; nobody writes a block another
reads): shared and copied blocks, chunked parents, aborts and hand-over, preemption, pool accounting. The model
tests run the tiny GPT-2 and Llama: through the official ``openai`` client against a real uvicorn (seeded
choices distinct and reproducible one by one, greedy choices equal), and through the scheduler (greedy choices
equal HF ``generate``, seeded choices equal each seed alone, memory pressure, a grammar per choice, prompt
logprobs across a hand-over).
"""

from __future__ import annotations

import asyncio

import pytest
from test_kv_pool import letters
from test_prefix_cache import seq, submit_all
from test_streaming_cancel import parse_sse

from api.openai.fields import choice_seed
from core.sequence import Sequence, group_choices
from engine import FakeEngine
from scheduler import Scheduler

from conftest import assert_error, assert_pool_full, bounded, fake_text, run, serving, wait_until
from live import openai_client


def test_choice_seeds_are_their_own_streams():
    assert choice_seed(None, 3) is None and choice_seed(7, 0) == 7
    seeds = [choice_seed(7, i) for i in range(8)]
    assert len(set(seeds)) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [choice_seed(7, i) for i in range(8)] and choice_seed(8, 1) != seeds[1]


def test_completions_n_choices_prompt_major_with_usage_counting_each_prompt_once():
    async def body():
        async with serving() as c:
            r = await c.post("/v1/completions", json={"prompt": ["first", "second one"], "max_tokens": 4, "n": 3})
            assert r.status_code == 200, r.text
            b = r.json()
            assert [ch["index"] for ch in b["choices"]] == list(range(6))
            texts = [ch["text"] for ch in b["choices"]]
            assert texts == [fake_text("first", 4)] * 3 + [fake_text("second one", 4)] * 3
            assert b["usage"] == {
                "prompt_tokens": 5 + 10,  # each prompt once, not once per choice
                "completion_tokens": 6 * 4,
                "total_tokens": 15 + 24,
                "prompt_tokens_details": {"cached_tokens": 0},
            }

    bounded(body)


def test_chat_n_choices():
    async def body():
        async with serving() as c:
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "temperature": 0}
            b = (await c.post("/v1/chat/completions", json=chat)).json()
            assert [ch["index"] for ch in b["choices"]] == [0, 1]
            assert b["choices"][0]["message"] == b["choices"][1]["message"]  # greedy: n equal choices
            assert b["usage"]["completion_tokens"] == 6 and b["usage"]["prompt_tokens"] == len("<user>hi\n<assistant>")

    bounded(body)


def test_streamed_frames_carry_each_choice_index():
    async def body():
        async with serving() as c:
            opts = {"stream": True, "stream_options": {"include_usage": True}, "n": 3, "max_tokens": 4}
            events = parse_sse((await c.post("/v1/completions", json={"prompt": "abc", **opts})).text)
            assert events[-1] == "[DONE]"
            *frames, usage = events[:-1]
            assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 3
            assert usage["usage"]["completion_tokens"] == 12
            for i in range(3):
                mine = [f["choices"][0] for f in frames if f["choices"][0]["index"] == i]
                assert "".join(ch["text"] for ch in mine) == fake_text("abc", 4)
                assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["length"]
            chat = {"messages": [{"role": "user", "content": "hi"}], **opts, "n": 2}
            events = parse_sse((await c.post("/v1/chat/completions", json=chat)).text)
            frames = [e for e in events[:-1] if e["choices"]]
            roles = [f["choices"][0]["index"] for f in frames if f["choices"][0]["delta"].get("role")]
            assert sorted(roles) == [0, 1]
            for i in (0, 1):
                mine = [f["choices"][0] for f in frames if f["choices"][0]["index"] == i]
                assert "".join(ch["delta"].get("content", "") for ch in mine) == fake_text("<user>hi\n<assistant>", 4)
                assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["length"]

    bounded(body)


def test_n_beyond_max_n_is_422_on_both_endpoints():
    async def body():
        async with serving(max_n=2) as c:
            r = await c.post("/v1/completions", json={"prompt": "x", "n": 3})
            assert assert_error(r, 422, "invalid_request_error", "MAX_N")["param"] == "n"
            chat = {"messages": [{"role": "user", "content": "x"}], "n": 3}
            assert_error(await c.post("/v1/chat/completions", json=chat), 422, contains="MAX_N")
            assert (await c.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 1})).status_code == 200

    bounded(body)


@pytest.mark.parametrize("budget", [0, 5], ids=["whole", "chunked"])
@pytest.mark.parametrize("prompt", ["eighteen bytes....", "sixteen bytes..."], ids=["mid-block", "on-boundary"])
def test_the_prompt_is_computed_once_for_n_choices(prompt, budget):
    """Block size 4: choice 0 computes the prompt, the other 3 fork it (its full blocks shared, a copy of its
    partial last block each): the prefill tokens computed are the prompt's length, not 4 times it, nor the
    prompt plus 3 partial blocks. The fake's KV check proves every choice reads its own tokens."""

    async def body():
        engine = FakeEngine(capacity=8, block_size=4, max_num_batched_tokens=budget, check_kv=True)
        async with serving(engine) as c:
            r = await c.post("/v1/completions", json={"prompt": prompt, "n": 4, "max_tokens": 6})
            assert [ch["text"] for ch in r.json()["choices"]] == [fake_text(prompt, 6)] * 4
            assert r.json()["usage"]["prompt_tokens"] == len(prompt)
            assert engine.planner.prefill_tokens_computed == len(prompt)
            assert engine.planner.num_forks == 3 and engine.planner.num_block_copies == (3 if len(prompt) % 4 else 0)
            text = (await c.get("/metrics")).text
            assert f"minibatch:prefill_tokens_computed_total {float(len(prompt))}" in text.splitlines()
            assert_pool_full(engine)

    bounded(body)


# --- the fork, engine level (FakeEngine with its KV check) ---------------------------------------------


def choices(prompt, n: int, max_new: int = 4, **kw) -> list[Sequence]:
    """The ``n`` choices of one prompt, grouped as /v1 groups them."""
    group = [seq(prompt, max_new, **kw) for _ in range(n)]
    group_choices(group)
    return group


def finish(eng) -> None:
    while eng.num_active():
        eng.step()


@pytest.mark.parametrize("budget", [0, 5])
def test_forked_choices_share_the_prompt_blocks_and_own_their_partial_block(budget):
    eng = FakeEngine(capacity=8, num_blocks=20, block_size=4, max_num_batched_tokens=budget, check_kv=True)
    group = choices(range(1, 11), 3, max_new=5)  # 10 tokens: 2 full blocks + 2
    assert eng.can_admit(group)
    free = eng.blocks.num_free_blocks
    eng.admit(group)
    assert free - eng.blocks.num_free_blocks == 3 + 2  # one copy of the prompt + one partial block per child
    table = eng.blocks.block_table
    parent, *children = (table(s.seq_id) for s in group)
    assert all(c[:2] == parent[:2] and c[2] != parent[2] for c in children)
    finish(eng)
    assert all(s.output_token_ids == letters(range(1, 11), 5) for s in group)
    books = eng.planner
    assert books.prefill_tokens_computed == 10 and books.num_forks == 2 and books.num_block_copies == 2
    assert [s.num_cached_tokens for s in group] == [0, 0, 0]
    assert_pool_full(eng)


def test_choices_admitted_while_the_parent_prefills_in_chunks_wait_and_fork():
    eng = FakeEngine(capacity=8, num_blocks=20, block_size=4, max_num_batched_tokens=4, check_kv=True)
    first, second, third = choices(range(1, 19), 3, max_new=3)  # 18 tokens: 5 chunks
    eng.admit([first])
    assert eng.can_admit([second])  # costs its partial block only, does not wait for the prefix
    eng.admit_and_step([second])
    eng.admit_and_step([third])
    assert eng.stats()["num_prefilling"] == 3 and not second.output_token_ids
    finish(eng)
    assert all(s.output_token_ids == letters(range(1, 19), 3) for s in (first, second, third))
    assert eng.planner.prefill_tokens_computed == 18 and eng.planner.num_forks == 2
    assert_pool_full(eng)


def test_aborting_the_parent_mid_prefill_hands_the_prompt_to_its_first_child():
    """The parent computed 17 of 18 tokens (4 full blocks + 1 token of the partial one) when it is aborted: the
    first child goes on from its last full block (16), the second now waits on it."""
    eng = FakeEngine(capacity=8, num_blocks=20, block_size=4, max_num_batched_tokens=17, check_kv=True)
    parent, heir, other = choices(range(1, 19), 3, max_new=4)
    eng.admit([parent, heir, other])
    assert eng.planner.prefill_tokens_computed == 17 and eng.abort(parent.seq_id)
    assert parent.finish_reason == "abort"
    finish(eng)
    assert heir.output_token_ids == other.output_token_ids == letters(range(1, 19), 4)
    assert eng.planner.prefill_tokens_computed == 17 + 2 and eng.planner.num_forks == 1
    assert_pool_full(eng)


def test_aborting_a_waiting_choice_leaves_the_others_running():
    eng = FakeEngine(capacity=8, num_blocks=20, block_size=4, max_num_batched_tokens=4, check_kv=True)
    parent, gone, kept = choices(range(1, 12), 3, max_new=4)
    eng.admit([parent, gone, kept])
    assert eng.abort(gone.seq_id) and gone.finish_reason == "abort" and not gone.output_token_ids
    finish(eng)
    assert parent.output_token_ids == kept.output_token_ids == letters(range(1, 12), 4)
    assert eng.planner.prefill_tokens_computed == 11
    assert_pool_full(eng)


def test_cancelling_one_choice_mid_stream_the_others_complete():
    async def main():
        eng = FakeEngine(capacity=8, num_blocks=40, block_size=4, check_kv=True, step_delay=0.002)
        sched = Scheduler(eng, max_queue_depth=100)
        sched.start()
        group = choices(range(1, 15), 4, max_new=30)
        futures = [sched.submit(s) for s in group]
        await wait_until(lambda: len(group[2].output_token_ids) >= 3, what="three tokens of choice 2")
        sched.abort(group[2].seq_id)
        done = await asyncio.wait_for(asyncio.gather(*futures), 30)
        await sched.stop()
        return eng, done

    eng, done = run(main())
    assert [s.finish_reason for s in done] == ["length", "length", "abort", "length"]
    assert all(s.output_token_ids == letters(range(1, 15), 30) for s in done if s is not done[2])
    assert 3 <= len(done[2].output_token_ids) < 30 and eng.planner.prefill_tokens_computed == 14
    assert_pool_full(eng)


def test_a_forked_choice_preempted_while_waiting_forks_again_and_all_stay_exact():
    """13 blocks of 4: a running sequence needs a block while a group of 3 prefills its 38-token prompt in
    chunks (10 blocks, 1 more per child: the third child does not fit yet). The newest admission, the child
    waiting for its parent, is preempted; readmitted while the parent still prefills, it forks again."""
    eng = FakeEngine(capacity=4, num_blocks=13, block_size=4, max_num_batched_tokens=4, check_kv=True)
    runner = seq(range(100, 104), max_new=8)  # 4 tokens, grows to 3 blocks
    eng.admit([runner])
    group = choices(range(1, 39), 3, max_new=3)
    preempted, waiting, back = [], list(group), []
    for _ in range(200):
        if not eng.num_active() and not waiting and not back:
            break
        preempted += [(s, len(s.output_token_ids)) for s in back]
        waiting = back + waiting
        if waiting and eng.can_admit(waiting[:1]):
            back = eng.run_step([waiting.pop(0)]).preempted
        else:
            back = eng.run_step().preempted
    assert [(s.seq_id, n) for s, n in preempted] == [(group[1].seq_id, 0)]  # while it waited for the prompt
    assert runner.output_token_ids == letters(range(100, 104), 8)
    assert all(s.output_token_ids == letters(range(1, 39), 3) for s in group)
    assert eng.planner.prefill_tokens_computed == 4 + 38 and eng.planner.num_forks == 2
    assert_pool_full(eng)


def test_under_pressure_forked_choices_are_preempted_and_recomputed_exactly():
    """Through the scheduler, a pool too small for the choices' growth: some are preempted after their first
    tokens and recompute normally (prompt + output, their prompt blocks found in the cache)."""
    eng = FakeEngine(capacity=8, num_blocks=12, block_size=4, check_kv=True)
    group = choices(range(1, 11), 4, max_new=12)  # 10 + 12 tokens each: 6 blocks, 2 of them shared
    other = seq(range(40, 46), max_new=6)
    submit_all(eng, [group + [other]])
    assert eng.planner.num_preemptions >= 1
    assert all(s.output_token_ids == letters(range(1, 11), 12) for s in group)
    assert other.output_token_ids == letters(range(40, 46), 6)
    assert_pool_full(eng)


@pytest.mark.parametrize("caching", [True, False])
def test_fork_works_with_prefix_caching_off_and_with_prompt_logprobs(caching):
    eng = FakeEngine(capacity=8, num_blocks=20, block_size=4, prefix_caching=caching, check_kv=True)
    group = choices(range(1, 11), 3, max_new=3, prompt_logprobs_k=1)
    eng.admit(group)
    finish(eng)
    assert eng.planner.prefill_tokens_computed == 10 and eng.planner.num_forks == 2
    assert all(len(s.prompt_logprobs) == 10 and s.prompt_logprobs == group[0].prompt_logprobs for s in group)
    assert all(s.output_token_ids == letters(range(1, 11), 3) for s in group)
    assert_pool_full(eng)


def test_a_choice_that_cannot_fork_any_more_is_admitted_like_any_sequence():
    """The parent already decodes (its prompt done): a late choice finds the prompt's full blocks cached and
    computes its last block, as a separate request would."""
    eng = FakeEngine(capacity=8, num_blocks=20, block_size=4, check_kv=True)
    parent, late = choices(range(1, 11), 2, max_new=4)
    eng.admit([parent])
    eng.admit_and_step([late])
    finish(eng)
    assert late.num_cached_tokens == 8 and eng.planner.prefill_tokens_computed == 10 + 2 and eng.planner.num_forks == 0
    assert late.output_token_ids == parent.output_token_ids == letters(range(1, 11), 4)
    assert_pool_full(eng)


# --- the tiny GPT-2 through the openai client -----------------------------------------------------------


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    from config import Config
    from server import create_app

    from live import ThreadServer

    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    config = Config(
        model_id=tiny_model_dir, served_model_name="tiny", chat_template=template, max_batch_size=8, log_level="WARNING"
    )
    with ThreadServer(create_app(config)) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with openai_client(live) as c:
        yield c


@pytest.mark.model
def test_openai_client_n_seeded_choices_distinct_and_reproducible_one_by_one(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    r = client.completions.create(n=4, seed=11, **kw)
    texts = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in sorted(r.choices, key=lambda ch: ch.index)] == [0, 1, 2, 3]
    assert len(set(texts)) >= 3, texts  # independent streams
    assert [ch.text for ch in client.completions.create(n=4, seed=11, **kw).choices] == texts
    for i, text in enumerate(texts):  # choice i alone: n 1 with its own seed
        assert client.completions.create(n=1, seed=choice_seed(11, i), **kw).choices[0].text == text
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 48
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # 4 tokens: no full block before the last token


@pytest.mark.model
def test_openai_client_n_greedy_and_streamed(client, live):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # long enough for cached blocks
    kw = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    before = live.state.engine.planner.prefill_tokens_computed
    r = client.completions.create(n=3, **kw)
    assert len({ch.text for ch in r.choices}) == 1  # greedy: the choices are equal
    computed = live.state.engine.planner.prefill_tokens_computed - before
    assert computed < 2 * r.usage.prompt_tokens, computed  # the prompt once, plus the other choices' last block
    streamed = {0: "", 1: "", 2: ""}
    for ev in client.completions.create(n=3, stream=True, **kw):
        for ch in ev.choices:
            streamed[ch.index] += ch.text
    assert list(streamed.values()) == [r.choices[0].text] * 3
    chat = dict(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=6, n=2, seed=3)
    first = client.chat.completions.create(**chat)
    assert [ch.index for ch in first.choices] == [0, 1] and first.usage.completion_tokens <= 12
    again = client.chat.completions.create(**chat)
    assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in first.choices]


# --- the fork on real checkpoints (GPT-2 and Llama), through the scheduler ---------------------------------


@pytest.mark.model
@pytest.mark.parametrize("budget", [0, 5], ids=["whole", "chunked"])
def test_greedy_forked_choices_equal_hf_generate_and_compute_the_prompt_once(pressure_model, budget):
    """Block size 4: 4 greedy choices of an 18-token prompt (mid-block) and 3 of a 16-token one (on the boundary)
    are each equal to HF ``generate``; the prefill computes each prompt once."""
    from test_prefix_cache import assert_parity, full_again, hf_engine

    from conftest import PROMPTS, Reference

    reference = Reference(pressure_model)
    engine = hf_engine(pressure_model, max_num_batched_tokens=budget, max_batch_size=8)
    mid = choices(reference.encode(" ".join(PROMPTS))[:18], 4, max_new=10)
    edge = choices(reference.encode(PROMPTS[4] + " " + PROMPTS[1])[:16], 3, max_new=10)
    submit_all(engine, [mid])
    assert engine.planner.prefill_tokens_computed == 18 and engine.planner.num_block_copies == 3
    submit_all(engine, [edge])
    books = engine.planner
    assert books.prefill_tokens_computed == 18 + 16 and books.num_block_copies == 3 and books.num_forks == 5
    assert_parity(reference, engine, mid + edge)
    assert full_again(engine)


@pytest.mark.model
@pytest.mark.parametrize("budget", [0, 5], ids=["whole", "chunked"])
def test_seeded_forked_choices_equal_each_choice_run_alone(tiny_model_dir, budget):
    """4 sampled choices (temperature 1, choice i seeded with ``choice_seed(11, i)``) forked from one prefill
    give exactly what each seed gives as a request of its own; a second run gives them again."""
    from test_prefix_cache import full_again, hf_engine

    from core.sampling import SamplingParams

    engine = hf_engine(tiny_model_dir, max_num_batched_tokens=budget, max_batch_size=8)
    prompt = engine.encode("Once upon a time, in a small village")  # mid-block with blocks of 4

    def sampled(i: int) -> Sequence:
        params = SamplingParams(temperature=1.0, seed=choice_seed(11, i))
        return seq(prompt, 12, sampling=params, ignore_eos=True)

    group = [sampled(i) for i in range(4)]
    group_choices(group)
    submit_all(engine, [group])
    assert engine.planner.prefill_tokens_computed == len(prompt) and engine.planner.num_forks == 3
    texts = [s.output_token_ids for s in group]
    assert len({tuple(t) for t in texts}) >= 3, texts  # independent streams
    for i, expected in enumerate(texts):
        engine.reset_prefix_cache()  # each alone computes the whole prompt, as the group's parent did
        alone = sampled(i)
        submit_all(engine, [[alone]])
        assert alone.output_token_ids == expected, i
    again = [sampled(i) for i in range(4)]
    group_choices(again)
    engine.reset_prefix_cache()
    submit_all(engine, [again])
    assert [s.output_token_ids for s in again] == texts
    assert full_again(engine)


@pytest.mark.model
def test_forked_choices_under_memory_pressure_stay_exact(pressure_model):
    """Two groups of 3 greedy choices and two loners in a pool of 14 blocks of 4 tokens: choices are preempted
    (waiting for their parent or decoding) and recomputed; every output equals HF ``generate``."""
    from test_prefix_cache import full_again, hf_engine

    from conftest import PROMPTS, Reference

    reference = Reference(pressure_model)
    engine = hf_engine(pressure_model, blocks=14, max_num_batched_tokens=6)
    long = dict(ignore_eos=True)  # random weights emit EOS early: run every sequence its whole budget
    groups = [choices(reference.encode(p)[:10], 3, 12, **long) for p in (PROMPTS[4], PROMPTS[3] + PROMPTS[1])]
    loners = [seq(reference.encode(PROMPTS[1])[:7], 14, **long), seq(reference.encode(PROMPTS[3])[:9], 10, **long)]
    submit_all(engine, [groups[0] + loners + groups[1]])
    assert engine.planner.num_preemptions >= 1 and engine.planner.num_forks >= 2
    for s in groups[0] + groups[1] + loners:
        assert s.output_token_ids == reference.generate(s.prompt_token_ids, s.max_new_tokens, set()), s.seq_id
    assert full_again(engine)


@pytest.mark.model
def test_each_forked_choice_keeps_its_own_grammar(tiny_model_dir):
    """Structured output per choice: 3 sampled choices, each with its own JSON-schema matcher, forked from one
    prefill (chunked): every answer parses and validates, and they differ."""
    import json

    import jsonschema
    from test_prefix_cache import full_again, hf_engine

    from core.sampling import SamplingParams
    from guided.grammars import compiler_for, schema_grammar

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 99}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    engine = hf_engine(tiny_model_dir, max_num_batched_tokens=5)
    grammar, prompt = schema_grammar(schema), engine.encode("A person as JSON:")
    group = [seq(prompt, 60, sampling=SamplingParams(temperature=1.0, seed=i)) for i in range(3)]
    for s in group:
        s.grammar = compiler_for(engine).matcher(grammar)
    group_choices(group)
    submit_all(engine, [group])
    assert engine.planner.num_forks == 2 and engine.planner.prefill_tokens_computed == len(prompt)
    answers = [engine.decode(s.output_token_ids) for s in group]
    for s, text in zip(group, answers):
        assert s.finish_reason == "stop", (s.finish_reason, text)
        jsonschema.validate(json.loads(text), schema)
    assert len(set(answers)) > 1, answers
    assert full_again(engine)


@pytest.mark.model
def test_prompt_logprobs_survive_the_parent_leaving_mid_prefill(tiny_model_dir):
    """echo + logprobs with n = 3, chunks of 7: the parent is aborted after 14 of its 15 prompt tokens; its first
    child goes on from the prompt's last full block (12: it shares those, its partial block is its own, not
    computed), keeping the prompt logprobs scored so far. Both remaining choices end with the prompt
    logprobs of a choice run alone, and its greedy tokens."""
    from test_prefix_cache import full_again, hf_engine

    engine = hf_engine(tiny_model_dir, max_num_batched_tokens=7)
    prompt = engine.encode("Once upon a time, in a small village by the sea, there lived")
    alone = seq(prompt, 6, prompt_logprobs_k=2)
    submit_all(engine, [[alone]])
    engine.reset_prefix_cache()
    parent, heir, other = choices(prompt, 3, max_new=6, prompt_logprobs_k=2)
    engine.admit([parent, heir, other])
    engine.step()  # 14 prompt tokens computed: 3 full blocks of 4 and 2 of the partial one
    assert engine.abort(parent.seq_id)
    finish(engine)
    for s in (heir, other):
        assert s.output_token_ids == alone.output_token_ids
        assert [lp and lp.token_id for lp in s.prompt_logprobs] == [lp and lp.token_id for lp in alone.prompt_logprobs]
        got = [lp.logprob for lp in s.prompt_logprobs[1:]]
        assert got == pytest.approx([lp.logprob for lp in alone.prompt_logprobs[1:]], abs=1e-4)
    assert len(prompt) == 15 and engine.planner.prefill_tokens_computed == 15 + 14 + 3  # alone, then 14, then 12..15
    assert full_again(engine)
