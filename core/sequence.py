"""One object per request: its inputs, its status, its tokens and its timestamps.

The scheduler creates a ``Sequence`` when a request arrives (WAITING), the engine
moves it to RUNNING at admission and to a FINISHED_* status when it ends. The
finished statuses say *why* and map one-to-one onto the API's ``finish_reason``.
Sequences are keyed by an internal ``seq_id``; the client's ``request_id`` is a
label only, so two requests with the same id never see each other's tokens.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from core.sampling import SamplingParams

_seq_ids = itertools.count(1)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token
    FINISHED_LENGTH = "finished_length"  # reached its own max_new_tokens
    FINISHED_ABORTED = "finished_aborted"  # cancelled (client left, shutdown)
    FINISHED_TIMEOUT = "finished_timeout"  # past its queue or request time limit
    FINISHED_ERROR = "finished_error"  # the engine failed while it ran

    @property
    def is_finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


# The error of a sequence whose grammar's matcher failed (llguidance's parser limits, a grammar with no way on).
GRAMMAR_FAILED = "the output's grammar cannot be followed"

FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_TIMEOUT: "timeout",
    SequenceStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Sequence:
    prompt_token_ids: list[int]
    max_new_tokens: int
    request_id: str = ""
    # Fair scheduling (core/fair_queue.py): who sent it (api.serving.client_id) and which HTTP request it is part of
    # (one key for a request's prompts x n choices; 0 = a request of its own).
    client_id: str = ""
    request_key: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False  # when True the engine's EOS/stop ids are not added
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and the top k
    output_logprobs: list[Any] = field(default_factory=list)  # one sampling.TokenLogprobs per output token
    # None: none; k >= 0: each prompt token's logprob given the tokens before it, and the top k, computed in
    # the prefill forward into prompt_logprobs: None for the first token (nothing precedes it), then one
    # sampling.TokenLogprobs per prompt token.
    prompt_logprobs_k: int | None = None
    prompt_logprobs: list[Any] = field(default_factory=list)
    # Structured output: a guided.grammars.GrammarState (None: unconstrained). The engine masks the row's
    # logits with it; append_token advances it, so it always matches output_token_ids (preemption included).
    grammar: Any = None
    # Speculative decoding: a core.speculative.SpecParams (None: the server's default), and its state over this
    # sequence (core.speculative.DraftState: the n-gram index, the measured acceptance), kept across steps and
    # preemptions (tokens only append).
    speculation: Any = None
    draft_state: Any = field(default=None, repr=False)
    # Embeddings (core/pooling.py): "mean" or "last" makes this a prompt to embed, finished after its prompt with no
    # token generated; ``embedding`` holds the pooling state, then the vector (or a RowFailure).
    pooling: str | None = None
    embedding: Any = field(default=None, repr=False)
    # perf_counter() deadlines; None = no limit. Past them the scheduler ends it as FINISHED_TIMEOUT.
    queue_deadline: float | None = None
    deadline: float | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    error_status: int = 500  # the HTTP status of a FINISHED_ERROR answer (422: the request's own fault)
    # LoRA adapter (models/lora.py): the id the server gave the adapter this request chose at its load, 0 for the
    # base model. Its K/V differ from the base's: it seeds the prefix cache's chain hashes (core/block_manager.py).
    lora_id: int = 0
    # Prefix cache: chain hashes of the sequence's full blocks so far (the engine extends them as blocks fill;
    # block_manager.extend_block_hashes), and how many prompt tokens its first admission found cached.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int | None = None
    # Parallel sampling (``n`` > 1): the choices of one prompt, choice 0 first, one list shared by all of them
    # (``group_choices``); the engine prefills the prompt once and forks it to the others. None: alone.
    group: list[Sequence] | None = field(default=None, repr=False)
    # perf_counter() timestamps; None until the event happens.
    arrival_time: float = field(default_factory=time.perf_counter)
    admit_time: float | None = None
    slot_since: float | None = None  # when it last took a batch slot (the planner sets it at every admission)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int, now: float) -> None:
        """Record one generated token and finish the sequence if it should stop."""
        if self.first_token_time is None:
            self.first_token_time = now
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
            if self.grammar.error is not None:  # the matcher cannot go on: the answer would not parse
                self.finish(SequenceStatus.FINISHED_ERROR, now, f"{GRAMMAR_FAILED}: {self.grammar.error}", 422)
                return
        if token_id in self.stop_token_ids or (self.grammar is not None and self.grammar.is_finished):
            self.finish(SequenceStatus.FINISHED_STOPPED, now)
        elif len(self.output_token_ids) >= self.max_new_tokens:
            self.finish(SequenceStatus.FINISHED_LENGTH, now)

    def finish(
        self, status: SequenceStatus, now: float | None = None, error: str | None = None, error_status: int = 500
    ) -> None:
        """End it with ``status``; ``error_status``: the HTTP status of a failure's answer (500: the server's fault;
        422: the request's, e.g. a grammar no answer can complete)."""
        assert status.is_finished, status
        if self.is_finished:
            return
        self.status = status
        self.error = error
        self.error_status = error_status
        self.finish_time = time.perf_counter() if now is None else now
        if self.grammar is not None:
            self.grammar.release()  # its matcher's memory goes now, not when the request's answer is sent

    def metrics_ms(self) -> dict[str, float]:
        """Per-request latency breakdown in milliseconds (all from arrival)."""
        end = self.finish_time if self.finish_time is not None else time.perf_counter()
        admit = self.admit_time if self.admit_time is not None else end
        first = self.first_token_time if self.first_token_time is not None else end
        return {
            "queue_wait_ms": (admit - self.arrival_time) * 1e3,
            "ttft_ms": (first - self.arrival_time) * 1e3,
            "generate_ms": (end - admit) * 1e3,
            "e2e_ms": (end - self.arrival_time) * 1e3,
        }


def group_choices(seqs: list[Sequence]) -> None:
    """Mark ``seqs``, the choices of one prompt (choice 0 first), as one group: admitted together, the first
    prefills the prompt and the others fork its KV blocks instead of computing them again."""
    group = list(seqs)
    for seq in group:
        seq.group = group
