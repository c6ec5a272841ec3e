"""Sampling on a real (tiny, locally built) model, end to end through HFEngine: every sampling field
against Hugging Face's own logits processors, and numeric isolation of rows.

- Greedy with ``repetition_penalty`` equals HF ``generate(repetition_penalty=...)`` (HF's
  RepetitionPenaltyLogitsProcessor); OpenAI presence/frequency penalties equal ``generate`` with a
  processor that applies the documented formula; per-request ``stop_token_ids`` equal ``generate``
  with those ids as EOS.
- ``top_k=1``, ``min_p=1`` and a tiny ``top_p`` at temperature 1 leave one candidate: they equal HF
  greedy. With wider ``top_k``/``top_p``/``min_p``, every sampled token lies in the support that HF's
  TopK/TopP/MinP warpers leave on HF's own logits for that prefix.
- No sampling parameter within the accepted ranges gives a NaN, an inf or an invalid token (property
  test over the ranges, extremes included, in mixed batches); a row whose logits turn non-finite fails
  alone with a stable message while its batchmates go on.
"""

from __future__ import annotations

import random

import pytest

from conftest import PROMPTS, Reference, drive, seqs_for

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from config import Config  # noqa: E402
from core.sampling import SamplingParams  # noqa: E402
from core.sequence import Sequence, SequenceStatus  # noqa: E402
from models.model_engine import NON_FINITE_LOGITS  # noqa: E402
from models.runtime import HFEngine  # noqa: E402

pytestmark = pytest.mark.model

SP = SamplingParams


@pytest.fixture(scope="module")
def ref(tiny_model_dir) -> Reference:
    return Reference(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> HFEngine:
    return HFEngine(Config(model_id=tiny_model_dir, max_batch_size=8, num_threads=2))


def run_engine(engine: HFEngine, seqs: list[Sequence]) -> None:
    engine.reset()
    drive(engine, [(0, seqs)])


def hf_greedy(ref: Reference, prompt: list[int], n: int, stops: set[int] = frozenset(), **generate_kw) -> list[int]:
    """HF ``generate(do_sample=False)`` with its own processors for ``generate_kw``."""
    from models.hf_baseline import trim

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = ref.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=sorted(stops) or None,
            pad_token_id=0,
            **generate_kw,
        )
    return trim(out[0, len(prompt) :].tolist(), n, set(stops))


