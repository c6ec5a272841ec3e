"""Logit filters that run before a draw, each on a batch's logits [N, V] (numpy): the repetition, frequency and
presence penalties, each row's ``logit_bias``, and the grammar masks of structured output. Penalized logits are
clamped to ``[-LOGIT_LIMIT, LOGIT_LIMIT]`` and a -inf (masked) token stays -inf (``core/sampling.py`` says why)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from core.sampling_params import _GREEDY, SamplingParams

# Largest logit magnitude sampling works with: / GREEDY_TEMPERATURE it stays far inside float32's range.
LOGIT_LIMIT = 1e30
_F32_MAX = float(np.finfo(np.float32).max)


def _f32(values) -> np.ndarray:
    """Python numbers as float32, finite ones past float32's range as its largest finite value (not inf)."""
    a = np.asarray(values, dtype=np.float64)
    return np.where(np.isfinite(a), np.clip(a, -_F32_MAX, _F32_MAX), a).astype(np.float32)


def _col(values, dtype) -> np.ndarray:
    """[n] Python numbers -> an [n, 1] column of ``dtype`` (float32 columns saturate, see ``_f32``)."""
    out = _f32(values) if dtype == np.float32 else np.asarray(values, dtype=dtype)
    return out.reshape(-1, 1)


def _flat_ids(rows: Sequence[int], lists: Sequence[Sequence[Sequence[int]]], vocab: int, what: str) -> np.ndarray:
    """Flat indices ``row * vocab + id`` into an [N, V] array for every id of each row in ``rows`` (int64)."""
    per_row = [list(itertools.chain.from_iterable(src[r] for src in lists)) for r in rows]
    lengths = np.array([len(ids) for ids in per_row], dtype=np.int64)
    ids = np.array(list(itertools.chain.from_iterable(per_row)), dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{what} token ids must be in [0, {vocab}), got {int(ids.min())}..{int(ids.max())}")
    return np.repeat(np.array(rows, dtype=np.int64), lengths) * vocab + ids


def _unique(ids: np.ndarray) -> np.ndarray:
    """``np.unique(ids)`` (sorted), by a sort: numpy 2's hash-based unique takes 3-4x as long on a few hundred ids."""
    ids = np.sort(ids)
    keep = np.empty(ids.size, bool)
    keep[:1] = True
    np.not_equal(ids[1:], ids[:-1], out=keep[1:])
    return ids[keep]


def _clamp(penalized: np.ndarray, before: np.ndarray) -> np.ndarray:
    """Penalized logits clamped to [-LOGIT_LIMIT, LOGIT_LIMIT], except masked tokens (-inf ``before``): -inf."""
    return np.where(before == -np.inf, before, np.clip(penalized, -LOGIT_LIMIT, LOGIT_LIMIT))


def _penalize_(
    x: np.ndarray,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]] | None,
    output_ids: Sequence[Sequence[int]] | None,
) -> None:
    """Apply every row's penalties to ``x`` [N, V] (C-contiguous float32, writable) in place.

    Only the logits of tokens that occurred are touched: a gather and a scatter at the unique
    (row, token) positions, so the cost is in the number of tokens, not N x V.
    """
    n, vocab = x.shape
    flat_x = x.reshape(-1)  # a view: x is C-contiguous
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    occ = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if (rep or occ) and output_ids is None:
        raise ValueError("output_ids is required when a row sets a penalty")
    if rep:
        if prompt_ids is None:
            raise ValueError("prompt_ids is required when a row sets repetition_penalty")
        pos = _unique(_flat_ids(rep, [prompt_ids, output_ids], vocab, "prompt/output"))
        # float32 like HF's processor (bit-exact with it); a penalty near 0 overflows a logit to +-inf, so the
        # result is clamped, and the penalty kept finite so that 0 x penalty is never NaN (-inf x 0 would be:
        # _clamp keeps masked tokens at -inf).
        rp = _f32([p.repetition_penalty for p in params])[pos // vocab]
        v = flat_x[pos]
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # both branches are computed
            flat_x[pos] = _clamp(np.where(v > 0, v / rp, v * rp), v)
    if occ:
        pos, count = np.unique(_flat_ids(occ, [output_ids], vocab, "output"), return_counts=True)
        row = pos // vocab
        freq = _f32([p.frequency_penalty for p in params])[row]
        pres = _f32([p.presence_penalty for p in params])[row]
        # vLLM: l -= f * count; l -= p * (count > 0)
        v = flat_x[pos]
        flat_x[pos] = _clamp(v - freq * count.astype(np.float32) - pres, v)


def apply_logit_bias(x: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
    """Add each row's ``logit_bias`` to ``x`` [N, V] (float32, writable) in place and return it: one indexed add
    at the (row, token) positions of the rows that have a bias (the others are not touched)."""
    n, vocab = x.shape
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return x
    if max(t for i in rows for t, _ in params[i].logit_bias) >= vocab:
        raise ValueError(f"logit_bias token ids must be < the vocabulary size {vocab}")
    row = [i for i in rows for _ in params[i].logit_bias]
    tok = [t for i in rows for t, _ in params[i].logit_bias]
    # Each row names a token once (validated), so the (row, token) pairs are distinct: += adds every bias.
    x[row, tok] += np.array([b for i in rows for _, b in params[i].logit_bias], dtype=x.dtype)
    return x


def apply_penalties(
    logits: np.ndarray,
    params: Sequence[SamplingParams | None],
    prompt_ids: Sequence[Sequence[int]] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
) -> np.ndarray:
    """The penalized logits [N, V] as a new C-contiguous float32 array (``logits`` is not modified).

    Repetition over prompt + output tokens (positive logits / penalty, others x penalty), then
    frequency and presence over output tokens. Rows without penalties are copied unchanged.
    """
    params = [p or _GREEDY for p in params]
    x = np.array(logits, dtype=np.float32, order="C", copy=True)
    if any(p.has_penalties for p in params):
        _penalize_(x, params, prompt_ids, output_ids)
    return x


def grammar_bitmask(grammars: Sequence, vocab: int) -> np.ndarray:
    """Structured output: each grammar's allowed next tokens as one row of an int32 bitmask [len(grammars),
    ceil(vocab / 32)] (bit t % 32 of word t // 32 set = token t allowed), each row filled in place by
    ``grammar.fill_mask(address, nbytes)``."""
    mask = np.zeros((len(grammars), (vocab + 31) // 32), dtype=np.int32)  # C-contiguous
    row_bytes = mask.shape[1] * mask.itemsize
    for row, grammar in enumerate(grammars):
        grammar.fill_mask(mask.ctypes.data + row * row_bytes, row_bytes)
    return mask


def apply_token_bitmask(logits: np.ndarray, rows: Sequence[int], bitmask: np.ndarray) -> np.ndarray:
    """A copy of ``logits`` [N, V] in which, for each ``rows[j]``, the tokens bitmask row j does not allow are
    -inf (a masked token: sampling never picks it; the other rows are unchanged). Bits past V are ignored."""
    logits = np.asarray(logits)
    vocab = logits.shape[1]
    # Little-endian int32 words as bytes, unpacked least significant bit first: bit b of word w is token
    # 32 * w + b. [len(rows), W] -> [len(rows), W * 32] -> the first V.
    words = np.ascontiguousarray(bitmask, dtype="<i4")
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    out = np.array(logits, copy=True)
    index = np.asarray(rows, dtype=np.int64)
    out[index] = np.where(allowed, out[index], -np.inf)
    return out
