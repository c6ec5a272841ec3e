"""Speculative decoding: what a step proposes ahead of a sequence, and the books of what it accepted. No torch.

A decode row may carry ``k`` draft tokens into a step (vLLM v1's scheme, inside the planner's token budget). The
planner (``core/planner.py``) asks the sequence's proposer for them when it plans the step, reserves KV slots for
them, and the row feeds its last token and the drafts at positions ``n - 1 .. n - 1 + k``, causally, with logits at
every position: one forward verifies them all. The engine samples each position as if the drafts before it had been
accepted (its penalties, seed step and grammar state after them) and emits the sampled tokens up to and including
the first one that differs from its draft (``verify_run``); the planner appends them, then rolls the rejected
drafts' slots back, so the block manager's books are what they would be without speculation.

Exactness: position ``i``'s token is exactly the token decoding without drafts would sample at that step (the same
logits up to the rounding of a batched row, the same penalties, the same seeded uniform, the same grammar mask), and
a draft only decides how many of those positions one forward computes. So greedy output is the output without
speculation token for token, and a sampled row keeps the target distribution and, seeded, its very tokens: for a
proposer without probabilities (n-gram) accepting draft ``d`` exactly when the target samples ``d`` is rejection
sampling with acceptance ``p(d)``. What a draft never changes: ``max_tokens`` (the run stops at it), stop tokens,
the prefix cache (only verified tokens' blocks enter it), logprobs (of the emitted tokens only).

Proposers: ``NgramProposer`` (prompt lookup, vLLM's ``ngram`` method / llama.cpp's ``ngram-simple``), planned with
the step; and a draft model (``models/draft_model.py``, vLLM's ``draft_model``), which the engine runs on its worker
thread before the target's forward: the planner only reserves the row's lookahead (``EngineProposer``,
``BatchPlan.draft_slots``) and the engine fills ``BatchPlan.drafts``. Each request may choose its own
(``SpecParams``), with the server's default otherwise (config ``SPECULATIVE_*``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SPEC_METHODS = ("off", "ngram", "draft_model")
MAX_SPEC_TOKENS = 16  # most draft tokens per row and step


@dataclass(frozen=True)
class SpecParams:
    """One request's speculation: ``method`` ("off", "ngram" or "draft_model"), up to ``num_tokens`` drafts per step;
    prompt lookup (ngram) looks them up as the continuation of the sequence's last ``lookup_max`` .. ``lookup_min``
    tokens found earlier in it."""

    method: str = "off"
    num_tokens: int = 4
    lookup_min: int = 2
    lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPEC_METHODS)} (got {self.method!r})")
        if not 1 <= self.num_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPEC_TOKENS}] (got {self.num_tokens})")
        if not 1 <= self.lookup_min <= self.lookup_max <= 32:
            raise ValueError(
                f"prompt lookup needs 1 <= min <= max <= 32 (got min {self.lookup_min}, max {self.lookup_max})"
            )

    @property
    def enabled(self) -> bool:
        return self.method != "off"


class NgramIndex:
    """Where each n-gram (``min_n <= n <= max_n``) of one sequence's tokens last occurred, extended as tokens come:
    a lookup costs a dict probe per n, not a scan of the context."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # the n-grams ending before this position are in ``after``

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of ``tokens`` (of
        ``max_n`` down to ``min_n`` tokens); [] when no suffix occurred before."""
        last = len(tokens) - 1
        for end in range(self.indexed, last):  # n-grams ending at ``end``, followed by tokens[end + 1]
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.after[n][tuple(tokens[end - n + 1 : end + 1])] = end + 1
        self.indexed = max(self.indexed, last)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self.after[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + k]
        return []


class StepCost:
    """What a decode step costs by its rows (decode rows plus their drafts), learned from the steps the engine ran
    (``StepOutput.seconds``; steps with prompt chunks are not counted: their rows are a different shape). The draft
    length weighs one more verify row by it, so it follows the machine and the kernels: a row path that covers 1-4
    rows and panels from 5 (``int_dot``), a VNNI CPU or an AVX2 one. Until a row count has been seen ``MIN_SEEN``
    times its cost is extrapolated from the nearest row count seen, by the linear model ``1 + ROW_COST (rows - 1)``
    (ROW_COST measured on the Zen 3: a step of 1, 2, 3, 4, 5 rows of SmolLM2 Q4_1 at context 72 took 9.7, 11.7, 13.8,
    15.9, 19.7 ms; docs/speculative.md), or taken from that model alone before any step."""

    ROW_COST = 0.2  # one more query row's cost, as a share of a one-row step, before any step is measured
    SMOOTHING = 0.1  # weight of a new step in its row count's running mean (after MIN_SEEN plain-mean steps)
    MIN_SEEN = 3

    def __init__(self) -> None:
        self._mean: dict[int, float] = {}  # rows -> running mean of the step's seconds
        self._seen: dict[int, int] = {}

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` rows took ``seconds``."""
        if rows < 1 or seconds <= 0:
            return
        seen = self._seen.get(rows, 0)
        mean = self._mean.get(rows, seconds)
        self._mean[rows] = mean + (seconds - mean) * max(1 / (seen + 1), self.SMOOTHING)
        self._seen[rows] = seen + 1

    def samples(self, rows: int) -> int:
        """How many steps of ``rows`` rows were measured."""
        return self._seen.get(rows, 0)

    def ratio(self, rows: int, base: int) -> float:
        """A step of ``rows`` rows' cost over one of ``base`` rows'."""
        return self._time(rows) / self._time(base)

    def _time(self, rows: int) -> float:
        known = [n for n, seen in self._seen.items() if seen >= self.MIN_SEEN]
        if not known:
            return self._linear(rows)
        nearest = min(known, key=lambda n: (abs(n - rows), n))
        return self._mean[nearest] * self._linear(rows) / self._linear(nearest)

    def _linear(self, rows: int) -> float:
        return 1 + self.ROW_COST * (rows - 1)


