"""Prompt logprobs: computed in the prefill forward (logits at every position of the prompts that ask),
equal to ``log_softmax`` of HF's own forward within 1e-4 on GPT-2 and Llama, also while other rows decode
in the same forward; and /v1/completions ``echo`` + ``logprobs`` (``max_tokens: 0`` scores the prompt
alone) through httpx on a real uvicorn, streamed and not, alone and batched."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from config import Config
from scripts.make_test_model import build_checkpoint
from server import create_app

from live import ThreadServer

PROMPTS = ["A journey of a thousand miles begins", "The quick brown fox", "Hello"]
K = 3
TIMEOUT = 60.0


def hf_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's forward over ``ids``: [len(ids), V], row p predicting token p + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def check_against_hf(model_dir: str, ids: list[int], scored: list) -> None:
    ref = hf_logprobs(model_dir, ids)
    assert scored[0] is None and len(scored) == len(ids)
    for p, lp in enumerate(scored[1:]):
        assert lp.token_id == ids[p + 1]
        assert abs(lp.logprob - ref[p, ids[p + 1]].item()) < 1e-4, (p, lp.logprob, ref[p, ids[p + 1]].item())
        top_v, top_i = ref[p].topk(K)
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert max(abs(v - r) for (_, v), r in zip(lp.top, top_v.tolist())) < 1e-4


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model_dir(request, tiny_model_dir, tmp_path_factory) -> str:
    if request.param == "gpt2":
        return tiny_model_dir
    return build_checkpoint(str(tmp_path_factory.mktemp("llama_plp")), arch="llama", seed=3)


def test_engine_prompt_logprobs_equal_hf_while_other_rows_decode(model_dir):
    """Row A decodes while B (no prompt logprobs) and C, D (prompt logprobs) are prefilled in the same
    forward; C and D's prompt logprobs equal HF's, and every row's tokens equal its solo run."""
    from core.sampling import SamplingParams
    from core.sequence import Sequence
    from models.runtime import HFEngine

    engine = HFEngine(Config(model_id=model_dir, max_batch_size=8))

    def seq(prompt: str, plp: bool) -> Sequence:
        s = Sequence(engine.encode(prompt), 6, ignore_eos=True, sampling=SamplingParams())
        s.prompt_logprobs_k = K if plp else None
        return s

    def finish(seqs) -> None:
        while engine.num_active():
            engine.step()

    solo = {}
    for p in PROMPTS:
        s = seq(p, False)
        engine.admit([s])
        finish([s])
        solo[p] = s.output_token_ids
    a = seq(PROMPTS[0], False)
    engine.admit([a])
    engine.step()  # a is decoding now
    b, c, d = seq(PROMPTS[1], False), seq(PROMPTS[2], True), seq(PROMPTS[0], True)
    engine.admit([b, c, d])  # one forward: a's decode row, then three prompts (two scored at every position)
    finish([a, b, c, d])
    assert [x.output_token_ids for x in (a, b, c, d)] == [
        solo[PROMPTS[0]],
        solo[PROMPTS[1]],
        solo[PROMPTS[2]],
        solo[PROMPTS[0]],
    ]
    assert a.prompt_logprobs == [] and b.prompt_logprobs == []
    check_against_hf(model_dir, c.prompt_token_ids, c.prompt_logprobs)
    check_against_hf(model_dir, d.prompt_token_ids, d.prompt_logprobs)


# --- /v1/completions over a real socket ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    config = Config(model_id=tiny_model_dir, max_batch_size=4, max_logprobs=5, log_level="WARNING")
    with ThreadServer(create_app(config)) as server:
        yield server


def post(live, **body) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/completions", json=body, timeout=TIMEOUT)


def test_echo_logprobs_max_tokens_0_scores_the_prompt(live, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok(PROMPTS[0])["input_ids"]
    ref = hf_logprobs(tiny_model_dir, ids)
    r = post(live, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=K)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["text"] == PROMPTS[0] and choice["finish_reason"] == "length"
    # The one token generated under the hood is not part of the answer, even when it would stop the sequence.
    stopped = post(live, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=K, stop_token_ids=[int(ref[-1].argmax())])
    assert stopped.json()["choices"][0] == choice
    assert r.json()["usage"] == {  # prompt logprobs skip the prefix cache: nothing cached is reported
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "total_tokens": len(ids),
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, len(ids)):
        assert abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) < 1e-4
        assert len(lp["top_logprobs"][p]) <= K
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])


def test_echo_logprobs_with_generation_puts_the_prompt_first(live):
    plain = post(live, prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=1, ignore_eos=True).json()
    both = post(live, prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=1, echo=True, ignore_eos=True).json()
    scored = post(live, prompt=PROMPTS[1], max_tokens=0, logprobs=1, echo=True).json()
    gen_lp, both_lp, prompt_lp = (x["choices"][0]["logprobs"] for x in (plain, both, scored))
    n = len(prompt_lp["tokens"])
    assert both["choices"][0]["text"] == PROMPTS[1] + plain["choices"][0]["text"]
    assert both_lp["tokens"] == prompt_lp["tokens"] + gen_lp["tokens"]
    assert both_lp["token_logprobs"][:n] == prompt_lp["token_logprobs"]
    assert both_lp["token_logprobs"][n:] == gen_lp["token_logprobs"]
    assert both_lp["text_offset"][n:] == [o + len(PROMPTS[1]) for o in gen_lp["text_offset"]]


