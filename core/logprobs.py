"""Logprobs: the chosen token's and the top-k of each row, from the raw logits' log_softmax (numpy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from core.sampling_params import _is_int
from core.top_tokens import _take, _top


class TokenLogprobs(NamedTuple):
    token_id: int
    logprob: float  # of token_id
    # The k most likely (token_id, logprob), most likely first. Tuples all the way down: the garbage collector
    # untracks them, so the hundreds of thousands a scored prompt keeps cost full collections nothing.
    top: tuple[tuple[int, float], ...]


def logprobs(logits: np.ndarray, chosen: Sequence[int] | np.ndarray, k: int = 0) -> list[TokenLogprobs]:
    """Per row: the chosen token's logprob and the top-k (token, logprob), from the raw logits' log_softmax.

    The log-sum-exp is one pass of float32 exponentials summed in float64; only the values returned are
    formed (in float64), not a log_softmax of the whole row. Equal values in the top-k are listed by token id.
    """
    logits = np.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [N, V], got shape {logits.shape}")
    if not _is_int(k) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")
    n, vocab = logits.shape
    ids = np.asarray(chosen, dtype=np.int64).reshape(-1)
    if ids.size != n:
        raise ValueError(f"{ids.size} chosen tokens for {n} rows of logits")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"chosen token ids must be in [0, {vocab})")
    x = np.asarray(logits, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):  # a NaN or +inf row gives NaN logprobs, as log_softmax
        m = x.max(axis=1, keepdims=True) if vocab else np.zeros((n, 1), np.float32)
        lse = m.astype(np.float64) + np.log(np.exp(x - m).sum(axis=1, keepdims=True, dtype=np.float64))

        def at(index: np.ndarray) -> np.ndarray:  # [n, j] token ids -> their logprobs, float64
            return _take(x, index).astype(np.float64) - lse

        picked = at(ids.reshape(-1, 1))[:, 0].tolist()
        if k == 0:
            return [TokenLogprobs(t, v, ()) for t, v in zip(ids.tolist(), picked)]
        top = np.sort(_top(x, min(k, vocab))[1], axis=1)
        top = _take(top, np.argsort(-_take(x, top), axis=1, kind="stable"))  # largest first, equal values by id
        top_v = at(top).tolist()
    return [TokenLogprobs(t, v, tuple(zip(ti, tv))) for t, v, ti, tv in zip(ids.tolist(), picked, top.tolist(), top_v)]
