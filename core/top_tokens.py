"""The ``width`` largest logits of each row of a batch [n, V] (numpy) without sorting the vocabulary: the maxima of
strided groups of ids pick the candidates, and only those are partitioned (``_candidates``). Sampling's top-k and
top-p and the top logprobs use it."""

from __future__ import annotations

import math

import numpy as np


def _take(a: np.ndarray, index: np.ndarray) -> np.ndarray:
    return np.take_along_axis(a, index, axis=1)


def _candidates(a: np.ndarray, width: int) -> np.ndarray | None:
    """Ids [n, C] (C < V) among which each row of ``a`` [n, V] has a top ``width`` (width < V), or None when a
    partition of the whole row is as cheap.

    The ids are split into m = V // b strided groups of b (group j: j, j + m, j + 2m, ...); the ``width`` groups
    with the largest maxima hold a top ``width`` (an element of the top outside them is at most each chosen
    group's max, so those maxima already make up ``width`` elements at least as large). b ~ sqrt(V / width)
    balances the two partitions (m groups, then width * b candidates)."""
    n, vocab = a.shape
    b = math.isqrt(vocab // width)
    if b < 4:
        return None
    m = vocab // b  # >= b * width >= width groups
    group_max = a[:, : m * b].reshape(n, b, m).max(axis=1)  # [n, m]: elementwise over b contiguous slices
    groups = np.argpartition(group_max, m - width, axis=1)[:, m - width :]
    cand = (groups[:, :, None] + m * np.arange(b)).reshape(n, -1)  # [n, width * b]
    if m * b < vocab:  # the last V % b ids are in no group: always candidates
        cand = np.concatenate([cand, np.broadcast_to(np.arange(m * b, vocab), (n, vocab - m * b))], axis=1)
    return cand


def _top(a: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``width`` largest values of each row of ``a`` [n, V] and their ids, largest first: [n, width] each
    (ties in any order: callers use the values as thresholds and re-sort the ids)."""
    vocab = a.shape[1]
    if width >= vocab:
        idx = np.argsort(a, axis=1)[:, ::-1]
        return _take(a, idx), idx
    cand = _candidates(a, width)
    if cand is None:
        idx = np.argpartition(a, vocab - width, axis=1)[:, vocab - width :]  # O(V) per row, unordered
    else:
        idx = _take(cand, np.argpartition(_take(a, cand), cand.shape[1] - width, axis=1)[:, -width:])
    idx = _take(idx, np.argsort(_take(a, idx), axis=1)[:, ::-1])
    return _take(a, idx), idx


def _top_values(a: np.ndarray, width: int) -> np.ndarray:
    """The ``width`` largest values of each row of ``a`` [n, V], largest first: C-contiguous [n, width]."""
    vocab = a.shape[1]
    if width >= vocab:
        return np.ascontiguousarray(np.sort(a, axis=1)[:, ::-1])
    cand = _candidates(a, width)
    pool = a if cand is None else _take(a, cand)
    top = np.partition(pool, pool.shape[1] - width, axis=1)[:, -width:]
    return np.ascontiguousarray(np.sort(top, axis=1)[:, ::-1])
