"""Batched prompts on /v1/completions (OpenAI's four prompt forms), through the ASGI app on the
FakeEngine: one choice per prompt in order, usage summed, all queued together, a bad prompt fails the
whole request before anything runs, MAX_PROMPTS_PER_REQUEST, streaming with ``index``. The ``openai``
client and the real tiny model are in test_openai_api.py."""

from __future__ import annotations

import asyncio

import pytest

from engine import FakeEngine

from conftest import Gate, assert_error, bounded, fake_text, serving, sse_events, wait_until

BASE = {"max_tokens": 5, "temperature": 0}


def ids(text: str) -> list[int]:
    """FakeEngine's byte-level token ids (byte + 1)."""
    return [b + 1 for b in text.encode("utf-8")]


class AdmissionLog(FakeEngine):
    """A FakeEngine that records the sequences of each prefill (who was admitted together)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(admit_fault=lambda seqs: self.admitted.append([s.request_id for s in seqs]), **kwargs)
        self.admitted: list[list[str]] = []


@pytest.mark.parametrize("form", ["text", "list of one text", "token ids", "list of one token-id list"])
def test_the_four_prompt_forms_give_the_same_answer(form):
    prompt = {
        "text": "four forms",
        "list of one text": ["four forms"],
        "token ids": ids("four forms"),
        "list of one token-id list": [ids("four forms")],
    }[form]

    async def body():
        async with serving() as c:
            r = await c.post("/v1/completions", json={**BASE, "prompt": prompt, "echo": True})
            assert r.status_code == 200, r.text
            (choice,) = r.json()["choices"]
            assert choice["index"] == 0 and choice["text"] == "four forms" + fake_text("four forms", 5)
            assert r.json()["usage"] == {
                "prompt_tokens": 10,
                "completion_tokens": 5,
                "total_tokens": 15,
                "prompt_tokens_details": {"cached_tokens": 0},
            }

    bounded(body)


@pytest.mark.parametrize("as_ids", [False, True], ids=["texts", "token-id lists"])
def test_several_prompts_one_choice_each_in_order_usage_summed_admitted_together(as_ids):
    prompts = ["alpha", "the second prompt", "c"]

    async def body():
        engine = AdmissionLog(capacity=4)
        async with serving(engine) as c:
            sent = [ids(p) for p in prompts] if as_ids else prompts
            r = await c.post("/v1/completions", json={**BASE, "prompt": sent})
            assert r.status_code == 200, r.text
            b = r.json()
            assert [ch["index"] for ch in b["choices"]] == [0, 1, 2]
            assert [ch["text"] for ch in b["choices"]] == [fake_text(p, 5) for p in prompts]
            assert all(ch["finish_reason"] == "length" for ch in b["choices"])
            n_prompt = sum(len(p) for p in prompts)
            assert b["usage"] == {
                "prompt_tokens": n_prompt,
                "completion_tokens": 15,
                "total_tokens": n_prompt + 15,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            # One prefill admitted all three: they reached the scheduler together.
            assert engine.admitted == [[f"{b['id']}-{i}" for i in range(3)]]

    bounded(body)


def test_more_prompts_than_slots_still_give_every_choice():
    prompts = [f"prompt number {i}" for i in range(7)]

    async def body():
        async with serving(FakeEngine(capacity=2)) as c:
            r = await c.post("/v1/completions", json={**BASE, "prompt": prompts})
            assert r.status_code == 200, r.text
            assert [ch["text"] for ch in r.json()["choices"]] == [fake_text(p, 5) for p in prompts]

    bounded(body)


def test_max_prompts_per_request():
    async def body():
        async with serving(max_prompts_per_request=2) as c:
            assert (await c.post("/v1/completions", json={**BASE, "prompt": ["a", "b"]})).status_code == 200
            for prompt in (["a", "b", "c"], [[5], [6], [7]]):
                r = await c.post("/v1/completions", json={**BASE, "prompt": prompt})
                err = assert_error(r, 422, "invalid_request_error", "MAX_PROMPTS_PER_REQUEST")
                assert "3 prompts" in err["message"] and err["param"] == "prompt"

    bounded(body)


@pytest.mark.parametrize(
    "bad, words",
    [
        ([[5, 6], [7, 999_999]], "prompt 1: prompt token id 999999 is outside the vocabulary"),
        ([[5, 6], list(range(1, 200))], "prompt 1: prompt is 199 tokens"),
        (["fine", "x" * 300], "prompt 1: prompt is 300 characters"),
        (["fine", "also fine", "y" * 80], "prompt 2: prompt (80 tokens) + max_new_tokens"),
    ],
)
def test_one_bad_prompt_fails_the_whole_request_before_anything_runs(bad, words):
    async def body():
        engine = AdmissionLog(capacity=4, max_context=100)
        async with serving(engine, max_prompt_chars=200) as c:
            r = await c.post("/v1/completions", json={"prompt": bad, "max_tokens": 30})
            assert_error(r, 422, "invalid_request_error", words)
            assert engine.admitted == []  # nothing reached the engine
            assert len(c.app.state.server.scheduler.waiting) == 0

    bounded(body)


@pytest.mark.parametrize(
    "prompt",
    [[], [[]], ["a", ""], ["a", 1], [[1], "a"], [1, [2]], [[1.5]], [True]],
    ids=["empty", "empty ids", "empty text", "text and id", "ids and text", "id and ids", "float", "bool"],
)
def test_malformed_prompt_lists_are_422(prompt):
    async def body():
        async with serving() as c:
            assert_error(await c.post("/v1/completions", json={**BASE, "prompt": prompt}), 422, contains="prompt")

    bounded(body)


@pytest.mark.parametrize("echo", [False, True])
def test_streaming_several_prompts_carries_the_index(echo):
    prompts = ["one", "prompt two", "3"]

    async def body():
        async with serving() as c:
            payload = {**BASE, "prompt": prompts, "echo": echo}
            whole = (await c.post("/v1/completions", json=payload)).json()
            stream = {**payload, "stream": True, "stream_options": {"include_usage": True}}
            r = await c.post("/v1/completions", json=stream)
            assert r.status_code == 200, r.text
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            *chunks, usage_event = events[:-1]
            texts, finishes = ["", "", ""], [[], [], []]
            for event in chunks:
                assert event["object"] == "text_completion"
                (choice,) = event["choices"]
                texts[choice["index"]] += choice["text"]
                if choice["finish_reason"] is not None:
                    finishes[choice["index"]].append(choice["finish_reason"])
            assert texts == [ch["text"] for ch in whole["choices"]]
            assert finishes == [["length"]] * 3
            assert usage_event["choices"] == [] and usage_event["usage"] == whole["usage"]
            assert len({event["id"] for event in chunks + [usage_event]}) == 1

    bounded(body)


def test_an_engine_failure_in_one_prompt_fails_the_request_and_frees_the_others():
    """A failed choice makes the whole answer an error (no partial answer), and the other prompts' sequences
    are cancelled rather than left running."""

    def fault(seqs):
        if any(s.prompt_token_ids == ids("poison") for s in seqs):
            raise RuntimeError("injected")

    async def body():
        async with serving(FakeEngine(capacity=1, admit_fault=fault)) as c:
            r = await c.post("/v1/completions", json={"prompt": ["fine", "poison", "later"], "max_tokens": 40})
            assert_error(r, 500, "server_error", "generation failed")
            sched = c.app.state.server.scheduler
            await wait_until(lambda: not sched.waiting and not sched.running, what="the other prompts cancelled")
            # The server still answers afterwards.
            ok = await c.post("/v1/completions", json={**BASE, "prompt": ["fine", "later"]})
            assert ok.status_code == 200 and len(ok.json()["choices"]) == 2

    bounded(body)


def test_a_stream_whose_prompt_fails_ends_with_the_error_and_frees_the_others():
    def fault(seqs):
        if any(s.prompt_token_ids == ids("poison") for s in seqs):
            raise RuntimeError("injected")

    async def body():
        async with serving(FakeEngine(capacity=1, admit_fault=fault)) as c:
            payload = {"prompt": ["fine", "poison", "later"], "max_tokens": 40, "stream": True}
            r = await c.post("/v1/completions", json=payload)
            assert r.status_code == 200
            events = sse_events(r.text)
            assert events[-1] == "[DONE]" and set(events[-2]) == {"error"}, events[-3:]
            assert events[-2]["error"]["code"] == "server_error"
            assert not any("usage" in e for e in events[:-1] if isinstance(e, dict))
            sched = c.app.state.server.scheduler
            await wait_until(lambda: not sched.waiting and not sched.running, what="the other prompts cancelled")

    bounded(body)


def test_a_queue_that_fills_part_way_queues_none_of_the_prompts():
    """MAX_QUEUE_DEPTH 2 and a slot held: three prompts do not fit; the two queued first are taken back."""

    async def body():
        gate = Gate()
        engine = FakeEngine(capacity=1, step_fault=gate.wait)
        async with serving(engine, max_queue_depth=2) as c:
            holder = asyncio.create_task(c.post("/v1/completions", json={"prompt": "hold", "max_tokens": 3}))
            await wait_until(gate.entered.is_set, what="the holder running")
            r = await c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
            assert_error(r, 503, "overloaded")
            sched = c.app.state.server.scheduler
            await wait_until(lambda: not sched.waiting, what="the queued prompts taken back")
            gate.open.set()
            assert (await holder).status_code == 200

    bounded(body)
