"""core/logprobs.py against a float64 log_softmax, and core/top_tokens.py's top-``width`` selection against a full
sort."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.logprobs import TokenLogprobs, logprobs
from core.top_tokens import _top, _top_values

from conftest import randn


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    """The float64 reference: log_softmax of the float32 logits, computed in float64."""
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_logprobs():
    logits = randn(10, 3, 50, scale=5)
    logits.flags.writeable = False
    lp = log_softmax64(logits)
    chosen = [4, 0, 49]
    rows = logprobs(logits, chosen, k=3)
    assert all(isinstance(r, TokenLogprobs) for r in rows)
    for i, r in enumerate(rows):
        assert r.token_id == chosen[i] and isinstance(r.token_id, int) and isinstance(r.logprob, float)
        assert r.logprob == pytest.approx(lp[i, chosen[i]], abs=1e-6)
        top_ids = np.argsort(-lp[i])[:3].tolist()
        assert [t for t, _ in r.top] == top_ids
        assert [v for _, v in r.top] == pytest.approx(lp[i, top_ids].tolist(), abs=1e-6)
        assert r.top[0][1] >= r.top[1][1] >= r.top[2][1]
    assert all(r.top == () for r in logprobs(logits, np.array(chosen)))
    full = logprobs(logits, chosen, k=500)
    assert all(len(r.top) == 50 for r in full)
    assert [[t for t, _ in r.top] for r in full] == np.argsort(-lp, axis=-1, kind="stable").tolist()
    with pytest.raises(ValueError):
        logprobs(logits, chosen, k=-1)
    with pytest.raises(ValueError):
        logprobs(logits, [1, 2])
    with pytest.raises(ValueError, match="chosen"):
        logprobs(logits, [1, 2, 50])
    with pytest.raises(ValueError, match="chosen"):
        logprobs(logits, [1, -1, 2])


def test_logprobs_at_full_vocab_and_masked_tokens():
    """A 50k vocabulary (the grouped top-k selection), large logits and -inf tokens, against float64."""
    logits = randn(11, 5, 50257, scale=8)
    logits[2, :40000] = -np.inf
    logits[3, [5, 77, 30000]] = logits[3].max() + 2  # tied at the top: listed by id
    lp = log_softmax64(logits)
    chosen = [0, 1, 45000, 77, 50256]
    rows = logprobs(logits, chosen, k=20)
    for i, r in enumerate(rows):
        assert r.logprob == pytest.approx(lp[i, chosen[i]], abs=1e-5)
        want = np.argsort(-lp[i], kind="stable")[:20].tolist()
        assert [t for t, _ in r.top] == want
        assert [v for _, v in r.top] == pytest.approx(lp[i, want].tolist(), abs=1e-5)
    assert [t for t, _ in rows[3].top[:3]] == [5, 77, 30000]
    assert logprobs(logits[2:3], [0])[0].logprob == -math.inf


@pytest.mark.parametrize("vocab", [7, 300, 4099, 50257])
@pytest.mark.parametrize("width", [1, 3, 40, 256, 2048])
def test_top_selection_equals_a_full_sort(vocab, width):
    """``_top`` / ``_top_values`` (strided groups, then a partition of the candidates) give exactly the largest
    values of each row, on ragged vocabularies, with ties and -inf, whatever the width."""
    x = randn(vocab + width, 5, vocab, scale=2)
    x[1] = np.round(x[1])  # many ties
    x[2, ::2] = -np.inf
    x[3] = 0.0  # all tied
    x[4, : vocab // 2] = np.sort(x[4, : vocab // 2])  # sorted runs: the top sits in a few neighbouring ids
    w = min(width, vocab)
    want = -np.sort(-x, axis=1)[:, :w]
    vals, idx = _top(x, width)
    assert np.array_equal(vals, want) and np.array_equal(np.take_along_axis(x, idx, 1), vals)
    assert all(len(set(row)) == w for row in idx.tolist())  # distinct ids
    assert np.array_equal(_top_values(x, width), want)
