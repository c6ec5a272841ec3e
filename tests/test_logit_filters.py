"""core/logit_filters.py: the penalties' exact arithmetic (repetition over prompt + output, then frequency and
presence over output), against a dense reference at a full vocabulary."""

from __future__ import annotations

import random

import numpy as np
import pytest

from core.logit_filters import apply_penalties
from core.sampling_params import SamplingParams

from conftest import randn

SP = SamplingParams

ROW = [2.0, -1.0, 0.5, 3.0, 0.0, -4.0]


PROMPT = [0, 4, 5, 5]


OUTPUT = [1, 1, 2, 0]


@pytest.mark.parametrize(
    "kwargs, want",
    [
        # repetition over prompt + output (each token once): positive / 2, negative x 2
        ({"repetition_penalty": 2.0}, [1.0, -2.0, 0.25, 3.0, 0.0, -8.0]),
        ({"repetition_penalty": 0.5}, [4.0, -0.5, 1.0, 3.0, 0.0, -2.0]),
        # frequency over output only: token 1 twice, tokens 0 and 2 once
        ({"frequency_penalty": 0.5}, [1.5, -2.0, 0.0, 3.0, 0.0, -4.0]),
        ({"frequency_penalty": -1.0}, [3.0, 1.0, 1.5, 3.0, 0.0, -4.0]),
        # presence over output only: once per distinct token
        ({"presence_penalty": 0.25}, [1.75, -1.25, 0.25, 3.0, 0.0, -4.0]),
        # repetition first, then frequency, then presence
        (
            {"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.25},
            [1.0 - 0.5 - 0.25, -2.0 - 1.0 - 0.25, 0.25 - 0.5 - 0.25, 3.0, 0.0, -8.0],
        ),
    ],
)
def test_penalties_exact(kwargs, want):
    logits = np.array([ROW, ROW], dtype=np.float32)
    logits.flags.writeable = False  # never written
    got = apply_penalties(logits, [SP(**kwargs), SP()], [PROMPT, PROMPT], [OUTPUT, OUTPUT])
    assert got.dtype == np.float32 and got.flags.c_contiguous
    assert got[0].tolist() == want
    assert got[1].tolist() == ROW  # the batchmate without penalties is untouched


def test_penalties_match_a_dense_reference_at_full_vocab():
    vocab = 50257
    logits = randn(9, 32, vocab)
    rng = random.Random(1)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 300))] for _ in range(32)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 60))] for _ in range(32)]
    params = [
        SP(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2) if i % 3 else SP() for i in range(32)
    ]
    got = apply_penalties(logits, params, prompts, outputs)
    want = logits.copy()
    for i, p in enumerate(params):  # the dense reference, row by row, in float32
        if not p.has_penalties:
            continue
        seen = np.zeros(vocab, dtype=bool)
        seen[prompts[i] + outputs[i]] = True
        r = want[i]
        rp, freq, pres = (np.full(vocab, v, np.float32) for v in (1.3, 0.2, 0.4))
        r = np.where(seen, np.where(r > 0, r / rp, r * rp), r)
        counts = np.bincount(outputs[i], minlength=vocab).astype(np.float32)
        r = r - freq * counts
        r = r - pres * (counts > 0).astype(np.float32)
        want[i] = r
    assert np.array_equal(got, want)