class DraftLength:
    """How many drafts one sequence's next step verifies (adaptive speculation), from its measured acceptance.

    Drafts are accepted in a run that ends at the first rejection, so with a per-token acceptance ``a`` the k-th
    draft is kept with probability ``a**k`` (its expected gain, in tokens), while it costs one more query row in
    the step. A step of ``rows`` decode rows and ``k`` drafts costs ``C(k) = T(rows + k) / T(rows)`` of one without
    drafts (``StepCost``: measured by row count, else ``1 + ROW_COST (rows - 1)``), plus ``k cost`` (``cost``, what
    proposing a draft costs). The length is the one that maximizes the step's expected tokens per unit of its time,
    ``E(k) / C(k)`` with ``E(k) = rows + a + ... + a**k`` (ties: fewer drafts). A draft thus has to clear a bar that
    grows with what the step already emits: at the linear model's costs, about a fifth of a token for one user's
    first draft, two thirds of one in a step of 8 rows.
    ``a`` is estimated from the sequence's verified steps (accepted drafts are successes, the rejection ending a
    run a failure), decayed so it follows the text (a paragraph copied, then new prose), from a prior of
    ``PRIOR``. A sequence that stopped drafting drifts back to the prior, so it is probed again after a while.
    ``k_max`` (``NUM_SPECULATIVE_TOKENS``) caps it; ``SPECULATIVE_DISABLE_BY_BATCH_SIZE`` is the hard stop."""

    PRIOR = 0.6  # per-token acceptance assumed before any verification, over PRIOR_WEIGHT pseudo-trials
    PRIOR_WEIGHT = 2.0
    DECAY = 0.8  # weight of the earlier trials at each verified step (about the last 5 steps count)
    IDLE_DRIFT = 0.05  # at each step that did not draft, the estimate moves this far towards the prior

    def __init__(self) -> None:
        self.successes = self.PRIOR * self.PRIOR_WEIGHT
        self.trials = self.PRIOR_WEIGHT

    @property
    def acceptance(self) -> float:
        """The estimated per-token acceptance."""
        return self.successes / self.trials

    def length(self, k_max: int, rows: int, cost: float = 0.0, steps: StepCost | None = None) -> int:
        """Drafts worth verifying next step in a step of ``rows`` decode rows (0: none; the estimate then drifts
        back towards the prior, so that the sequence is probed again after a while). ``cost``: what proposing one
        draft costs, as a share of a step (0 for prompt lookup; a draft model's forward, ``EngineProposer.cost``):
        it adds to a row's cost, so that a draft that costs about a step is never worth it. ``steps``: the
        measured step costs by rows (None: the linear model)."""
        rows, a, steps = max(rows, 1), self.acceptance, steps or StepCost()
        k, best, tokens = 0, float(rows), float(rows)  # tokens: the step's expected tokens with j drafts, E(j)
        for j in range(1, k_max + 1):
            tokens += a**j
            value = tokens / (steps.ratio(rows + j, rows) + cost * j)
            if value > best:
                k, best = j, value
        if not k:
            self.successes += (self.PRIOR * self.PRIOR_WEIGHT - self.successes) * self.IDLE_DRIFT
            self.trials += (self.PRIOR_WEIGHT - self.trials) * self.IDLE_DRIFT
        return k

    def update(self, proposed: int, accepted: int) -> None:
        """A verified step: ``accepted`` of ``proposed`` drafts kept (a run, so ``accepted < proposed`` means one
        rejection)."""
        self.successes = self.successes * self.DECAY + accepted
        self.trials = self.trials * self.DECAY + accepted + (accepted < proposed)


