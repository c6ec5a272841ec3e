"""Per-request sampling, vectorized over the batch (torch only).

``sample(logits, params, prompt_ids, output_ids)`` turns one row of logits per sequence into
one token id per sequence, each row under its own ``SamplingParams``. The order is vLLM's:

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
temperature divides them, so nothing overflows to +inf (whose differences are NaN).
Rows that arrive unusable (a NaN or +inf from the model, or every logit -inf) are refused with
``NonFiniteLogits`` naming the rows; the engine fails those rows alone. A -inf logit is a masked
token and stays allowed.

Ties at a top-k or top-p boundary are kept (a value threshold), so a row may keep more than
``top_k`` tokens when logits tie exactly.

Seeding: a seeded row's uniform is a pure function of ``(seed, step)``, where ``step`` is the
number of tokens the sequence has generated so far (``len(output_ids[row])``); see
``seeded_uniform``. It does not depend on batchmates, row position, admission time, device or
torch's RNG, and neither does the per-row arithmetic (filters are value thresholds; the CDF is
a float64 serial cumsum in vocabulary order, and a top-k row's window CDF has the same sums as
over the whole vocabulary), so a seeded request gets the same tokens alone or in any batch given
the same logits. Unseeded rows draw from ``generator`` (torch's default CPU generator if None).

The module imports torch only inside the functions that use it, so ``SamplingParams`` (request
validation) stays importable by the torch-free server stack.

A batch that is all greedy without penalties is just ``logits.argmax(-1)``. Work is only done
for features some row uses: no penalty tensors without penalties, no top-k/top-p/min-p passes
unless some sampled row sets them. Rows with a top-k are sampled on their top-k window alone
(no pass over the vocabulary after ``topk``); top-p on rows without a top-k looks for the nucleus
in growing ``topk`` windows (``TOP_P_WINDOWS``) and fully sorts only the rows whose nucleus is
wider. Penalties touch only the logits of tokens that occurred (gather/scatter at unique ids).
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # torch is imported where it is used: SamplingParams needs no torch
    import torch

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


def _flat_ids(rows: Sequence[int], lists: Sequence[Sequence[Sequence[int]]], vocab: int, what: str) -> torch.Tensor:
    """Flat indices ``row * vocab + id`` into an [N, V] tensor for every id of each row in ``rows`` (CPU, int64)."""
    import torch

    per_row = [list(itertools.chain.from_iterable(src[r] for src in lists)) for r in rows]
    lengths = torch.tensor([len(ids) for ids in per_row], dtype=torch.long)
    ids = torch.tensor(list(itertools.chain.from_iterable(per_row)), dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{what} token ids must be in [0, {vocab}), got {int(ids.min())}..{int(ids.max())}")
    return torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths) * vocab + ids


def _penalize_(
    x: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]] | None,
    output_ids: Sequence[Sequence[int]] | None,
) -> None:
    """Apply every row's penalties to ``x`` [N, V] (contiguous float32) in place.

    Only the logits of tokens that occurred are touched: a gather and a scatter at the unique
    (row, token) positions, so the cost is in the number of tokens, not N x V.
    """
    import torch

    n, vocab = x.shape
    dev = x.device
    flat_x = x.view(-1)
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    occ = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if (rep or occ) and output_ids is None:
        raise ValueError("output_ids is required when a row sets a penalty")
    if rep:
        if prompt_ids is None:
            raise ValueError("prompt_ids is required when a row sets repetition_penalty")
        pos = torch.unique(_flat_ids(rep, [prompt_ids, output_ids], vocab, "prompt/output")).to(dev)
        # float32 like HF's processor (bit-exact with it); a penalty near 0 overflows a logit to +-inf, so the
        # result is clamped, and the penalty kept finite so that 0 x penalty is never NaN.
        rp = torch.tensor([p.repetition_penalty for p in params], dtype=x.dtype, device=dev)[pos // vocab]
        rp.clamp_(max=torch.finfo(x.dtype).max)
        v = flat_x[pos]
        flat_x[pos] = torch.where(v > 0, v / rp, v * rp).clamp_(-LOGIT_LIMIT, LOGIT_LIMIT)
    if occ:
        pos, count = torch.unique(_flat_ids(occ, [output_ids], vocab, "output"), return_counts=True)
        pos, count = pos.to(dev), count.to(device=dev, dtype=x.dtype)
        row = pos // vocab
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype, device=dev)[row]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype, device=dev)[row]
        # vLLM: l -= f * count; l -= p * (count > 0)
        flat_x[pos] = (flat_x[pos] - freq * count - pres).clamp_(-LOGIT_LIMIT, LOGIT_LIMIT)


def apply_logit_bias(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Add each row's ``logit_bias`` to ``x`` [N, V] (float32) in place and return it: one index_add
    over the flat positions ``row * V + token`` of the rows that have a bias (the others are not touched)."""
    import torch

    n, vocab = x.shape
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return x
    pos = [i * vocab + t for i in rows for t, _ in params[i].logit_bias]
    bias = [b for i in rows for _, b in params[i].logit_bias]
    if max(t for i in rows for t, _ in params[i].logit_bias) >= vocab:
        raise ValueError(f"logit_bias token ids must be < the vocabulary size {vocab}")
    dev = x.device
    x.view(-1).index_add_(0, torch.tensor(pos, device=dev), torch.tensor(bias, dtype=x.dtype, device=dev))
    return x


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams | None],
    prompt_ids: Sequence[Sequence[int]] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """The penalized logits [N, V] as a new float32 tensor (``logits`` is not modified).

    Repetition over prompt + output tokens (positive logits / penalty, others x penalty), then
    frequency and presence over output tokens. Rows without penalties are copied unchanged.
    """
    import torch

    params = [p or _GREEDY for p in params]
    x = logits.to(torch.float32, copy=True).contiguous()
    if any(p.has_penalties for p in params):
        _penalize_(x, params, prompt_ids, output_ids)
    return x


