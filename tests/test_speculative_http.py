"""Speculative decoding through the server, on the fake engine: requests with n-gram drafts answer as without them
(text, tokens, finish reasons, usage, logprobs, streams), /metrics counts the drafts, the ``speculative`` field is
validated, and the config knobs reach the planner."""

from __future__ import annotations

import pytest

from core.sequence import Sequence
from core.speculative import SpecParams
from engine import FakeEngine


def copying_engine() -> FakeEngine:
    """A fake model that answers with its prompt, from its first byte on, cyclically: n-gram drafts are accepted
    from the second token on."""

    def fn(seq: Sequence) -> int:
        prompt, n = seq.prompt_token_ids, len(seq.output_token_ids)
        return prompt[n % len(prompt)]

    return FakeEngine(capacity=4, token_fn=fn, check_kv=True)


PASTE = "Fix this text: the quick brown fox jumps over the lazy dog, then naps under an old oak tree by the river."


def test_speculative_requests_answer_as_without(monkeypatch):
    """/generate and /v1/chat/completions (streamed and not) with n-gram drafts answer the text, tokens,
    finish reasons, usage and logprobs they answer without, a stop string landing mid-draft included; /metrics
    counts the drafts, and every token the engine generated."""
    from conftest import metric, run, scrape, serving, sse_events

    async def answers(spec):
        extra = {"speculative": spec} if spec else {}
        out = []
        async with serving(copying_engine(), max_new_tokens_limit=200) as c:
            for body in (
                {"prompt": PASTE, "max_new_tokens": 90},
                {"prompt": PASTE, "max_new_tokens": 90, "stop": ["old oak"]},
                {"prompt": PASTE, "max_new_tokens": 37},
            ):
                r = await c.post("/generate", json={**body, **extra})
                assert r.status_code == 200, r.text
                j = r.json()
                out.append((j["text"], j["token_ids"], j["finish_reason"], j["usage"]))
            body = {"prompt": PASTE, "max_tokens": 50, "temperature": 0, "logprobs": 1, "stop": ["lazy"], **extra}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            out.append((choice["text"], choice["logprobs"], r.json()["usage"]))
            chat = {"messages": [{"role": "user", "content": PASTE}], "max_tokens": 60, "temperature": 0, **extra}
            r = await c.post("/v1/chat/completions", json={**chat, "stop": ["brown fox"]})
            assert r.status_code == 200, r.text
            j = r.json()
            out.append((j["choices"][0]["message"]["content"], j["choices"][0]["finish_reason"], j["usage"]))
            r = await c.post(
                "/v1/chat/completions", json={**chat, "stream": True, "stream_options": {"include_usage": True}}
            )
            events = [e for e in sse_events(r.text) if e != "[DONE]"]
            text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
            out.append((text, events[-1]["usage"]))
            generated = metric(await scrape(c), "minibatch:generation_tokens_total")
            drafts = metric(await scrape(c), "minibatch:spec_decode_num_draft_tokens_total")
            accepted = metric(await scrape(c), "minibatch:spec_decode_num_accepted_tokens_total")
        return out, drafts, accepted, generated

    off, none, _, generated_off = run(answers(None))
    on, drafts, accepted, generated_on = run(answers({"method": "ngram", "num_speculative_tokens": 5}))
    assert none == 0 and drafts > 100 and accepted > 0.8 * drafts, (drafts, accepted)
    assert on == off
    # every token of a run counts, those a stop string cuts after the run too (at most 5 per stop-string request)
    assert generated_off <= generated_on <= generated_off + 3 * 5
    assert off[1][2] == "stop" and off[1][0].endswith("then naps under an ")  # the stop string, mid-draft


def test_speculative_field_is_validated():
    from conftest import assert_error, run, serving

    async def go():
        async with serving() as c:
            r = await c.post(
                "/generate",
                json={"prompt": "hi", "speculative": {"method": "draft_model", "draft_model": "tiny-draft"}},
            )
            assert_error(r, 400, contains="tiny-draft")
            r = await c.post("/v1/completions", json={"prompt": "hi", "speculative": {"draft_model": "x"}})
            assert_error(r, 400, contains="'x'")
            r = await c.post("/generate", json={"prompt": "hi", "speculative": {"method": "eagle"}})
            assert r.status_code == 422
            r = await c.post("/generate", json={"prompt": "hi", "speculative": {"num_speculative_tokens": 99}})
            assert r.status_code == 422
            r = await c.post(
                "/generate", json={"prompt": "hi", "speculative": {"prompt_lookup_min": 5, "prompt_lookup_max": 3}}
            )
            assert_error(r, 400, contains="lookup")
            r = await c.post("/generate", json={"prompt": "hi", "speculative": {"method": "ngram"}})
            assert r.status_code == 200

    run(go())


def test_config_knobs():
    from config import Config, ConfigError
    from models.runtime import build_engine

    cfg = Config.from_env(
        {
            "MODEL_ID": "fake",
            "SPECULATIVE_METHOD": "ngram",
            "NUM_SPECULATIVE_TOKENS": "6",
            "PROMPT_LOOKUP_MIN": "1",
            "PROMPT_LOOKUP_MAX": "5",
            "SPECULATIVE_DISABLE_BY_BATCH_SIZE": "3",
            "SPECULATIVE_ADAPTIVE": "false",
        }
    )
    eng = build_engine(cfg)
    assert eng.planner.spec_adaptive is False
    assert eng.planner.speculative == SpecParams("ngram", 6, 1, 5)
    assert eng.planner.spec_disable_batch_size == 3
    for env in (
        {"SPECULATIVE_METHOD": "eagle"},
        {"NUM_SPECULATIVE_TOKENS": "0"},
        {"PROMPT_LOOKUP_MIN": "4", "PROMPT_LOOKUP_MAX": "2"},
        {"SPECULATIVE_DISABLE_BY_BATCH_SIZE": "-1"},
    ):
        with pytest.raises(ConfigError, match=next(iter(env)) if len(env) == 1 else "PROMPT_LOOKUP_MAX"):
            Config.from_env({"MODEL_ID": "fake", **env})