class DraftState:
    """A sequence's speculative state: its n-gram index (built for one pair of lookup lengths) and draft length."""

    def __init__(self) -> None:
        self.index: NgramIndex | None = None
        self.length = DraftLength()


def draft_state(seq) -> DraftState:
    if seq.draft_state is None:
        seq.draft_state = DraftState()
    return seq.draft_state


class NgramProposer:
    """Prompt lookup (vLLM's ``ngram``): drafts are what followed the sequence's current suffix the last time it
    occurred in its prompt or output. Free to compute; it wins where the answer repeats the prompt."""

    def propose(self, seq, params: SpecParams, k: int) -> list[int]:
        state = draft_state(seq)
        index = state.index
        if index is None or (index.min_n, index.max_n) != (params.lookup_min, params.lookup_max):
            index = state.index = NgramIndex(params.lookup_min, params.lookup_max)
        return index.propose(seq.prompt_token_ids + seq.output_token_ids, k)


class EngineProposer:
    """A proposer the engine runs on its worker thread (a draft model: ``models/draft_model.py``). The planner only
    decides how many drafts a row may carry and reserves their KV slots (``BatchPlan.draft_slots``); the engine
    fills ``BatchPlan.drafts`` (at most that many each, cut by ``cut_drafts``) before the target's forward.

    ``cost``: what one more draft costs, as a share of the target's step (one draft forward over the drafting rows,
    measured by the engine: ``observe``), which ``DraftLength`` adds to its bar. Steps without a measurement let it
    decay (``DECAY`` a step), so that a draft model found too slow once (a busy moment) is tried again later."""

    in_engine = True
    SMOOTHING = 0.2  # weight of the newest measurement
    DECAY = 0.98  # at each planned step without one

    def __init__(self) -> None:
        self.cost = 0.0

    def observe(self, draft_forward_seconds: float, step_seconds: float) -> None:
        """One step's measurement: a draft forward's wall time against the target's forward."""
        if step_seconds > 0:
            self.cost += (draft_forward_seconds / step_seconds - self.cost) * self.SMOOTHING

    def decay(self) -> None:
        self.cost *= self.DECAY


def cut_drafts(seq, drafts: list[int]) -> list[int]:
    """``drafts`` cut after a stop token of ``seq`` (the sequence would end there) and where its grammar rejects
    them (``GrammarState.valid_prefix``)."""
    for i, token in enumerate(drafts):
        if token in seq.stop_token_ids:
            drafts = drafts[: i + 1]
            break
    if seq.grammar is not None and drafts:
        drafts = drafts[: seq.grammar.valid_prefix(drafts)]
    return drafts


def verify_run(sampled: list[int], drafts: list[int]) -> list[int]:
    """The tokens a verified row emits: ``sampled[i]`` is what position ``i`` sampled given the drafts before it
    accepted (``len(drafts) + 1`` of them); each is kept up to and including the first that differs from its
    draft (the last position's, past every draft, is the bonus token)."""
    run = []
    for i, token in enumerate(sampled):
        run.append(token)
        if i >= len(drafts) or token != drafts[i]:
            break
    return run


@dataclass
class SpecStats:
    """Counters of the drafts verified so far (vLLM's ``spec_decode_*``): rows that carried drafts, draft tokens
    proposed, accepted, accepted at each position, and the tokens those rows emitted (accepted + one each)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_SPEC_TOKENS)

    def record(self, proposed: int, accepted: int, emitted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += emitted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per proposed one (0 when none was proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_num_emitted_tokens": self.num_emitted_tokens,
            "spec_accepted_per_pos": list(self.accepted_per_pos),
        }