def _col(values, dtype, device) -> torch.Tensor:
    import torch

    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)


def _log_min_p(ps: Sequence[SamplingParams], dtype, device) -> torch.Tensor:
    return _col([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in ps], dtype, device)


def _draw(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: per row, the first index whose cumulative mass exceeds u * total. [n, 1]."""
    import torch

    target = u * cdf[:, -1:]
    # right=True never lands on a zero-mass entry (its cdf equals its predecessor's); the clamp
    # only guards a target == total rounding case.
    return torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)


def _nucleus_count(e: torch.Tensor, top_p: torch.Tensor, total: torch.Tensor | None = None) -> torch.Tensor:
    """How many descending-sorted candidates top-p keeps: those whose preceding mass < top_p * total.

    ``e``: float64 unnormalized probs in descending order; ``total``: the row's whole mass (the
    sum of ``e`` when None). Returns [n, 1] int64, at least 1.
    """
    import torch

    cum = e.cumsum(-1)  # serial per row: a prefix's sums do not depend on what follows it
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
    if total is None:
        total = cum[:, -1:]
    return (before < top_p * total).sum(-1, keepdim=True)


def _sample_topk_rows(x: torch.Tensor, temp: torch.Tensor, ps: Sequence[SamplingParams], u: torch.Tensor):
    """Rows that all set 0 < top_k < V, sampled on their top-k window alone. x: logits [n, V] (read only)."""
    import torch

    n, vocab = x.shape
    dev = x.device
    ks = torch.tensor([p.top_k for p in ps], dtype=torch.long, device=dev).unsqueeze(1)
    width = min(vocab, max(p.top_k for p in ps) + 1)  # one extra shows a k-th value tied past the window
    vals, idx = x.topk(width, dim=-1)  # dividing by a positive temperature keeps the order
    vals = vals / temp
    kth = vals.gather(1, ks - 1)
    if width < vocab and bool((vals[:, -1:] >= kth).any()):
        s = x / temp
        width = min(vocab, int((s >= kth).sum(-1).max()) + 1)
        vals, idx = s.topk(width, dim=-1)
    keep = vals >= kth  # a prefix: the top-k survivors, ties included
    shifted = vals - vals[:, :1]  # <= 0
    e = torch.where(keep, shifted.exp(), 0.0).double()
    if any(p.top_p < 1.0 for p in ps):
        top_p = _col([p.top_p for p in ps], torch.float64, dev)
        tau = vals.gather(1, _nucleus_count(e, top_p) - 1)
        keep &= (vals >= tau) | (top_p >= 1.0)
    if any(p.min_p > 0.0 for p in ps):
        keep &= shifted >= _log_min_p(ps, shifted.dtype, dev)
    e = torch.where(keep, e, 0.0)
    # Vocabulary order, as over the whole vocabulary (the zeros in between change no sum).
    order = idx.argsort(dim=-1)
    cdf = e.gather(1, order).cumsum_(-1)
    return idx.gather(1, order).gather(1, _draw(cdf, u)).squeeze(1)


def _sample_full_rows(x: torch.Tensor, temp: torch.Tensor, ps: Sequence[SamplingParams], u: torch.Tensor):
    """Rows without a top-k, sampled over the whole vocabulary. x: logits [n, V] (read only)."""
    import torch

    n, vocab = x.shape
    dev = x.device
    d = (x - x.amax(-1, keepdim=True)).div_(temp)  # scaled logits minus their max: <= 0, max exactly 0
    e = d.exp()
    # Both filters keep the tokens at or above a per-row threshold on d: one pass applies them.
    threshold = None
    p_rows = [i for i, p in enumerate(ps) if p.top_p < 1.0]
    if p_rows:
        every = len(p_rows) == n
        dp = d if every else d[torch.tensor(p_rows, device=dev)]
        total = (e if every else e[torch.tensor(p_rows, device=dev)]).sum(-1, keepdim=True, dtype=torch.float64)
        top_p = _col([ps[i].top_p for i in p_rows], torch.float64, dev)
        tau = torch.empty(len(p_rows), 1, dtype=d.dtype, device=dev)
        # The nucleus is usually narrow: look for it among the top TOP_P_WINDOWS[0] tokens, widen
        # the window for the rows whose nucleus fills it, and fully sort only what remains.
        todo = None  # None: every row of dp
        for width in (*TOP_P_WINDOWS, vocab):
            width = min(width, vocab)
            sub = dp if todo is None else dp[todo]
            vals = sub.topk(width, dim=-1).values if width < vocab else sub.sort(dim=-1, descending=True).values
            sel = slice(None) if todo is None else todo
            count = _nucleus_count(vals.exp().double(), top_p[sel], total[sel])
            tau[sel] = vals.gather(1, count - 1)  # ties at the threshold are kept
            if width == vocab:
                break
            wide = (count.squeeze(1) == width).nonzero().squeeze(1)
            if not wide.numel():
                break
            todo = wide if todo is None else todo[wide]
        if every:
            threshold = tau
        else:
            threshold = torch.full((n, 1), -math.inf, dtype=d.dtype, device=dev)
            threshold[torch.tensor(p_rows, device=dev)] = tau
    if any(p.min_p > 0.0 for p in ps):
        lmp = _log_min_p(ps, d.dtype, dev)
        threshold = lmp if threshold is None else torch.maximum(threshold, lmp)
    if threshold is not None:
        e.masked_fill_(d < threshold, 0.0)
    return _draw(e.double().cumsum_(-1), u).squeeze(1)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams | None],
    prompt_ids: Sequence[Sequence[int]] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """One token id per row of ``logits`` [N, V], row i under ``params[i]`` (None = greedy).

    ``prompt_ids[i]`` / ``output_ids[i]``: row i's prompt and generated tokens so far. Needed for
    penalties (repetition: prompt + output; presence/frequency: output) and, for seeded rows,
    ``len(output_ids[i])`` is the step their random number comes from. ``generator`` feeds the
    unseeded sampled rows (torch's default CPU generator when None). ``logits`` is not modified.
    """
    import torch

    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} rows of logits")
    for name, lists in (("prompt_ids", prompt_ids), ("output_ids", output_ids)):
        if lists is not None and len(lists) != n:
            raise ValueError(f"{name} has {len(lists)} rows for {n} rows of logits")
    if n == 0:
        return []
    params = [p or _GREEDY for p in params]
    # A row is usable when its max is finite: no NaN (amax propagates it), no +inf, not all -inf
    # (-inf alone is a masked token: allowed).
    usable = torch.isfinite(logits.amax(dim=-1))  # [N]
    if not bool(usable.all()):
        raise NonFiniteLogits((~usable).nonzero().flatten().tolist())
    penalized = any(p.has_penalties for p in params)
    biased = any(p.logit_bias for p in params)
    if not penalized and not biased and all(p.is_greedy for p in params):
        return logits.argmax(dim=-1).tolist()

    x = apply_penalties(logits, params, prompt_ids, output_ids) if penalized or biased else logits.float()
    if biased:
        apply_logit_bias(x, params)  # x is a copy here (apply_penalties copies)
    dev = x.device
    out = [0] * n
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if greedy:
        g = x if len(greedy) == n else x[torch.tensor(greedy, device=dev)]
        for i, tok in zip(greedy, g.argmax(dim=-1).tolist()):
            out[i] = tok
    if not sampled:
        return out

    # One uniform per sampled row: seeded rows from (seed, step), the others from `generator`.
    if output_ids is None and any(params[i].seed is not None for i in sampled):
        raise ValueError("output_ids is required for seeded rows: len(output_ids[i]) is their step")
    unseeded = [i for i in sampled if params[i].seed is None]
    draws = iter(())
    if unseeded:
        where = generator.device if generator is not None else "cpu"
        draws = iter(torch.rand(len(unseeded), dtype=torch.float64, generator=generator, device=where).tolist())
    u = {
        i: next(draws) if params[i].seed is None else seeded_uniform(params[i].seed, len(output_ids[i]))
        for i in sampled
    }

    windowed = [i for i in sampled if 0 < params[i].top_k < vocab]
    whole = [i for i in sampled if not 0 < params[i].top_k < vocab]
    for rows, fn in ((windowed, _sample_topk_rows), (whole, _sample_full_rows)):
        if not rows:
            continue
        xr = x if len(rows) == n else x[torch.tensor(rows, device=dev)]
        xr = xr.clamp(max=LOGIT_LIMIT)  # / temperature stays below +inf (inf - inf would be NaN); -inf is fine
        temp = _col([float(params[i].temperature) for i in rows], x.dtype, dev)
        toks = fn(xr, temp, [params[i] for i in rows], _col([u[i] for i in rows], torch.float64, dev))
        for i, tok in zip(rows, toks.tolist()):
            out[i] = tok
    return out


def grammar_bitmask(grammars: Sequence, vocab: int) -> torch.Tensor:
    """Structured output: each grammar's allowed next tokens as one row of an int32 bitmask [len(grammars),
    ceil(vocab / 32)] (bit t % 32 of word t // 32 set = token t allowed), each row filled in place by
    ``grammar.fill_mask(address, nbytes)``."""
    import torch

    mask = torch.zeros(len(grammars), (vocab + 31) // 32, dtype=torch.int32)  # contiguous, on the CPU
    row_bytes = mask.shape[1] * mask.element_size()
    for row, grammar in enumerate(grammars):
        grammar.fill_mask(mask.data_ptr() + row * row_bytes, row_bytes)
    return mask


def apply_token_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of ``logits`` [N, V] in which, for each ``rows[j]``, the tokens bitmask row j does not allow are
    -inf (a masked token: sampling never picks it; the other rows are unchanged). Bits past V are ignored."""
    import torch

    n, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32)
    # [len(rows), W, 32] -> [len(rows), W * 32]: bit b of word w is token 32 * w + b
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab].to(logits.device)
    out = logits.clone()
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    out[index] = out[index].masked_fill(~allowed, -math.inf)
    return out


class TokenLogprobs(NamedTuple):
    token_id: int
    logprob: float  # of token_id
    top: list[tuple[int, float]]  # the k most likely (token_id, logprob), most likely first


def logprobs(logits: torch.Tensor, chosen: Sequence[int] | torch.Tensor, k: int = 0) -> list[TokenLogprobs]:
    """Per row: the chosen token's logprob and the top-k (token, logprob), from the raw logits' log_softmax."""
    import torch

    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if not _is_int(k) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")
    n, vocab = logits.shape
    chosen_t = torch.as_tensor(chosen, dtype=torch.long).to(logits.device).reshape(-1)
    if chosen_t.numel() != n:
        raise ValueError(f"{chosen_t.numel()} chosen tokens for {n} rows of logits")
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, chosen_t.unsqueeze(1)).squeeze(1).tolist()
    ids = chosen_t.tolist()
    if k == 0:
        return [TokenLogprobs(t, v, []) for t, v in zip(ids, picked)]
    top_v, top_i = lp.topk(min(k, vocab), dim=-1)
    return [TokenLogprobs(t, v, list(zip(ti, tv))) for t, v, ti, tv in zip(ids, picked, top_i.tolist(), top_v.tolist())]
