"""One engine step as data: what the planner decided (``BatchPlan``, vLLM's ``SchedulerOutput``), what the engine
computed (``StepOutput``), and what applying it changed (``StepResult``); and the limits every step keeps
(``BatchLimits``: one object, the engine's and its planner's). No torch.

The scheduler asks the planner (``core/planner.py``) for a ``BatchPlan`` on the event loop, the engine executes
it on its worker thread and returns a ``StepOutput`` (one token, or a ``RowFailure``, per sampled row), and the
planner applies that output back on the loop (``Planner.update_from_output``): the one place where sequences
take tokens and change status.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from core.sequence import Sequence


@dataclass
class BatchLimits:
    """What the config says of every step: ``capacity`` rows of sequences of up to ``max_context`` tokens, ending at
    ``stop_token_ids``; a pool of ``num_blocks`` KV blocks of ``block_size`` tokens (0: enough for every row at
    ``max_context``); prompts in chunks of at most ``max_num_batched_tokens`` tokens per step (0: whole prompts), at
    most ``max_prefill_while_decoding`` of them while rows decode (0: no cap of its own); ``prefix_caching``; a
    sliding window of ``kv_window`` keys on every layer (0: none; blocks that left it go back to the pool).

    One object, built once from the config (``models.model_engine.ModelEngine._init_batching``, ``FakeEngine``):
    the planner holds it (``Planner.limits``) and the engine reads it there (``InferenceEngine.limits``)."""

    capacity: int
    max_context: int
    stop_token_ids: frozenset[int] = frozenset()
    num_blocks: int = 0
    block_size: int = 32
    max_num_batched_tokens: int = 0
    prefix_caching: bool = True
    max_prefill_while_decoding: int = 0
    kv_window: int = 0


class AdmissionError(ValueError):
    """A sequence cannot be admitted (too long, empty, over capacity). Nothing was admitted."""


class RowFailure(NamedTuple):
    """What the engine returns instead of a token for a row that failed alone (the others go on).

    ``reason`` is stable text for clients; the internal detail is logged where the failure happens.
    """

    reason: str


class Chunk(NamedTuple):
    """Tokens ``[start, end)`` of ``seq`` fed at those positions (its earlier tokens are in its blocks)."""

    seq: Sequence
    start: int
    end: int

    @property
    def ends_prompt(self) -> bool:
        """Whether this chunk feeds the sequence's last token: the forward samples its first token."""
        return self.end == self.seq.num_tokens


@dataclass
class BatchPlan:
    """One step, decided. The engine executes it; nothing in it changes while it runs.

    Rows of the forward, in order: each ``decode`` sequence feeds its last token (position ``num_tokens - 1``),
    then each ``chunks`` entry feeds its tokens. ``tables[i]`` is the block table of the i-th row's sequence
    (decode rows, then chunks), covering every position fed. The forward samples one token for each of
    ``samples``: the decode rows, then, for each chunk that ends its prompt, that sequence followed by the
    choices forked from it (``forks``: they sample from its logits row, each under its own parameters).
    After the forward, ``copies`` (src, dst) give each completing fork its own copy of the parent's partial
    last block.

    Speculative decoding (``core/speculative.py``): ``drafts[i]`` (empty, or one list per decode row) are the draft
    tokens decode row ``i`` feeds after its last token, at positions ``num_tokens .. num_tokens + k - 1``, its block
    table covering them; the forward computes logits at every one of its positions and returns the row's emitted
    run (a list of tokens) instead of one token. ``draft_slots[i]`` (empty, or one count per decode row): the
    lookahead slots reserved for an engine-run proposer (a draft model), whose drafts the engine writes into
    ``drafts[i]`` (at most that many) before its forward: the one part of a plan the engine fills in.
    """

    decode: list[Sequence] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    newcomers: list[Sequence] = field(default_factory=list)  # admitted by this plan (they hold blocks now)
    forks: dict[int, list[Sequence]] = field(default_factory=dict)  # parent seq_id -> choices completing with it
    preempted: list[Sequence] = field(default_factory=list)  # sent back to the queue before this step
    samples: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # per decode row (empty: no row carries drafts)
    draft_slots: list[int] = field(default_factory=list)  # per decode row, for the engine's proposer (empty: none)
    start: float = 0.0  # when the plan was made (a newcomer's admit_time)

    @property
    def loras(self) -> list[int]:
        """Each row's LoRA adapter id (``Sequence.lora_id``, 0: the base model): the decode rows', then the chunks'."""
        return [s.lora_id for s in self.decode] + [c.seq.lora_id for c in self.chunks]

    @property
    def is_empty(self) -> bool:
        """Nothing to run: no decode row, no chunk."""
        return not self.decode and not self.chunks

    def drafts_of(self, row: int) -> list[int]:
        """The draft tokens decode row ``row`` verifies ([] for none)."""
        return self.drafts[row] if self.drafts else []

    @property
    def lookahead(self) -> list[int]:
        """The KV slots each decode row holds past its last token for drafts (reserved by the planner, rolled back
        when the output is applied): its drafts', or those reserved for the engine's proposer."""
        slots = self.draft_slots or [0] * len(self.decode)
        return [max(len(self.drafts_of(i)), slots[i]) for i in range(len(self.decode))] if self.drafts else []

    @property
    def num_draft_tokens(self) -> int:
        return sum(map(len, self.drafts))

    @property
    def ending(self) -> list[Chunk]:
        """The chunks that end their prompt (each samples its sequence's first token)."""
        return [c for c in self.chunks if c.ends_prompt]


@dataclass
class StepOutput:
    """What the engine computed for a plan: one token id (or ``RowFailure``) per ``BatchPlan.samples`` entry; for a
    decode row that verified drafts, the list of tokens it emits (its accepted drafts, then the token sampled after
    them: ``core.speculative.verify_run``). ``seconds``: the forward's wall time (0: not measured), which the planner
    learns a step's cost by its rows from (``core.speculative.StepCost``)."""

    tokens: list[int | list[int] | RowFailure]
    seconds: float = 0.0


@dataclass
class StepResult:
    """What applying a step's output changed: the sequences that finished (they hold no slot any more) and the
    ones preempted before it (back to the front of the queue, tokens kept)."""

    finished: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
