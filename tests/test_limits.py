"""Per-request limits that keep one client's answer from costing everyone: MAX_LOGPROB_ENTRIES (a 422 naming it,
counted over prompt and output, all choices, before anything is queued) and stop_token_ids inside the vocabulary."""

from __future__ import annotations

from conftest import assert_error, bounded, serving


def test_max_logprob_entries_is_a_422_naming_it():
    async def body():
        async with serving(max_logprob_entries=1000) as client:
            # 4 choices x 50 tokens x (1 + 4 alternatives) = 1000: at the limit
            ok = {"prompt": "hello", "n": 4, "max_tokens": 50, "logprobs": 4, "ignore_eos": True}
            r = await client.post("/v1/completions", json=ok)
            assert r.status_code == 200, r.text
            assert all(len(c["logprobs"]["tokens"]) == 50 for c in r.json()["choices"])
            r = await client.post("/v1/completions", json={**ok, "max_tokens": 51})
            assert_error(r, 422, contains="MAX_LOGPROB_ENTRIES")
            assert r.json()["error"]["param"] == "logprobs"
            # the prompt's entries count too (echo): 4 x (46 x 5) = 920 fits, 4 x (5 x 5 + 46 x 5) = 1020 does not
            r = await client.post("/v1/completions", json={**ok, "max_tokens": 46})
            assert r.status_code == 200, r.text
            r = await client.post("/v1/completions", json={**ok, "echo": True, "max_tokens": 46})
            assert_error(r, 422, contains="MAX_LOGPROB_ENTRIES")
            chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 4}
            r = await client.post("/v1/chat/completions", json={**chat, "n": 4, "max_tokens": 51})
            assert_error(r, 422, contains="MAX_LOGPROB_ENTRIES")
            r = await client.post("/generate", json={"prompt": "x" * 300, "prompt_logprobs": 3, "max_new_tokens": 2})
            assert_error(r, 422, contains="MAX_LOGPROB_ENTRIES")
            r = await client.post("/v1/completions", json={"prompt": "hello", "n": 8, "max_tokens": 60})
            assert r.status_code == 200  # no logprobs asked: nothing counted

    bounded(body)


def test_stop_token_ids_outside_the_vocabulary_are_a_422():
    """Before: 10**12 was accepted silently (a stop that can never match)."""

    async def body():
        async with serving() as client:
            for path, budget in (("/generate", "max_new_tokens"), ("/v1/completions", "max_tokens")):
                for bad in (10**12, 257, -1):
                    r = await client.post(path, json={"prompt": "hi", budget: 2, "stop_token_ids": [5, bad]})
                    assert r.status_code == 422, (path, bad, r.text)
                    if bad >= 0:  # (a negative one is refused by the field's own check)
                        assert r.json()["error"]["param"] == "stop_token_ids" and str(bad) in r.text
                r = await client.post(path, json={"prompt": "hi", budget: 2, "stop_token_ids": [0, 256]})
                assert r.status_code == 200, r.text
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop_token_ids": [10**12]}
            assert (await client.post("/v1/chat/completions", json=chat)).status_code == 422

    bounded(body)
