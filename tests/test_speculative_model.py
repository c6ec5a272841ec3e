"""Speculative decoding on real models: GPT-2 and Llama, both runtimes (torch, and the native step kernel verifying
several rows of one sequence in a step), output with drafts token for token the output without them.

A random checkpoint's greedy text rarely repeats its prompt, so besides the n-gram proposer the runs use an oracle
that proposes the run's own answer without drafts, wrong at every few positions: each step accepts some drafts and
rejects the rest, at every position of the run. The engine's answer must not depend on either.
"""

from __future__ import annotations

import json

import pytest
from test_families import engine_for

from conftest import PROMPTS, RUNTIMES, assert_runtime, schedule_all

pytest.importorskip("torch")

from core.sampling import SamplingParams  # noqa: E402
from core.sequence import Sequence, group_choices  # noqa: E402
from core.speculative import NgramProposer, SpecParams  # noqa: E402

pytestmark = pytest.mark.model

SPEC = SpecParams("ngram", num_tokens=4, lookup_min=1, lookup_max=3)


class Oracle:
    """Proposes the answer each prompt got without drafts (``answers``), corrupted wherever (position + salt) % 4
    is 3: runs of 0 to 3 accepted drafts, then a rejection; past the known answer, prompt lookup."""

    def __init__(self, answers: dict[tuple, list[int]], vocab: int) -> None:
        self.answers, self.vocab, self.fallback = answers, vocab, NgramProposer()

    def propose(self, seq, params, k):
        answer = self.answers.get(tuple(seq.prompt_token_ids))
        n = len(seq.output_token_ids)
        if answer is None or n >= len(answer):
            return self.fallback.propose(seq, params, k)
        salt = len(seq.prompt_token_ids)
        return [(t + 1) % self.vocab if (n + j + salt) % 4 == 3 else t for j, t in enumerate(answer[n : n + k])]


def workload(engine) -> list[Sequence]:
    """9 requests over 4 rows (joins), prompts sharing whole blocks (prefix-cache hits), repeated phrases (n-gram
    hits), budgets from 1 to 22 (max_tokens mid-draft), logprobs on some, two choices of one prompt (n > 1)."""
    seqs = []
    for i in range(8):
        text = PROMPTS[i % len(PROMPTS)] + " " + PROMPTS[(i * 5) % len(PROMPTS)] * (1 + i % 3)
        seqs.append(
            Sequence(
                prompt_token_ids=engine.encode(text)[:60],
                max_new_tokens=1 + (i * 7) % 22,
                ignore_eos=True,
                logprobs=2 if i % 3 == 0 else None,
            )
        )
    pair = [Sequence(prompt_token_ids=engine.encode(PROMPTS[1] * 2), max_new_tokens=14, ignore_eos=True) for _ in "ab"]
    group_choices(pair)
    return seqs + pair


def copies(seqs: list[Sequence], **kw) -> list[Sequence]:
    out = [
        Sequence(
            prompt_token_ids=list(s.prompt_token_ids),
            max_new_tokens=s.max_new_tokens,
            ignore_eos=s.ignore_eos,
            logprobs=s.logprobs,
            stop_token_ids=s.stop_token_ids,
            sampling=s.sampling,
            **kw,
        )
        for s in seqs
    ]
    group_choices(out[-2:])
    return out


def untimed_drafts(engine) -> None:
    """Adaptive draft lengths from acceptance and the linear step cost alone, not this machine's measured step
    times: the draft counts these tests assert then do not depend on the minute (a busy CI minute priced drafts so
    high that every one stayed a token long, and no run of 2 accepted was left to check)."""
    engine.planner.step_cost.observe = lambda rows, seconds: None


