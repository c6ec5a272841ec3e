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

The parts: ``SamplingParams`` and its validation (``core/sampling_params.py``), the logit filters before a draw
(penalties, logit bias, grammar masks: ``core/logit_filters.py``), the top-``width`` selection
(``core/top_tokens.py``) and logprobs (``core/logprobs.py``). This module draws, and its ``__all__`` is the public
surface of all of them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import numpy as np

from core.logit_filters import (
    LOGIT_LIMIT,
    _col,
    _penalize_,
    apply_logit_bias,
    apply_penalties,
    apply_token_bitmask,
    grammar_bitmask,
)
from core.logprobs import TokenLogprobs, logprobs
from core.sampling_params import _GREEDY, GREEDY_TEMPERATURE, MAX_LOGIT_BIAS, SamplingParams
from core.top_tokens import _take, _top, _top_values

# The public sampling surface: what a caller imports from here, whichever part module holds it.
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

# top-p on a row without top-k searches its nucleus among the top 256 tokens, then the top 2048
# for the rows whose nucleus is wider, and fully sorts only the rows whose nucleus is wider still.
TOP_P_WINDOWS = (256, 2048)

_M64 = (1 << 64) - 1
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


def _rows(x: np.ndarray, rows: list[int]) -> np.ndarray:
    """``x``'s rows ``rows``: ``x`` itself when that is all of them (no copy), else a copy."""
    return x if len(rows) == x.shape[0] else x[rows]


def _log_min_p(ps: Sequence[SamplingParams]) -> np.ndarray:
    """[n, 1] float32: log(min_p), -inf where min_p is off."""
    return _col([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in ps], np.float32)


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
