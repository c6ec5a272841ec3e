"""Per-request sampling, vectorized over the batch, on numpy (no torch: the torch-free serving path runs it too).

``sample(logits, params, prompt_ids, output_ids)`` turns one row of logits per sequence into
one token id per sequence, each row under its own ``SamplingParams``. ``logits`` is a numpy
array [N, V] (float32; other float dtypes are converted), read only: no function here writes
into its caller's array unless its docstring says it works in place. The order is vLLM's:

1. repetition penalty (HF/vLLM: over prompt + output tokens, positive logits divided by the
   penalty, negative ones multiplied), then frequency and presence penalties (OpenAI: over
   output tokens only, ``l -= frequency * count + presence * (count > 0)``), then each row's
   ``logit_bias`` (added to its tokens' logits; rows without one are not touched);
2. greedy rows (``temperature`` below ``GREEDY_TEMPERATURE``) take the argmax of the penalized
   logits; top-k/top-p/min-p and the seed do not matter for them;
3. the other rows: divide by the temperature, then top-k (keep logits >= the k-th largest),
   top-p (keep the smallest set of most likely tokens whose mass reaches ``top_p``; the mass is
   that of the top-k survivors), min-p (keep tokens with prob >= ``min_p`` x the top prob), then
   draw by inverse CDF over the survivors in vocabulary order with one uniform number per row.

Numeric safety: every parameter in its accepted range gives finite arithmetic. Penalized logits are
clamped to ``[-LOGIT_LIMIT, LOGIT_LIMIT]`` (a repetition penalty of 1e-38 turns a logit of 10 into
1e39, past float32's range), and sampled rows are clamped below ``LOGIT_LIMIT`` before the
temperature divides them, so nothing overflows to +inf (whose differences are NaN); a temperature
past float32's range divides as float32's largest number. Rows that arrive unusable (a NaN or +inf
from the model, or every logit -inf) are refused with ``NonFiniteLogits`` naming the rows; the engine
fails those rows alone. A -inf logit is a masked token: it is allowed in the input and stays -inf
through penalties and temperature (never -inf x 0 or -inf / inf = NaN), so it is never drawn.

Ties at a top-k or top-p boundary are kept (a value threshold), so a row may keep more than
``top_k`` tokens when logits tie exactly.

Seeding: a seeded row's uniform is a pure function of ``(seed, step)``, where ``step`` is the
number of tokens the sequence has generated so far (``len(output_ids[row])``); see
``seeded_uniform``. It does not depend on batchmates, row position, admission time or any RNG
state, and neither does the per-row arithmetic (filters are value thresholds; the CDF is a
float64 serial cumsum in vocabulary order, and a top-k row's window CDF has the same sums as over
the whole vocabulary), so a seeded request gets the same tokens alone or in any batch given the
same logits. Unseeded rows draw from ``generator``, a ``numpy.random.Generator`` (a module-level
``default_rng()`` when None).

A batch that is all greedy without penalties is just ``logits.argmax(-1)``. Work is only done
for features some row uses: no penalty arrays without penalties, no top-k/top-p/min-p passes
unless some sampled row sets them. Top-``width`` selections take the maxima of strided groups of
ids, then partition only the ids of the best groups (``_candidates``), not the vocabulary. Rows with a
top-k are sampled on their top-k window alone (no pass over the vocabulary after the selection);
top-p on rows without a top-k looks for the nucleus in growing windows (``TOP_P_WINDOWS``) and
fully sorts only the rows whose nucleus is wider; a row with a top-p or min-p threshold draws over
its survivors alone. Penalties touch only the logits of tokens that occurred (gather/scatter at
unique ids).
"""

from __future__ import annotations

import itertools
import math
import numbers
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = [
    "GREEDY_TEMPERATURE",
    "LOGIT_LIMIT",
    "NonFiniteLogits",
    "MAX_LOGIT_BIAS",
    "TOP_P_WINDOWS",
    "SamplingParams",
    "TokenLogprobs",
    "apply_logit_bias",
    "apply_penalties",
    "apply_token_bitmask",
    "grammar_bitmask",
    "logprobs",
    "sample",
    "seeded_uniform",
]

