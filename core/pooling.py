"""Embeddings: a prompt's final hidden states (after the final norm) pooled into one L2-normalized vector, as its
chunks are computed. numpy only; no torch.

An embedding is a ``Sequence`` with ``pooling`` set ("mean" or "last", ``EMBEDDING_POOLING``) and no tokens to
generate: the planner schedules its prompt in chunks like any other and finishes it after the last one
(``core/planner.py``); the engine asks the runner for the chunk's final hidden states instead of logits and folds
them in here (``pool_chunk``), so the model runs once, in the same batches as generation. ``Sequence.embedding``
holds the running state (``PoolState``) until the last chunk, then the vector (float32 [C]), or a ``RowFailure``
when it is not finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.step import RowFailure

POOLINGS = ("mean", "last")
NON_FINITE_EMBEDDING = "the model's hidden states for this input were not finite (NaN or inf)"


@dataclass
class PoolState:
    """What the chunks computed so far leave: the sum of their rows (float64 [C], for the mean) and the last row."""

    total: np.ndarray | None = None
    count: int = 0
    last: np.ndarray | None = None


def pool_chunk(seq, rows: np.ndarray, start: int, end: int) -> None:
    """Fold ``rows`` [end - start, C], ``seq``'s final hidden states at positions [start, end), into its embedding;
    the chunk that ends the prompt leaves the vector (``finish_pooling``). A chunk from position 0 starts over (a
    sequence recomputed after a preemption)."""
    if start == 0 or not isinstance(seq.embedding, PoolState):
        seq.embedding = PoolState()
    state = seq.embedding
    if seq.pooling == "mean":
        summed = rows.sum(axis=0, dtype=np.float64)
        state.total = summed if state.total is None else state.total + summed
        state.count += len(rows)
    state.last = rows[-1].astype(np.float64)
    if end == seq.num_tokens:
        seq.embedding = finish_pooling(state, seq.pooling)


def finish_pooling(state: PoolState, pooling: str) -> np.ndarray | RowFailure:
    """The pooled vector, L2-normalized (a zero vector stays zero), as float32; a RowFailure when not finite."""
    vector = state.total / state.count if pooling == "mean" else state.last
    if not np.all(np.isfinite(vector)):
        return RowFailure(NON_FINITE_EMBEDDING)
    norm = float(np.linalg.norm(vector))
    return (vector / norm if norm > 0 else vector).astype(np.float32)
