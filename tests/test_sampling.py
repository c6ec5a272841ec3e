"""core/sampling.py (numpy, no torch): call shapes, greedy equivalences, seeded reproducibility independent of
batchmates, the top-k/top-p/min-p supports, distribution sanity, numeric extremes and read-only inputs (the
parameters' validation, the penalties' arithmetic, logprobs and the top-``width`` selection have their own files:
test_sampling_params.py, test_logit_filters.py, test_logprobs.py).

Everything is statistical only with fixed seeds and generous tolerances; nothing is timed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from core import sampling
from core.sampling import (
    TOP_P_WINDOWS,
    NonFiniteLogits,
    SamplingParams,
    apply_penalties,
    apply_token_bitmask,
    logprobs,
    sample,
    seeded_uniform,
)

from conftest import randn

SP = SamplingParams


def log_probs(probs: list[float]) -> np.ndarray:
    """One row of logits whose softmax is ``probs``: [1, len(probs)] float32."""
    return np.log(np.array(probs, dtype=np.float64)).astype(np.float32)[None, :]


def draws(logits_row: np.ndarray, params: SamplingParams, n: int, first_seed: int = 0) -> list[int]:
    """``n`` samples of one row: n rows in one batch, seeds first_seed.. (step 0)."""
    rows = np.repeat(logits_row, n, axis=0)
    ps = [dataclasses.replace(params, seed=first_seed + i) for i in range(n)]
    return sample(rows, ps, output_ids=[[]] * n)


# --- call shapes ----------------------------------------------------------------------------


def test_call_shape_errors():
    logits = randn(0, 2, 10)
    with pytest.raises(ValueError, match="SamplingParams"):
        sample(logits, [SP()])
    with pytest.raises(ValueError, match="output_ids"):
        sample(logits, [SP(temperature=1.0, seed=1), SP()])
    with pytest.raises(ValueError, match="output_ids"):
        sample(logits, [SP(), SP()], output_ids=[[]])
    with pytest.raises(ValueError, match="token ids"):
        sample(logits, [SP(frequency_penalty=1.0), SP()], [[1], [2]], [[10], []])
    with pytest.raises(ValueError, match="prompt_ids"):
        sample(logits, [SP(repetition_penalty=1.2), SP()], None, [[1], []])
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        sample(logits[0], [SP()])
    assert sample(np.empty((0, 10), np.float32), []) == []


# --- greedy ---------------------------------------------------------------------------------


def test_temperature_zero_is_exactly_argmax():
    logits = randn(0, 16, 5000, scale=4)
    logits[3, [10, 20]] = logits[3].max() + 1  # a tie at the top: the first id, like argmax
    assert sample(logits, [SP()] * 16) == logits.argmax(axis=-1).tolist()
    assert sample(logits, [None] * 16) == logits.argmax(axis=-1).tolist()
    assert sample(logits, [SP()] * 16)[3] == 10
    # Greedy rows inside a batch of sampled rows are still the plain argmax.
    mixed = [SP() if i % 2 else SP(temperature=1.0, top_p=0.9, seed=i) for i in range(16)]
    got = sample(logits, mixed, output_ids=[[]] * 16)
    want = logits.argmax(axis=-1).tolist()
    assert [got[i] for i in range(1, 16, 2)] == [want[i] for i in range(1, 16, 2)]
    for dtype in (np.float16, np.float64):  # other float dtypes are accepted
        other = logits.astype(dtype)
        assert sample(other, [SP()] * 16) == other.argmax(axis=-1).tolist()
        assert sample(other, mixed, output_ids=[[]] * 16) == sample(other.astype(np.float32), mixed, None, [[]] * 16)


def test_top_k_one_equals_greedy():
    for step in range(5):
        logits = randn(step, 8, 3000, scale=2)
        params = [SP(temperature=t, top_k=1, seed=s) for t, s in zip([0.5, 1, 2, 5] * 2, [None, 3] * 4)]
        assert sample(logits, params, output_ids=[[0] * step] * 8) == logits.argmax(axis=-1).tolist()


def test_greedy_with_penalties_is_argmax_of_penalized_logits():
    logits = np.array([[3.0, 2.0, -1.0], [3.0, 2.0, -1.0]], dtype=np.float32)
    params = [SP(repetition_penalty=2.0), SP()]
    # Row 0 has generated token 0: 3.0 / 2 = 1.5 < 2.0, so token 1 wins; row 1 has no penalty.
    assert sample(logits, params, [[2], [2]], [[0], [0]]) == [1, 0]
    assert sample(logits, [SP(frequency_penalty=0.6), SP()], [[], []], [[0, 0], [0, 0]]) == [1, 0]


# --- seeding --------------------------------------------------------------------------------


def step_logits(step: int, vocab: int) -> np.ndarray:
    """The target row's logits at a step [V]: a fixed function of the step, peaked or flat in turn."""
    return randn(1000 + step, vocab, scale=(0.3, 1.0, 3.0, 8.0)[step % 4])