# Temperatures below this are greedy (as in vLLM): dividing by a smaller one overflows fp32.
GREEDY_TEMPERATURE = 1e-5
# Largest logit magnitude sampling works with: / GREEDY_TEMPERATURE it stays far inside float32's range.
LOGIT_LIMIT = 1e30
# top-p on a row without top-k searches its nucleus among the top 256 tokens, then the top 2048
# for the rows whose nucleus is wider, and fully sorts only the rows whose nucleus is wider still.
TOP_P_WINDOWS = (256, 2048)
_MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 300  # entries per request, as OpenAI
_M64 = (1 << 64) - 1
_F32_MAX = float(np.finfo(np.float32).max)
# Unseeded sampled rows draw from this when the caller passes no generator (seeded from the OS).
_DEFAULT_RNG = np.random.default_rng()
# Per-thread scratch arrays of the vocabulary's size, reused from call to call (``_scratch``).
_SCRATCH = threading.local()
_SCRATCH_MIN = 8192  # elements below which a fresh array is as cheap (it comes from the allocator's own free lists)


class NonFiniteLogits(ValueError):
    """Some rows' logits hold NaN or +inf, or are all -inf; ``rows`` lists them (indices into the batch)."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"non-finite logits in rows {rows}")
        self.rows = rows


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. Defaults are greedy. Validated on construction."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # (token id, bias) pairs added to the logits after the penalties, before the temperature (OpenAI/vLLM).
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not _is_real(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        k = self.top_k
        if not _is_int(k) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {k!r}")
        m = self.min_p
        if not _is_real(m) or not 0 <= m <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {m!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        s = self.seed
        if s is not None and (not _is_int(s) or not 0 <= s <= _MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1] or null, got {s!r}")
        _check_logit_bias(self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        """Deterministic argmax (over the penalized logits when penalties are set); seed unused."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _check_logit_bias(pairs) -> None:
    """At most MAX_LOGIT_BIAS (token id >= 0, bias in [-100, 100]) pairs, each token once."""
    if not isinstance(pairs, tuple) or len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias must be a tuple of at most {MAX_LOGIT_BIAS} (token id, bias) pairs")
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0):
            raise ValueError(f"logit_bias entries must be (token id >= 0, bias) pairs, got {pair!r}")
        if not _is_real(pair[1]) or not -100 <= pair[1] <= 100:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {pair[1]!r}")
    if len({t for t, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias names a token id more than once")


_GREEDY = SamplingParams()


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) that is a pure function of (seed, step): counter-based, no RNG state.

    ``splitmix64(splitmix64(seed) ^ step)``, top 53 bits. splitmix64 is a bijection on 64-bit
    words, so for one seed every step gets a distinct, well-mixed word.
    """
    h = _splitmix64(_splitmix64(seed & _M64) ^ (step & _M64))
    return (h >> 11) * (1.0 / (1 << 53))


def _f32(values) -> np.ndarray:
    """Python numbers as float32, finite ones past float32's range as its largest finite value (not inf)."""
    a = np.asarray(values, dtype=np.float64)
    return np.where(np.isfinite(a), np.clip(a, -_F32_MAX, _F32_MAX), a).astype(np.float32)


def _col(values, dtype) -> np.ndarray:
    """[n] Python numbers -> an [n, 1] column of ``dtype`` (float32 columns saturate, see ``_f32``)."""
    out = _f32(values) if dtype == np.float32 else np.asarray(values, dtype=dtype)
    return out.reshape(-1, 1)


def _rows(x: np.ndarray, rows: list[int]) -> np.ndarray:
    """``x``'s rows ``rows``: ``x`` itself when that is all of them (no copy), else a copy."""
    return x if len(rows) == x.shape[0] else x[rows]


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


def _log_min_p(ps: Sequence[SamplingParams]) -> np.ndarray:
    """[n, 1] float32: log(min_p), -inf where min_p is off."""
    return _col([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in ps], np.float32)


def _take(a: np.ndarray, index: np.ndarray) -> np.ndarray:
    return np.take_along_axis(a, index, axis=1)


def _scratch(name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A C-contiguous array of ``shape`` for this thread's use until its next call with ``name``: a vocabulary-sized
    array allocated fresh at every token comes from the OS each time (the allocator hands a freed block that size
    back), and its first writes fault its pages in: 190 against 365 us for a cumsum over 49152 float64s."""
    size = math.prod(shape)
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = np.empty(max(size, 1), dtype)
        setattr(_SCRATCH, name, buf)
    return buf[:size].reshape(shape)


def _draw(weights: np.ndarray, u: float) -> int:
    """Inverse CDF over one row of ``weights`` [W] (>= 0): the first index whose float64 cumulative mass (a serial
    cumsum) exceeds u * total."""
    # float64 first, then the serial sum (cumsum(dtype=float64) on float32 gives the same sums but casts in buffered
    # chunks: 2.5x slower); over a vocabulary, in scratch arrays
    if weights.size < _SCRATCH_MIN:
        cdf = np.cumsum(weights.astype(np.float64))
    else:
        wide = _scratch("draw_in", weights.shape, np.float64)
        np.copyto(wide, weights)
        cdf = np.cumsum(wide, out=_scratch("draw_cdf", weights.shape, np.float64))
    # side="right" never lands on a zero-mass entry (its cdf equals its predecessor's); the min
    # only guards a target == total rounding case.
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), cdf.size - 1)


def _nucleus_count(e: np.ndarray, top_p: np.ndarray, total: np.ndarray | None = None) -> np.ndarray:
    """How many descending-sorted candidates top-p keeps: those whose preceding mass < top_p * total.

    ``e``: float64 unnormalized probs [n, W] in descending order; ``total``: the row's whole mass [n, 1]
    (the sum of ``e`` when None). Returns [n, 1] int64, at least 1.
    """
    cum = np.cumsum(e, axis=1)  # serial per row: a prefix's sums do not depend on what follows it
    before = np.zeros_like(cum)
    before[:, 1:] = cum[:, :-1]
    if total is None:
        total = cum[:, -1:]
    return (before < top_p * total).sum(axis=1, keepdims=True)


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


def _sample_topk_rows(x: np.ndarray, temp: np.ndarray, ps: Sequence[SamplingParams], u: np.ndarray) -> np.ndarray:
    """Rows that all set 0 < top_k < V, sampled on their top-k window alone. x: logits [n, V] (read only);
    temp: [n, 1] float32; u: [n, 1] float64. Returns [n] token ids."""
    n, vocab = x.shape
    ks = np.array([p.top_k for p in ps], dtype=np.int64).reshape(-1, 1)
    width = min(vocab, max(p.top_k for p in ps) + 1)  # one extra shows a k-th value tied past the window
    vals, idx = _top(x, width)  # dividing by a positive temperature keeps the order
    vals = vals / temp
    kth = _take(vals, ks - 1)
    if width < vocab and bool((vals[:, -1:] >= kth).any()):
        s = x / temp
        width = min(vocab, int((s >= kth).sum(axis=1).max()) + 1)
        vals, idx = _top(s, width)
    keep = vals >= kth  # a prefix: the top-k survivors, ties included
    shifted = vals - vals[:, :1]  # <= 0
    e = np.where(keep, np.exp(shifted), np.float32(0.0)).astype(np.float64)
    if any(p.top_p < 1.0 for p in ps):
        top_p = _col([p.top_p for p in ps], np.float64)
        tau = _take(vals, _nucleus_count(e, top_p) - 1)
        keep &= (vals >= tau) | (top_p >= 1.0)
    if any(p.min_p > 0.0 for p in ps):
        keep &= shifted >= _log_min_p(ps)
    e[~keep] = 0.0
    # Vocabulary order, as over the whole vocabulary (the zeros in between change no sum).
    order = np.argsort(idx, axis=1)
    idx, e = _take(idx, order), _take(e, order)
    return np.array([idx[i, _draw(e[i], u[i, 0])] for i in range(n)], dtype=np.int64)


def _nucleus_threshold(dp: np.ndarray, top_p: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Per row of ``dp`` (scaled logits minus their max [m, V]), the smallest scaled logit top-p keeps: [m, 1].
    top_p, total (the row's whole float64 mass): [m, 1] float64.

    The nucleus is usually narrow: look for it among the top TOP_P_WINDOWS[0] tokens, widen the window for
    the rows whose nucleus fills it, and fully sort only what remains."""
    vocab = dp.shape[1]
    tau = np.empty((dp.shape[0], 1), dtype=dp.dtype)
    todo = None  # None: every row of dp
    for width in (*TOP_P_WINDOWS, vocab):
        width = min(width, vocab)
        sel = slice(None) if todo is None else todo
        vals = _top_values(dp if todo is None else dp[todo], width)
        count = _nucleus_count(np.exp(vals).astype(np.float64), top_p[sel], total[sel])
        tau[sel] = _take(vals, count - 1)  # ties at the threshold are kept
        if width == vocab:
            break
        wide = np.flatnonzero(count[:, 0] == width)
        if not wide.size:
            break
        todo = wide if todo is None else todo[wide]
    return tau


def _sample_full_rows(
    x: np.ndarray, amax: np.ndarray, temp: np.ndarray, ps: Sequence[SamplingParams], u: np.ndarray
) -> np.ndarray:
    """Rows without a top-k, sampled over the whole vocabulary. x: logits [n, V] (read only); amax: their row
    maxima [n, 1]; temp: [n, 1] float32; u: [n, 1] float64. Returns [n] token ids."""
    n, vocab = x.shape
    d = x - amax
    d /= temp  # scaled logits minus their max: <= 0, max exactly 0
    # Probabilities (unnormalized) over the whole vocabulary only where a row needs them: a draw over all of it, or
    # top-p's total mass. Rows with min-p alone know their threshold without them and exponentiate their survivors.
    e = None if all(p.min_p > 0.0 and p.top_p >= 1.0 for p in ps) else np.exp(d)
    # Both filters keep the tokens at or above a per-row threshold on d (-inf: no filter on that row).
    threshold = None
    p_rows = [i for i, p in enumerate(ps) if p.top_p < 1.0]
    if p_rows:
        total = _rows(e, p_rows).sum(axis=1, keepdims=True, dtype=np.float64)
        tau = _nucleus_threshold(_rows(d, p_rows), _col([ps[i].top_p for i in p_rows], np.float64), total)
        if len(p_rows) == n:
            threshold = tau
        else:
            threshold = np.full((n, 1), -np.inf, dtype=d.dtype)
            threshold[p_rows] = tau
    if any(p.min_p > 0.0 for p in ps):
        lmp = _log_min_p(ps)
        threshold = lmp if threshold is None else np.maximum(threshold, lmp)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):  # rows, not tokens
        if threshold is None or threshold[i, 0] == -np.inf:
            out[i] = _draw(e[i], u[i, 0])
        else:  # the survivors alone, in vocabulary order: the same sums as with zeros in between
            ids = np.flatnonzero(d[i] >= threshold[i, 0])  # never empty: d's max is 0, every threshold <= 0
            out[i] = ids[_draw(np.exp(d[i, ids]) if e is None else e[i, ids], u[i, 0])]
    return out


def _uniforms(
    sampled: list[int],
    params: list[SamplingParams],
    output_ids: Sequence[Sequence[int]] | None,
    generator: np.random.Generator | None,
) -> dict[int, float]:
    """One uniform per sampled row: seeded rows from (seed, step), the others from ``generator``."""
    if output_ids is None and any(params[i].seed is not None for i in sampled):
        raise ValueError("output_ids is required for seeded rows: len(output_ids[i]) is their step")
    unseeded = [i for i in sampled if params[i].seed is None]
    draws = iter((generator or _DEFAULT_RNG).random(len(unseeded)).tolist() if unseeded else ())
    return {
        i: next(draws) if params[i].seed is None else seeded_uniform(params[i].seed, len(output_ids[i]))
        for i in sampled
    }


def sample(
    logits: np.ndarray,
    params: Sequence[SamplingParams | None],
    prompt_ids: Sequence[Sequence[int]] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
    generator: np.random.Generator | None = None,
) -> list[int]:
    """One token id per row of ``logits`` [N, V] (numpy, float32), row i under ``params[i]`` (None = greedy).

    ``prompt_ids[i]`` / ``output_ids[i]``: row i's prompt and generated tokens so far. Needed for
    penalties (repetition: prompt + output; presence/frequency: output) and, for seeded rows,
    ``len(output_ids[i])`` is the step their random number comes from. ``generator`` (a
    ``numpy.random.Generator``) feeds the unseeded sampled rows (a module-level one when None).
    ``logits`` is not modified (it may be read only).
    """
    logits = np.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [N, V], got shape {logits.shape}")
    n, vocab = logits.shape
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} rows of logits")
    for name, lists in (("prompt_ids", prompt_ids), ("output_ids", output_ids)):
        if lists is not None and len(lists) != n:
            raise ValueError(f"{name} has {len(lists)} rows for {n} rows of logits")
    if n == 0:
        return []
    if vocab == 0:
        raise ValueError("logits have no vocabulary (shape [N, 0])")
    params = [p or _GREEDY for p in params]
    penalized = any(p.has_penalties for p in params)
    biased = any(p.logit_bias for p in params)
    if not penalized and not biased and all(p.is_greedy for p in params):
        return _argmax(logits)
    # A row is usable when its max is finite: no NaN (max propagates it), no +inf, not all -inf
    # (-inf alone is a masked token: allowed).
    with np.errstate(invalid="ignore"):
        row_max = logits.max(axis=1)  # [N]
    usable = np.isfinite(row_max)
    if not usable.all():
        raise NonFiniteLogits(np.flatnonzero(~usable).tolist())

    if penalized or biased:
        x = _scratch("penalized", logits.shape, np.float32)  # a copy (the caller's logits are read only)
        np.copyto(x, logits)
        if penalized:
            _penalize_(x, params, prompt_ids, output_ids)
        apply_logit_bias(x, params)
        row_max = x.max(axis=1)
    else:
        x = np.asarray(logits, dtype=np.float32)  # no copy when float32: x is only read
        row_max = row_max.astype(np.float32)
    out = [0] * n
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    for i, tok in zip(greedy, _rows(x, greedy).argmax(axis=1).tolist()):
        out[i] = tok
    if not sampled:
        return out

    u = _uniforms(sampled, params, output_ids, generator)
    windowed = [i for i in sampled if 0 < params[i].top_k < vocab]
    whole = [i for i in sampled if not 0 < params[i].top_k < vocab]
    for rows, topk in ((windowed, True), (whole, False)):
        if not rows:
            continue
        xr = _rows(x, rows)
        # Clamped below LOGIT_LIMIT: / temperature stays below +inf (inf - inf would be NaN); -inf is fine. Only
        # rows whose max exceeds the limit change, so the others skip the pass.
        amax = row_max[rows].reshape(-1, 1)
        if bool((amax > LOGIT_LIMIT).any()):
            xr = np.minimum(xr, np.float32(LOGIT_LIMIT))
            amax = np.minimum(amax, np.float32(LOGIT_LIMIT))
        temp = _col([params[i].temperature for i in rows], np.float32)
        ur = _col([u[i] for i in rows], np.float64)
        ps = [params[i] for i in rows]
        toks = _sample_topk_rows(xr, temp, ps, ur) if topk else _sample_full_rows(xr, amax, temp, ps, ur)
        for i, tok in zip(rows, toks.tolist()):
            out[i] = tok
    return out


def _argmax(logits: np.ndarray) -> list[int]:
    """Greedy rows without penalties: each row's argmax, in one pass over the vocabulary (nothing normalized). The
    value at the argmax is the row's max, unless the row holds a NaN (argmax stops at the first NaN): a row is
    refused (``NonFiniteLogits``) when that value is not finite (NaN, +inf, or every logit -inf)."""
    ids = logits.argmax(axis=1)
    best = logits[np.arange(logits.shape[0]), ids]
    usable = np.isfinite(best)
    if not usable.all():
        raise NonFiniteLogits(np.flatnonzero(~usable).tolist())
    return ids.tolist()


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
