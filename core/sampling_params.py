"""How one request picks its tokens: ``SamplingParams``, validated on construction (the sampling itself is
``core/sampling.py``)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

# Temperatures below this are greedy (as in vLLM): dividing by a smaller one overflows fp32.
GREEDY_TEMPERATURE = 1e-5
_MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 300  # entries per request, as OpenAI


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