def random_params(rng: random.Random) -> SamplingParams:
    return SP(
        temperature=rng.choice([0.0, 0.3, 1.0, 1.7]),
        top_p=rng.choice([1.0, 0.5, 0.9, 0.99]),
        top_k=rng.choice([0, 0, 1, 7, 50, 400]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3]),
        presence_penalty=rng.choice([0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, -0.4]),
        seed=rng.choice([None, rng.randrange(2**63)]),
    )


TARGETS = {
    "temperature": SP(temperature=1.0, seed=42),
    "top_k": SP(temperature=0.9, top_k=40, seed=7),
    "top_k_top_p": SP(temperature=1.2, top_k=300, top_p=0.8, seed=2**63 - 1),
    "top_p": SP(temperature=1.0, top_p=0.9, seed=0),
    "top_p_wide": SP(temperature=2.0, top_p=0.99, seed=5),
    "min_p": SP(temperature=1.5, min_p=0.05, seed=11),
    "everything": SP(
        temperature=0.8,
        top_k=100,
        top_p=0.95,
        min_p=0.01,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        seed=123,
    ),
    "penalties_no_top_k": SP(temperature=1.1, top_p=0.97, repetition_penalty=1.5, frequency_penalty=1.0, seed=9),
}


def generate(target: SamplingParams, vocab: int, steps: int, rng: random.Random | None) -> list[int]:
    """The target's tokens over ``steps``: alone when rng is None, else among random batchmates."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out: list[int] = []
    for step in range(steps):
        row = step_logits(step, vocab)
        if rng is None:
            out.append(sample(row[None, :], [target], [prompt], [list(out)])[0])
            continue
        n = rng.randint(1, 7)
        pos = rng.randrange(n + 1)
        logits = randn(rng.randrange(2**31), n + 1, vocab, scale=rng.choice([0.5, 2, 6]))
        logits[pos] = row
        params = [random_params(rng) for _ in range(n + 1)]
        params[pos] = target
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 20))] for _ in range(n + 1)]
        outputs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 30))] for _ in range(n + 1)]
        prompts[pos], outputs[pos] = prompt, list(out)
        out.append(sample(logits, params, prompts, outputs, generator=np.random.default_rng(rng.randrange(99)))[pos])
    return out


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_seed_gives_same_tokens_alone_or_in_any_batch(name):
    target, vocab, steps = TARGETS[name], 3000, 16
    alone = generate(target, vocab, steps, None)
    assert generate(target, vocab, steps, None) == alone  # a fixed seed repeats
    for trial in range(2):
        assert generate(target, vocab, steps, random.Random(trial)) == alone, trial
    assert len(set(alone)) > 3  # it really sampled


def test_seed_independent_of_batchmates_at_full_vocab():
    vocab = 50257
    row = randn(3, vocab, scale=3)
    targets = [
        SP(temperature=1.0, top_p=0.9, seed=1),
        SP(temperature=0.7, top_k=50, seed=2),
        SP(temperature=1.3, seed=3),
    ]
    alone = [sample(row[None, :], [t], output_ids=[[0] * 5])[0] for t in targets]
    rng = random.Random(0)
    mates = [random_params(rng) for _ in range(9)]
    logits = randn(4, 12, vocab, scale=2)
    logits[[2, 5, 11]] = row
    params = mates[:2] + [targets[0]] + mates[2:4] + [targets[1]] + mates[4:9] + [targets[2]]
    outputs = [[rng.randrange(vocab) for _ in range(5)] for _ in range(12)]
    got = sample(logits, params, [[1, 2]] * 12, outputs)
    assert [got[2], got[5], got[11]] == alone
    assert all(0 <= t < vocab for t in got)


def test_different_seeds_differ():
    vocab, steps = 3000, 20
    runs = [generate(SP(temperature=1.0, seed=s), vocab, steps, None) for s in (1, 2, 3)]
    assert runs[0] != runs[1] and runs[1] != runs[2] and runs[0] != runs[2]
    row = step_logits(0, vocab)  # flat: many tokens are likely
    assert len(set(draws(row[None, :], SP(temperature=1.0), 50))) > 25


def test_seeded_uniform_is_a_pure_function():
    us = [seeded_uniform(s, t) for s in (0, 1, 2**63 - 1) for t in range(200)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert us == [seeded_uniform(s, t) for s in (0, 1, 2**63 - 1) for t in range(200)]
    assert len(set(us)) == len(us)
    assert abs(sum(us) / len(us) - 0.5) < 0.05


def test_seed_step_is_number_of_generated_tokens():
    logits = randn(4, 1, 500, scale=0.5)
    p = SP(temperature=1.0, seed=77)
    at = [sample(logits, [p], output_ids=[range(k)])[0] for k in range(30)]
    assert len(set(at)) > 10  # a new number each step
    assert at == [sample(logits, [p], output_ids=[[9] * k])[0] for k in range(30)]  # only the count matters


def test_unseeded_rows_use_the_generator(monkeypatch):
    logits = randn(5, 6, 1000, scale=0.5)
    params = [SP(temperature=1.0)] * 6
    a = sample(logits, params, generator=np.random.default_rng(1))
    assert a == sample(logits, params, generator=np.random.default_rng(1))
    assert a != sample(logits, params, generator=np.random.default_rng(2))
    # Without one, the module's generator feeds them.
    monkeypatch.setattr(sampling, "_DEFAULT_RNG", np.random.default_rng(1))
    assert sample(logits, params) == a
    assert sample(logits, params) != a  # it moved on


# --- filtering ------------------------------------------------------------------------------

FOUR = [0.5, 0.25, 0.15, 0.1]


@pytest.mark.parametrize(
    "top_p, support",
    [(0.4, {0}), (0.6, {0, 1}), (0.8, {0, 1, 2}), (0.95, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})],
)
@pytest.mark.parametrize("top_k", [0, 3, 4])
def test_top_p_support(top_p, support, top_k):
    if top_k == 3:  # top-p then sees the mass of the top-3 survivors: 0.5/0.9, 0.75/0.9, 1
        support = {0} if top_p < 0.5 / 0.9 else {0, 1} if top_p < 0.75 / 0.9 else {0, 1, 2}
    logits = np.concatenate([log_probs(FOUR), np.full((1, 6), -30.0, np.float32)], axis=1)  # 6 ~impossible extras
    got = draws(logits, SP(temperature=1.0, top_p=top_p, top_k=top_k), 600)
    assert set(got) == support


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.9, 0.95, 0.999])
def test_top_p_nucleus_on_a_wide_distribution(top_p):
    """Nearly flat, strictly decreasing probabilities: the nucleus spans hundreds to thousands of
    tokens, so the TOP_P_WINDOWS escalation and the full sort are both exercised; the vocabulary
    is shuffled so the nucleus is not a prefix of the ids."""
    vocab = 6000
    base = -np.arange(vocab, dtype=np.float64) * 1e-3  # rank r has prob ~ exp(-r / 1000)
    probs = np.exp(base) / np.exp(base).sum()
    cum = probs.cumsum()
    size = int((cum < top_p).sum()) + 1  # the smallest prefix whose mass reaches top_p
    perm = np.random.default_rng(6).permutation(vocab)
    logits = np.empty(vocab, np.float32)
    logits[perm] = base  # token perm[r] has rank r
    rank = np.empty(vocab, dtype=np.int64)
    rank[perm] = np.arange(vocab)
    got = draws(logits[None, :], SP(temperature=1.0, top_p=top_p), 300)
    ranks = [int(rank[t]) for t in got]
    assert max(ranks) < size + 2  # never outside the nucleus (one token of float slack)
    assert max(ranks) > size * 0.5  # and the nucleus is in play, not just its head
    if size > TOP_P_WINDOWS[-1]:
        assert max(ranks) > TOP_P_WINDOWS[-1]  # the full-sort path was taken and sampled from


@pytest.mark.parametrize(
    "min_p, support",
    [(0.0, {0, 1, 2, 3}), (0.19, {0, 1, 2, 3}), (0.25, {0, 1, 2}), (0.4, {0, 1}), (0.6, {0}), (1.0, {0})],
)
@pytest.mark.parametrize("top_k", [0, 10])
def test_min_p_support(min_p, support, top_k):
    logits = np.concatenate([log_probs(FOUR), np.full((1, 6), -30.0, np.float32)], axis=1)  # 6 ~impossible extras
    got = draws(logits, SP(temperature=1.0, min_p=min_p, top_k=top_k), 600)
    assert set(got) == support


@pytest.mark.parametrize("k", [1, 2, 5, 40])
def test_top_k_support(k):
    vocab = 1000
    logits = randn(8, 1, vocab)
    top = set(np.argsort(-logits[0])[:k].tolist())
    got = draws(logits, SP(temperature=20.0, top_k=k), 800)  # hot: every survivor is likely
    assert set(got) <= top
    if k <= 5:
        assert set(got) == top
    else:
        assert len(set(got)) > k // 2
    assert len(set(draws(logits, SP(temperature=20.0, top_k=vocab + 5), 200))) > 100  # k >= V: off


def test_top_k_keeps_ties_at_the_boundary():
    logits = np.array([[5.0, 4.0, 4.0, 4.0, 1.0, 0.0]], dtype=np.float32)
    assert set(draws(logits, SP(temperature=3.0, top_k=2), 400)) == {0, 1, 2, 3}


# --- distributions --------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_seeded_draws_match_the_distribution(temperature):
    probs = [0.6, 0.3, 0.1]
    scaled = [p ** (1 / temperature) for p in probs]
    want = [s / sum(scaled) for s in scaled]
    n = 4000
    got = draws(log_probs(probs), SP(temperature=temperature), n, first_seed=10_000)
    for token in range(3):
        assert abs(got.count(token) / n - want[token]) < 0.03, (token, got.count(token))


def test_one_seed_over_steps_matches_the_distribution():
    probs = [0.6, 0.3, 0.1]
    n = 3000
    logits = np.repeat(log_probs(probs), n, axis=0)
    got = sample(logits, [SP(temperature=1.0, seed=5)] * n, output_ids=[range(k) for k in range(n)])
    for token in range(3):
        assert abs(got.count(token) / n - probs[token]) < 0.03


def test_unseeded_draws_match_the_distribution():
    probs = [0.6, 0.3, 0.1]
    n = 4000
    logits = np.broadcast_to(log_probs(probs), (n, 3))  # read only, stride 0: never written, so fine
    got = sample(logits, [SP(temperature=1.0)] * n, generator=np.random.default_rng(3))
    for token in range(3):
        assert abs(got.count(token) / n - probs[token]) < 0.03


def test_never_samples_an_impossible_token():
    logits = np.full((1, 2000), -np.inf, np.float32)
    logits[0, [7, 1500, 1999]] = [0.0, 1.0, 2.0]
    for params in (SP(temperature=1.0), SP(temperature=5.0, top_p=0.999), SP(temperature=5.0, top_k=10)):
        assert set(draws(logits, params, 300)) <= {7, 1500, 1999}


def test_unusable_rows_are_refused_by_index():
    """NaN or +inf anywhere, or a row that is all -inf, names that row; -inf alone is a masked token."""
    logits = np.zeros((5, 10), np.float32)
    logits[1, 3] = math.nan
    logits[2, 0] = math.inf
    logits[3] = -math.inf
    logits[4, :9] = -math.inf
    for params in ([SP()] * 5, [SP(temperature=1.0, top_p=0.5, seed=1)] * 5):
        with pytest.raises(NonFiniteLogits) as info:
            sample(logits, params, None, [[]] * 5)
        assert info.value.rows == [1, 2, 3]
    assert sample(logits[[0, 4]], [SP(), SP(temperature=2.0, seed=3)], None, [[], []])[1] == 9


@pytest.mark.parametrize("penalty", [1e-300, 1e-45, 1e-38, 1e-10, 100.0, 1e300])
@pytest.mark.parametrize("temperature", [0.0, 1e-5, 1.0, 100.0, 1e300])
def test_extreme_penalties_and_temperatures_give_a_valid_token(penalty, temperature):
    """A logit of 1e3 / 1e-38 overflows float32: the result is clamped, so no NaN reaches the draw."""
    logits = randn(2, 3, 300, scale=1e3)
    params = [SP(temperature=temperature, repetition_penalty=penalty, top_p=p, seed=4) for p in (1.0, 0.9, 1e-9)]
    pens = apply_penalties(logits, params, [[1, 2, 3]] * 3, [[4, 5]] * 3)
    assert np.isfinite(pens).all()
    for tok in sample(logits, params, [[1, 2, 3]] * 3, [[4, 5]] * 3):
        assert 0 <= tok < 300


def test_masked_tokens_stay_masked_under_a_vanishing_repetition_penalty():
    """A penalty that underflows float32 to 0 (1e-300) on a prompt token a grammar masked (-inf): -inf x 0 would be
    NaN, which argmax would pick; the token stays -inf and is never chosen."""
    logits = np.full((4, 50), -np.inf, np.float32)
    logits[:, [10, 20]] = [1.0, -2.0]
    params = [SP(repetition_penalty=p, temperature=t, seed=1) for p, t in ((1e-300, 0.0), (1e-300, 1.0), (1e-45, 1.0))]
    params.append(SP(temperature=1.0, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=1e-300))
    prompts = [[0, 1, 10, 20, 49]] * 4
    pens = apply_penalties(logits, params, prompts, [[5, 5]] * 4)
    assert not np.isnan(pens).any()
    assert np.isneginf(pens[:, [0, 1, 5, 49]]).all()  # masked tokens that occurred stay -inf
    for _ in range(5):
        assert set(sample(logits, params, prompts, [[5, 5]] * 4)) <= {10, 20}


# --- numpy specifics: read-only inputs, no torch -------------------------------------


def test_read_only_logits_are_never_written():
    """Every path reads its caller's array (a model's output may be a read-only view) and returns new arrays."""
    logits = randn(12, 6, 3000, scale=2)
    logits[1, :2990] = -np.inf
    before = logits.copy()
    logits.flags.writeable = False
    params = [
        SP(),
        SP(temperature=1.0, seed=1),
        SP(temperature=0.8, top_k=40, top_p=0.9, seed=2, logit_bias=((3, 5.0),)),
        SP(temperature=1.0, top_p=0.5, min_p=0.05, seed=3, repetition_penalty=1.3),
        SP(temperature=1.0, min_p=0.1, frequency_penalty=1.0, presence_penalty=0.5, seed=4),
        SP(temperature=1.0),
    ]
    toks = sample(logits, params, [[1, 2]] * 6, [[3, 4, 4]] * 6, generator=np.random.default_rng(0))
    assert all(0 <= t < 3000 for t in toks) and 2990 <= toks[1] < 3000
    assert sample(logits, [SP(temperature=1.0, seed=s) for s in range(6)], None, [[]] * 6)
    apply_penalties(logits, params, [[1, 2]] * 6, [[3, 4, 4]] * 6)
    logprobs(logits, toks, k=5)
    mask = np.full((1, (3000 + 31) // 32), -1, dtype=np.int32)
    apply_token_bitmask(logits, [2], mask)
    assert np.array_equal(logits, before)


def test_huge_temperature_keeps_masked_tokens_masked():
    """A temperature past float32's range divides as float32's largest number: -inf stays -inf (not NaN)."""
    logits = np.full((2, 100), -np.inf, np.float32)
    logits[:, [3, 50]] = [1.0, 2.0]
    for params in ([SP(temperature=1e300, seed=1)] * 2, [SP(temperature=1e300, top_k=5, top_p=0.5, seed=2)] * 2):
        got = sample(logits, params, None, [[]] * 2)
        assert set(got) <= {3, 50}


def test_sample_runs_without_torch():
    """The torch-free serving path samples: sample, logprobs and the bitmask never import torch."""
    script = (
        "import sys, numpy as np; from core import sampling as s; x = np.zeros((2, 64), np.float32); "
        "p = [s.SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2, seed=1)] * 2; "
        "s.sample(x, p, [[1]] * 2, [[2]] * 2); s.logprobs(x, [1, 2], 3); "
        "s.apply_token_bitmask(x, [0], np.ones((1, 2), np.int32)); print('torch' in sys.modules)"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False"]