class OpenAIPenalties(transformers.LogitsProcessor):
    """OpenAI's documented presence/frequency penalties over the generated tokens only (HF has none)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        for row in range(scores.shape[0]):
            out = input_ids[row, self.prompt_len :]
            if out.numel():
                ids, counts = out.unique(return_counts=True)
                scores[row, ids] -= self.frequency * counts.to(scores.dtype) + self.presence
        return scores


# --- every sampling field against HF ------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [0.5, 1.3, 3.0])
def test_repetition_penalty_matches_hf(engine, ref, penalty):
    seqs = seqs_for(ref, PROMPTS, [12] * len(PROMPTS), ignore_eos=True, sampling=SP(repetition_penalty=penalty))
    run_engine(engine, seqs)
    for s in seqs:
        assert s.output_token_ids == hf_greedy(ref, s.prompt_token_ids, 12, repetition_penalty=penalty)


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 2.0), (-2.0, 0.7)])
def test_presence_and_frequency_penalties_match_the_formula_in_hf_generate(engine, ref, presence, frequency):
    sampling = SP(presence_penalty=presence, frequency_penalty=frequency)
    seqs = seqs_for(ref, PROMPTS, [12] * len(PROMPTS), ignore_eos=True, sampling=sampling)
    run_engine(engine, seqs)
    for s in seqs:
        procs = transformers.LogitsProcessorList([OpenAIPenalties(s.prompt_len, presence, frequency)])
        assert s.output_token_ids == hf_greedy(ref, s.prompt_token_ids, 12, logits_processor=procs)


def test_per_request_stop_token_ids_match_hf_eos(engine, ref):
    """Each request stops on its own ids (taken from its real greedy output), as HF does with them as EOS."""
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        ids = ref.encode(prompt)
        probe = hf_greedy(ref, ids, 12)
        stop = {probe[3 + i % 5]}
        seqs.append(Sequence(prompt_token_ids=ids, max_new_tokens=12, stop_token_ids=frozenset(stop)))
    run_engine(engine, seqs)
    for s in seqs:
        stops = set(s.stop_token_ids)  # the request's ids plus the checkpoint's EOS, joined by the engine
        assert stops >= ref.eos
        assert s.output_token_ids == hf_greedy(ref, s.prompt_token_ids, 12, stops)
        assert s.finish_reason == "stop" and len(s.output_token_ids) <= 8


@pytest.mark.parametrize(
    "sampling",
    [SP(temperature=1.0, top_k=1, seed=1), SP(temperature=1.5, min_p=1.0), SP(temperature=1.0, top_p=1e-9)],
    ids=["top_k=1", "min_p=1", "top_p=1e-9"],
)
def test_single_candidate_filters_equal_hf_greedy(engine, ref, sampling):
    seqs = seqs_for(ref, PROMPTS, [10] * len(PROMPTS), ignore_eos=True, sampling=sampling)
    run_engine(engine, seqs)
    for s in seqs:
        assert s.output_token_ids == hf_greedy(ref, s.prompt_token_ids, 10)


@pytest.mark.parametrize(
    "sampling, warpers",
    [
        (SP(temperature=1.0, top_k=5, seed=3), lambda: [transformers.TopKLogitsWarper(5)]),
        (
            SP(temperature=0.8, top_p=0.6, seed=4),
            lambda: [transformers.TemperatureLogitsWarper(0.8), transformers.TopPLogitsWarper(0.6)],
        ),
        (
            SP(temperature=1.2, min_p=0.2, seed=5),
            lambda: [transformers.TemperatureLogitsWarper(1.2), transformers.MinPLogitsWarper(0.2)],
        ),
    ],
    ids=["top_k", "top_p", "min_p"],
)
def test_sampled_tokens_stay_in_hfs_warped_support(engine, ref, sampling, warpers):
    """Each sampled token keeps a finite score under HF's warpers applied to HF's logits for its prefix."""
    seqs = seqs_for(ref, PROMPTS, [10] * len(PROMPTS), ignore_eos=True, sampling=sampling)
    run_engine(engine, seqs)
    procs = transformers.LogitsProcessorList(warpers())
    widths = []
    for s in seqs:
        for i, token in enumerate(s.output_token_ids):
            ids = torch.tensor([s.prompt_token_ids + s.output_token_ids[:i]])
            with torch.inference_mode():
                scores = procs(ids, ref.model(ids).logits[:, -1, :].float())
            support = torch.isfinite(scores[0]) & (scores[0] > -1e30)
            widths.append(int(support.sum()))
            assert support[token], (s.prompt_token_ids, i, token)
    assert max(widths) > 1  # the filters left a real choice somewhere: the check is not greedy in disguise


# --- numeric isolation --------------------------------------------------------------------------------


def test_repetition_penalty_near_zero_with_top_p_is_valid_and_isolated(engine, ref):
    """The reported case (1e-38, temperature 1, top_p 0.9 failed the whole batch with "index -1 is out of
    bounds"): now valid tokens for that row, and its batchmates match greedy HF."""
    bad = SP(repetition_penalty=1e-38, temperature=1.0, top_p=0.9, seed=0)
    victims = seqs_for(ref, PROMPTS[:3], [12] * 3, ignore_eos=True, sampling=bad)
    others = seqs_for(ref, PROMPTS[3:], [12] * 3, ignore_eos=True)
    run_engine(engine, victims + others)
    for s in victims:
        assert s.finish_reason == "length" and len(s.output_token_ids) == 12
        assert all(0 <= t < engine.vocab_size for t in s.output_token_ids)
    for s in others:
        assert s.finish_reason == "length" and s.output_token_ids == hf_greedy(ref, s.prompt_token_ids, 12)


EXTREMES = {
    "temperature": [0.0, 1e-5, 1e-3, 1.0, 100.0],
    "top_p": [1e-12, 0.5, 1.0],
    "top_k": [0, 1, 7, 10**9],
    "min_p": [0.0, 1e-12, 0.5, 1.0],
    "repetition_penalty": [1e-300, 1e-38, 0.5, 1.0, 100.0],
    "presence_penalty": [-2.0, 0.0, 2.0],
    "frequency_penalty": [-2.0, 0.0, 2.0],
    "seed": [None, 0, 2**63 - 1],
}


def random_params(rng: random.Random) -> SamplingParams:
    """Each field an extreme of its range or a random value inside it."""

    def pick(name, lo, hi, log=False):
        if rng.random() < 0.6:
            return rng.choice(EXTREMES[name])
        return 10 ** rng.uniform(lo, hi) if log else rng.uniform(lo, hi)

    return SP(
        temperature=pick("temperature", -5, 2, log=True),
        top_p=min(1.0, pick("top_p", -12, 0, log=True)),
        top_k=rng.choice(EXTREMES["top_k"]) if rng.random() < 0.6 else rng.randint(0, 2000),
        min_p=pick("min_p", 0, 1),
        repetition_penalty=pick("repetition_penalty", -300, 2, log=True),
        presence_penalty=pick("presence_penalty", -2, 2),
        frequency_penalty=pick("frequency_penalty", -2, 2),
        seed=rng.choice(EXTREMES["seed"]) if rng.random() < 0.5 else rng.randint(0, 2**63 - 1),
    )


def test_property_random_parameters_across_the_ranges_give_valid_tokens(engine, ref):
    """Mixed batches of random parameters (extremes included): every sequence runs to its budget with
    tokens in [0, vocab), none fails, and greedy batchmates are unaffected."""
    rng = random.Random(11)
    for round_no in range(6):
        params = [random_params(rng) for _ in range(6)]
        seqs = [
            Sequence(prompt_token_ids=ref.encode(rng.choice(PROMPTS)), max_new_tokens=8, ignore_eos=True, sampling=p)
            for p in params
        ]
        control = seqs_for(ref, [PROMPTS[round_no % len(PROMPTS)]], [8], ignore_eos=True)
        run_engine(engine, seqs + control)
        for s in seqs:
            assert s.finish_reason == "length", (s.sampling, s.error)
            assert len(s.output_token_ids) == 8 and all(0 <= t < engine.vocab_size for t in s.output_token_ids), s
        assert control[0].output_token_ids == hf_greedy(ref, control[0].prompt_token_ids, 8)


def test_non_finite_logits_fail_that_row_alone(tiny_model_dir, ref, monkeypatch):
    """A row whose logits turn NaN (as a broken kernel or weight would make them) finishes FINISHED_ERROR
    with a stable message; the other rows of the same steps go on and match HF."""
    engine = HFEngine(Config(model_id=tiny_model_dir, max_batch_size=4, num_threads=2))
    seqs = seqs_for(ref, PROMPTS[:4], [10] * 4, ignore_eos=True)
    poisoned = seqs[1]
    forward = engine.model.forward

    def poisoning_forward(*args, **kwargs):
        logits = forward(*args, **kwargs).copy()  # numpy logits [rows, vocab]; a view of the step's buffer
        if poisoned.status is SequenceStatus.RUNNING and len(poisoned.output_token_ids) == 3:
            row = engine.planner.rows.index(poisoned)
            logits[row, 5] = float("nan")
        return logits

    monkeypatch.setattr(engine.model, "forward", poisoning_forward)
    drive(engine, [(0, seqs)])
    assert poisoned.status is SequenceStatus.FINISHED_ERROR and poisoned.error == NON_FINITE_LOGITS
    assert len(poisoned.output_token_ids) == 3
    for s in seqs:
        if s is not poisoned:
            assert s.finish_reason == "length" and s.output_token_ids == hf_greedy(ref, s.prompt_token_ids, 10)
    assert engine.num_active() == 0