def assert_same(off: list[Sequence], on: list[Sequence]) -> None:
    for a, b in zip(off, on):
        assert b.output_token_ids == a.output_token_ids, a.prompt_token_ids
        assert b.status is a.status
        if a.logprobs is not None:
            assert [lp.token_id for lp in b.output_logprobs] == b.output_token_ids
            assert [round(lp.logprob, 3) for lp in b.output_logprobs] == [
                round(lp.logprob, 3) for lp in a.output_logprobs
            ]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_greedy_output_with_drafts_is_the_output_without(pressure_model, runtime):
    """Joins, chunked prefill (8 tokens a step) beside verifying rows, prefix-cache hits, preemption (a pool of 30
    blocks of 4 tokens), n > 1, max_tokens and stop tokens landing mid-draft, logprobs: with the oracle's drafts and
    with prompt lookup's, every token and logprob is the run's without drafts."""
    kw = {"max_num_batched_tokens": 8}
    off_engine = engine_for(pressure_model, runtime, blocks=30, **kw)
    assert_runtime(off_engine, runtime)
    seqs = workload(off_engine)
    schedule_all(off_engine, seqs)
    assert off_engine.planner.num_preemptions > 0
    answers = {tuple(s.prompt_token_ids): s.output_token_ids for s in seqs}
    # stop tokens from the answers themselves: a draft carries them, the run ends there
    stopped = copies(seqs)
    for i in (1, 4):
        stopped[i].stop_token_ids = frozenset([seqs[i].output_token_ids[len(seqs[i].output_token_ids) // 2]])
        stopped[i].ignore_eos = False
    for proposer in ("oracle", "ngram"):
        engine = engine_for(pressure_model, runtime, blocks=30, **kw)
        engine.planner.speculative, engine.planner.spec_disable_batch_size = SPEC, 0  # drafts at any batch
        untimed_drafts(engine)
        if proposer == "oracle":
            engine.planner.proposers["ngram"] = Oracle(answers, engine.vocab_size)
        on = copies(seqs)
        schedule_all(engine, on)
        assert_same(seqs, on)
        stats = engine.planner.spec
        if proposer == "oracle":
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
            assert stats.accepted_per_pos[1] > 0, stats  # runs of 2 accepted happen
        assert engine.planner.stats()["generated_tokens"] == off_engine.planner.stats()["generated_tokens"]
        assert engine.blocks.is_all_free()
    # stop tokens mid-draft: the same as the same requests without drafts
    engine = engine_for(pressure_model, runtime, blocks=30, **kw)
    schedule_all(engine, stopped)
    engine = engine_for(pressure_model, runtime, blocks=30, **kw)
    engine.planner.speculative, engine.planner.spec_disable_batch_size = SPEC, 0  # drafts at any batch
    engine.planner.proposers["ngram"] = Oracle(answers, engine.vocab_size)
    again = copies(stopped)
    for a, b in zip(stopped, again):
        b.stop_token_ids, b.ignore_eos = a.stop_token_ids, a.ignore_eos
    schedule_all(engine, again)
    assert_same(stopped, again)
    assert stopped[1].finish_reason == "stop" and len(stopped[1].output_token_ids) < seqs[1].max_new_tokens


SEEDED = [
    SamplingParams(temperature=0.8, seed=7),
    SamplingParams(temperature=1.2, top_k=20, seed=8, repetition_penalty=1.3),
    SamplingParams(temperature=0.5, top_p=0.9, seed=9, frequency_penalty=0.5),
    SamplingParams(temperature=0.3, min_p=0.1, seed=10),
]


def seeded_requests(engine) -> list[Sequence]:
    """Four seeded sampled requests (penalties, top-k, top-p, min-p), 24 tokens each, with logprobs."""
    return [
        Sequence(prompt_token_ids=engine.encode(p * 2), max_new_tokens=24, ignore_eos=True, sampling=sp, logprobs=1)
        for p, sp in zip(PROMPTS[:4], SEEDED)
    ]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_seeded_sampling_with_drafts_keeps_its_tokens(tiny_model_dir, runtime):
    """A seeded sampled row gets the very tokens it gets without drafts (each position draws its own seeded
    uniform, as if the drafts before it were accepted), penalties and top-k included; the oracle's drafts are
    the greedy answer, so sampled tokens reject some and accept others."""
    engine = engine_for(tiny_model_dir, runtime, blocks=64)
    prompts = [engine.encode(p * 2) for p in PROMPTS[:4]]
    greedy = [Sequence(prompt_token_ids=p, max_new_tokens=24, ignore_eos=True) for p in prompts]
    schedule_all(engine, greedy)
    answers = {tuple(s.prompt_token_ids): s.output_token_ids for s in greedy}
    runs = []
    for spec in (None, SPEC):
        engine = engine_for(tiny_model_dir, runtime, blocks=64)
        if spec:
            engine.planner.speculative, engine.planner.spec_disable_batch_size = spec, 0
            engine.planner.proposers["ngram"] = Oracle(answers, engine.vocab_size)
            untimed_drafts(engine)
        seqs = seeded_requests(engine)
        schedule_all(engine, seqs)
        runs.append(seqs)
        if spec:
            assert engine.planner.spec.num_accepted_tokens > 0
    assert_same(*runs)


def test_a_grammar_cuts_the_drafts_it_rejects(tmp_path_factory):
    """Structured output with drafts: drafts the grammar rejects are cut before they are verified, the positions
    after accepted drafts are masked by the grammar's state after them, and every answer is the answer without
    drafts (seeded sampling, so the grammar's choices vary), valid JSON."""
    from config import Config
    from guided.grammars import compiler_for, schema_grammar
    from models.runtime import HFEngine
    from scripts.make_test_model import build_checkpoint

    model = build_checkpoint(str(tmp_path_factory.mktemp("spec_llama")), shape="tiny", seed=0, arch="llama")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    cfg = Config(model_id=model, max_batch_size=4, kv_block_size=4, max_num_batched_tokens=8, num_threads=1)
    grammar = schema_grammar(schema)
    runs, cut = [], 0
    answers: dict = {}
    for spec in (None, SPEC):
        engine = HFEngine(cfg)
        if spec:
            engine.planner.speculative, engine.planner.spec_disable_batch_size = spec, 0
            untimed_drafts(engine)
            oracle = Oracle(answers, engine.vocab_size)
            validated = []

            class Recording:
                def propose(self, seq, params, k):
                    drafts = oracle.propose(seq, params, k)
                    validated.append((len(drafts), seq.grammar.valid_prefix(drafts)))
                    return drafts

            engine.planner.proposers["ngram"] = Recording()
        prompt = engine.encode("A person as JSON:")
        seqs = []
        for i in range(3):
            seq = Sequence(prompt + [i + 5], 60, sampling=SamplingParams(temperature=1.0, seed=i))
            seq.grammar = compiler_for(engine).matcher(grammar)
            seqs.append(seq)
        schedule_all(engine, seqs)
        runs.append(seqs)
        if spec is None:
            answers.update({tuple(s.prompt_token_ids): s.output_token_ids for s in seqs})
        else:
            cut = sum(n - ok for n, ok in validated)
            assert engine.planner.spec.num_accepted_tokens > 0
    for a, b in zip(*runs):
        assert b.output_token_ids == a.output_token_ids
        assert b.finish_reason == a.finish_reason == "stop"
        json.loads(engine.decode(b.output_token_ids))
    assert cut > 0, "no draft was cut by the grammar"