def test_a_batch_of_scoring_requests_equals_each_alone(live, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    token_lists = [tok(p)["input_ids"] for p in PROMPTS]
    alone = [post(live, prompt=ids, max_tokens=0, echo=True, logprobs=0).json() for ids in token_lists]
    batch = post(live, prompt=token_lists, max_tokens=0, echo=True, logprobs=0).json()
    assert batch["usage"]["completion_tokens"] == 0
    assert batch["usage"]["prompt_tokens"] == sum(len(ids) for ids in token_lists)
    for one, choice in zip(alone, batch["choices"]):
        mine = choice["logprobs"]["token_logprobs"]
        theirs = one["choices"][0]["logprobs"]["token_logprobs"]
        assert mine[0] is None and abs(sum(mine[1:]) - sum(theirs[1:])) < 1e-4


def test_streamed_echo_logprobs_equal_the_whole_answer(live):
    for max_tokens in (0, 3):
        body = {"prompt": PROMPTS[:2], "max_tokens": max_tokens, "echo": True, "logprobs": 2, "temperature": 0}
        whole = post(live, **body).json()
        r = post(live, **body, stream=True, stream_options={"include_usage": True})
        events = [json.loads(b[6:]) for b in r.text.split("\n\n") if b.startswith("data: {")]
        texts, tokens, lps = ["", ""], [[], []], [[], []]
        for event in events:
            for ch in event["choices"]:
                texts[ch["index"]] += ch["text"]
                if ch["logprobs"]:
                    tokens[ch["index"]] += ch["logprobs"]["tokens"]
                    lps[ch["index"]] += ch["logprobs"]["token_logprobs"]
        assert texts == [ch["text"] for ch in whole["choices"]]
        assert tokens == [ch["logprobs"]["tokens"] for ch in whole["choices"]]
        assert lps == [ch["logprobs"]["token_logprobs"] for ch in whole["choices"]]
        assert events[-1]["usage"] == whole["usage"]


def test_max_tokens_0_needs_echo(live):
    r = post(live, prompt="hi", max_tokens=0)
    assert r.status_code == 422 and "echo" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "max_tokens"


def test_generate_prompt_logprobs(live, tiny_model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_model_dir)(PROMPTS[0])["input_ids"]
    ref = hf_logprobs(tiny_model_dir, ids)
    body = {"prompt": PROMPTS[0], "max_new_tokens": 2, "prompt_logprobs": 2}
    r = httpx.post(f"{live.url}/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    assert plp[0] is None and [e["token_id"] for e in plp[1:]] == ids[1:]
    for p, entry in enumerate(plp[1:]):
        assert abs(entry["logprob"] - ref[p, ids[p + 1]].item()) < 1e-4
        assert [t["token_id"] for t in entry["top_logprobs"]] == ref[p].topk(2).indices.tolist()
    streamed = httpx.post(f"{live.url}/generate", json={**body, "stream": True}, timeout=TIMEOUT)
    final = [json.loads(b[6:]) for b in streamed.text.split("\n\n") if b.startswith("data: {")][-1]
    assert final["prompt_logprobs"] == plp
    plain = httpx.post(f"{live.url}/generate", json={"prompt": PROMPTS[0], "max_new_tokens": 2}, timeout=TIMEOUT)
    assert "prompt_logprobs" not in plain.json()
    too_many = httpx.post(f"{live.url}/generate", json={**body, "prompt_logprobs": 6}, timeout=TIMEOUT)
    assert too_many.status_code == 422 and "prompt_logprobs" in too_many.json()["error"]["message"]


@pytest.mark.parametrize("budget", [3, 4, 5, 64], ids=["chunk3", "chunk4=block", "chunk5", "whole"])
def test_prompt_logprobs_across_prefill_chunks_and_preemption(model_dir, budget):
    """Prompts split into chunks of 3, 4 (one block) and 5 tokens, and whole, in a pool so small that the
    sequences are preempted and recomputed: each chunk scores its own positions, a recomputed sequence
    keeps what it has, and the result equals HF's forward; tokens equal the unpressured run's."""
    import asyncio

    from test_kv_pool import pool_mb

    from core.sampling import SamplingParams
    from core.sequence import Sequence
    from models.runtime import HFEngine
    from scheduler import Scheduler

    from conftest import run

    def run_all(engine: HFEngine, prompts: list[str]) -> list[Sequence]:
        seqs = [Sequence(engine.encode(p), 12, ignore_eos=True, sampling=SamplingParams()) for p in prompts]
        for s in seqs:
            s.prompt_logprobs_k = K

        async def main():
            sched = Scheduler(engine, max_queue_depth=100)
            sched.start()
            futures = [sched.submit(s) for s in seqs]
            await asyncio.wait_for(asyncio.gather(*futures), TIMEOUT)
            await sched.stop()

        run(main())
        return seqs

    prompts = [" ".join(PROMPTS) * 2, PROMPTS[0], PROMPTS[1] + " and the lazy dog sleeps", PROMPTS[2]]
    roomy = HFEngine(Config(model_id=model_dir, max_batch_size=4, max_model_len=64, max_num_batched_tokens=0))
    expected = [s.output_token_ids for s in run_all(roomy, prompts)]
    tight = HFEngine(
        Config(
            model_id=model_dir,
            max_batch_size=4,
            max_model_len=64,
            kv_block_size=4,
            kv_cache_mb=pool_mb(model_dir, 16, 4),
            max_num_batched_tokens=budget,
        )
    )
    seqs = run_all(tight, prompts)
    assert [s.output_token_ids for s in seqs] == expected
    assert tight.planner.num_preemptions > 0, tight.stats()
    for s in seqs:
        check_against_hf(model_dir, s.prompt_token_ids, s.prompt_logprobs)
