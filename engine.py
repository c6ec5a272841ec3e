"""The engine seam: what executes the model, one planned step at a time.

The scheduler decides, the engine executes. ``InferenceEngine`` carries its ``planner`` (``core.planner.Planner``:
the KV books and the plan of each step, built from the engine's capacity and KV geometry) and executes a plan:
``execute(plan)`` runs one forward over the plan's decode rows and prompt chunks, samples one token per sampled
row and returns them (``core.step.StepOutput``); the planner applies them (``update_from_output``). The engine
never changes a sequence's status. Subclasses supply ``_forward`` and ``_copy_block`` (and ``reset_state``).

Threading (``scheduler.py`` runs it so):

- event loop: planning (``planner.schedule`` / ``plan``), applying outputs (``planner.update_from_output``),
  aborts, ``check_admissible``, ``stats``, the prefix-cache reset: everything that reads or writes the books.
- the engine's one worker thread (``scheduler.engine_thread``): building the engine, ``execute`` (the forward,
  grammar masks, sampling, block copies), ``reset_state``, and what ``Scheduler.call_engine`` hands it between two
  steps (LoRA adapters into and out of their slots). While it executes a plan the loop leaves the plan's sequences
  and their blocks alone: aborts wait for the step boundary; the prefix-cache reset drops only blocks no sequence
  holds, and stats only read.
- the tokenizer pool (``api/serving.py``): ``encode``, ``decode``, ``apply_chat_template``.

``run_step`` (and ``admit``, ``step``, ``admit_and_step`` on it) plans, executes and applies in one synchronous
call: the driver of tests and benchmarks, which run all three on one thread.

``FakeEngine`` is deterministic and torch-free, for model-free tests. The model runtimes (``HFEngine`` on torch,
``NativeEngine`` torch-free on a model image) are in ``models/runtime.py``. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Protocol

from core.planner import Planner
from core.pooling import pool_chunk
from core.sampling import TokenLogprobs
from core.sequence import Sequence
from core.speculative import EngineProposer, SpecParams, verify_run
from core.step import AdmissionError, BatchLimits, BatchPlan, RowFailure, StepOutput, StepResult

__all__ = ["AdmissionError", "ChatTemplateError", "FakeEngine", "InferenceEngine", "RowFailure"]

log = logging.getLogger("minibatch.engine")


class Drafter(Protocol):
    """A proposer the engine runs on its worker thread before each forward (``models.draft_model.DraftModel``)."""

    forward_seconds: float | None  # the last ``propose``'s mean draft forward (one draft for each row), or None

    def propose(self, plan: BatchPlan) -> None:
        """Fill ``plan.drafts[i]`` (at most ``plan.draft_slots[i]`` tokens) for the rows with reserved slots; free
        what it holds for sequences that left. Never raises for a row: a row it cannot serve gets no drafts."""

    def reset(self) -> None:
        """Forget every sequence (after a failure)."""

    def stats(self) -> dict[str, int]:
        """Counters for the engine's stats (integers: /health carries them)."""


class ChatTemplateError(ValueError):
    """The model has no chat template (and none is configured), or rendering it failed."""


class InferenceEngine(ABC):
    """Executes planned steps within ``limits`` (``core.step.BatchLimits``: rows, context, stop ids, the KV pool's
    blocks, the chunked-prefill budget; the planner, which keeps the books, holds the same object). See
    ``core/planner.py``.
    """

    loras = None  # a ``models.lora.LoraManager`` where LoRA adapters are served (MAX_LORAS > 0), else None
    vocab_size: int  # token ids are in [0, vocab_size)
    model_name: str
    hidden_size: int | None = None  # an embedding's width (core/pooling.py); None: this engine embeds nothing

    def __init__(self, limits: BatchLimits) -> None:
        self.planner = Planner(limits)
        # A proposer run here, before each forward (a draft model: ``models/draft_model.py``; ``attach_drafter``).
        self.drafter: Drafter | None = None

    @property
    def limits(self) -> BatchLimits:
        """The planner's limits: the one object both read."""
        return self.planner.limits

    @property
    def capacity(self) -> int:
        """Sequences holding a slot at once."""
        return self.planner.limits.capacity

    @property
    def max_context(self) -> int:
        """Prompt + generated tokens one sequence may hold."""
        return self.planner.limits.max_context

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Token ids that end every sequence (the model's EOS and STOP_TOKEN_IDS)."""
        return self.planner.limits.stop_token_ids

    def attach_drafter(self, drafter: Drafter, method: str = "draft_model") -> None:
        """Requests choosing speculative ``method`` get their drafts from ``drafter``: the planner reserves their
        lookahead (``core.speculative.EngineProposer``), ``execute`` has the drafter fill them."""
        self.drafter = drafter
        self._engine_proposer = self.planner.proposers[method] = EngineProposer()

    # --- executing a plan (the worker thread) --------------------------------------------------
    def execute(self, plan: BatchPlan) -> StepOutput:
        """One forward over ``plan`` (``_forward``), then the block copies of its completing forks. Changes no
        sequence's status or tokens; on an exception nothing but cache contents changed. With a drafter, it first
        fills the drafts of the rows the planner reserved lookahead for (``plan.draft_slots``)."""
        if self.drafter is not None:
            self.drafter.propose(plan)
        if plan.is_empty:
            return StepOutput([])
        start = time.perf_counter()
        tokens = self._forward(plan)
        seconds = time.perf_counter() - start
        drafted = getattr(self.drafter, "forward_seconds", None) if plan.draft_slots else None
        if drafted is not None:  # what one draft costs against this step: the planner's bar for the next drafts
            self._engine_proposer.observe(drafted, seconds)
        for src, dst in plan.copies:
            self._copy_block(src, dst)
        return StepOutput(tokens, seconds)

    @abstractmethod
    def _forward(self, plan: BatchPlan) -> list[int | RowFailure]:
        """One forward over the plan's rows (``BatchPlan``: decode rows, then chunks, their block tables in
        ``plan.tables``), writing every fed token's K/V; one token id, or a ``RowFailure`` for a row that failed
        alone, per ``plan.samples`` entry (a chunk's forked choices sample from its logits row)."""

    @abstractmethod
    def _copy_block(self, src: int, dst: int) -> None:
        """KV block ``dst`` becomes a copy of block ``src`` (every layer): a forked choice's own partial block."""

    def reset_state(self) -> None:
        """Forget all cached tensor state (after a failure; the planner's books are reset apart). The KV pool
        needs nothing: every block is written before it is read."""
        return None

    # --- text ------------------------------------------------------------------------------------
    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize a prompt (a rendered chat template already holds its special tokens)."""

    @abstractmethod
    def decode(self, token_ids: list[int]) -> str:
        """Detokenize generated ids (special tokens skipped)."""

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Render chat messages (and the tools the model may call) into a prompt that ends where the
        assistant's answer begins."""
        raise ChatTemplateError(f"model {self.model_name!r} has no chat template")

    def control_tokens(self) -> list[str]:
        """The tokenizer's special tokens as text (``<|im_start|>``, EOS...): a chat message that types one keeps it
        as text (``text/chat_prompt.py``). None for an engine without them."""
        return []

    def encode_as_text(self, text: str) -> list[int]:
        """``text`` -> token ids with special-token strings in it tokenized as plain text, no BOS/EOS added."""
        return self.encode(text, add_special_tokens=False)

    def grammar_vocabulary(self) -> tuple | None:
        """Structured output: (HF tokenizer, vocabulary size, stop token ids) that grammars are compiled against,
        or None when this engine cannot constrain its sampling (then a grammar request gets a 400)."""
        return None

    def supports_tools(self) -> bool:
        """Whether the chat template renders ``tools`` (a request with tools is refused otherwise)."""
        return False

    # --- the books, through the planner ------------------------------------------------------------
    @property
    def blocks(self):
        """The planner's block manager (``core.block_manager.BlockManager``)."""
        return self.planner.blocks

    def num_active(self) -> int:
        return self.planner.num_active()

    def active_sequences(self) -> list[Sequence]:
        return self.planner.active_sequences()

    def check_admissible(self, seq: Sequence) -> str | None:
        """Why ``seq`` can never be admitted, or None. Cheap; called before queueing."""
        return self.planner.check_admissible(seq)

    def can_admit(self, seqs: list[Sequence]) -> bool:
        return self.planner.can_admit(seqs)

    def reset_prefix_cache(self) -> int:
        """Drop every cached KV block no sequence holds; returns how many."""
        return self.planner.reset_prefix_cache()

    def stats(self) -> dict[str, int]:
        stats = self.planner.stats()
        if self.drafter is not None:
            stats.update(self.drafter.stats())
        return stats

    # --- the synchronous driver (tests, benchmarks): plan, execute, apply in one call --------------
    def run_step(self, newcomers: list[Sequence] = (), decode: bool = True) -> StepResult:
        """Admit exactly ``newcomers`` (AdmissionError, nothing admitted, when they do not fit) and, with
        ``decode``, advance every decode row, in one forward. Atomic: when the forward fails, no token is
        committed and the newcomers hold nothing (preemptions made for the step stand)."""
        plan = self.planner.plan(list(newcomers), decode)
        try:
            output = self.execute(plan)
        except BaseException:
            self.planner.abandon(plan)
            raise
        return self.planner.update_from_output(plan, output)

    def admit(self, seqs: list[Sequence]) -> list[int]:
        """Admit ``seqs`` and run their prompts (the first chunks, when chunked): a sequence whose prompt completes
        gets its first token, and comes back finished if that was its last. Returns their seq_ids."""
        if seqs:
            self.run_step(seqs, decode=False)
        return [s.seq_id for s in seqs]

    def step(self) -> list[Sequence]:
        """Advance every decode row by one token (and the prefilling prompts by a chunk); returns what finished."""
        return self.run_step().finished

    def admit_and_step(self, seqs: list[Sequence]) -> list[Sequence]:
        """``admit`` and ``step`` in one forward (the weights stream once); returns what finished."""
        return self.run_step(seqs).finished

    def abort(self, seq_id: int) -> bool:
        """Free an admitted sequence's slot; it finishes as aborted unless already finished. False if not active."""
        return self.planner.abort(seq_id) is not None

    def reset(self) -> None:
        """Drop every admitted sequence and all cached state (after a failure)."""
        self.planner.reset()
        self.reset_state()
        if self.drafter is not None:
            self.drafter.reset()


class FakeEngine(InferenceEngine):
    """Model-free engine: deterministic tokens, byte-level tokenizer, same lifecycle as the model engines.

    Token ids: 0 is EOS, 1..256 are the bytes 0..255. By default a sequence's n-th token is a
    lowercase letter chosen from its prompt and n, so every answer identifies its prompt.
    ``token_fn(seq) -> id`` overrides that (returning a ``RowFailure`` fails that row alone);
    ``admit_fault(seqs)`` (called when newcomers are prefilled, ``_prefill``) and
    ``step_fault(step_no)`` (when running rows decode, ``_decode``) may raise to inject failures;
    ``step_delay`` sleeps per decode to mimic compute. A mixed call decodes first, then prefills.
    ``check_kv`` keeps a fake KV pool (each slot holds the token fed there) and asserts, at every forward,
    that each sequence's block table holds its own tokens before the positions it feeds, and that it
    writes only into blocks no other sequence reads (a forked choice's parent may write the blocks its
    waiting children share): a missing block copy, a write into a shared block or a wrong cache hit fails.
    """

    EOS = 0

    def __init__(
        self,
        capacity: int = 8,
        max_context: int = 1024,
        stop_token_ids: Iterable[int] = (0,),
        token_fn: Callable[[Sequence], int] | None = None,
        admit_fault: Callable[[list[Sequence]], None] | None = None,
        step_fault: Callable[[int], None] | None = None,
        step_delay: float = 0.0,
        num_blocks: int = 0,
        block_size: int = 32,
        max_num_batched_tokens: int = 0,
        prefix_caching: bool = True,
        check_kv: bool = False,
        max_prefill_while_decoding: int = 0,
        speculative: SpecParams | None = None,
    ) -> None:
        super().__init__(
            BatchLimits(
                capacity,
                max_context,
                frozenset(stop_token_ids),
                num_blocks,
                block_size,
                max_num_batched_tokens,
                prefix_caching,
                max_prefill_while_decoding,
            )
        )
        self.kv_slots: dict[int, list[int | None]] | None = {} if check_kv else None  # block -> token per slot
        if speculative is not None:
            self.planner.speculative = speculative
        self.model_name = "fake"
        self.vocab_size = 257
        self.hidden_size = 8
        self.token_fn = token_fn or self.letter_token
        self.admit_fault = admit_fault
        self.step_fault = step_fault
        self.step_delay = step_delay
        self.step_calls = 0
        self.resets = 0

    @staticmethod
    def letter_token(seq: Sequence) -> int:
        letter = (sum(seq.prompt_token_ids) * 7 + len(seq.output_token_ids) * 3) % 26
        return ord("a") + letter + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t - 1 for t in token_ids if 1 <= t <= 256).decode("utf-8", errors="replace")

    def _forward(self, plan: BatchPlan) -> list[int | list[int] | RowFailure]:
        """Decode the decode rows (a row with drafts verifies them: ``_verify``); each chunk that ends its sequence
        gets its first token, and its forked choices theirs (``_prefill``)."""
        if self.kv_slots is not None:
            for i, seq in enumerate(plan.decode):
                drafts = plan.drafts_of(i)
                self._feed(seq, seq.num_tokens - 1, seq.num_tokens + len(drafts), drafts)
            for seq, start, end in plan.chunks:
                self._feed(seq, start, end)
        for seq, start, end in plan.chunks:
            if seq.pooling is not None:
                pool_chunk(seq, self.hidden_states(seq, start, end), start, end)
        step = (
            (self._decode(plan.decode, plan.drafts) if plan.drafts else self._decode(plan.decode))
            if plan.decode
            else []
        )
        done = plan.samples[len(plan.decode) :]
        return step + (self._prefill(done, len(self.planner.rows)) if plan.chunks else [])

    def _feed(self, seq: Sequence, start: int, end: int, drafts: list[int] = ()) -> None:
        """``check_kv``: the sequence's slots [0, start) must hold its tokens; it writes tokens [start, end) (past
        its tokens, its ``drafts``)."""
        tokens, bm = seq.prompt_token_ids + seq.output_token_ids + list(drafts), self.planner.blocks
        waiting = {c.seq_id for c in self.planner.forks_of(seq.seq_id)}
        for pos in range(end):
            block, offset = bm.slot(seq.seq_id, pos)
            slots = self.kv_slots.setdefault(block, [None] * bm.block_size)
            if pos < start:
                assert slots[offset] == tokens[pos], f"seq {seq.seq_id} position {pos}: block {block} holds {slots}"
                continue
            others = set(bm.holders(block)) - {seq.seq_id}
            assert others <= waiting, f"seq {seq.seq_id} writes block {block}, which {others} hold too"
            slots[offset] = tokens[pos]

    def hidden_states(self, seq: Sequence, start: int, end: int):
        """Fake final hidden states of ``seq`` at positions [start, end): [end - start, 8], each row a function of its
        token and position, so the pooled vector tells inputs apart and depends on every token."""
        import numpy as np

        tokens = np.asarray((seq.prompt_token_ids + seq.output_token_ids)[start:end], np.float64)
        where = np.arange(start, end, dtype=np.float64)[:, None]
        return np.cos(tokens[:, None] * np.arange(1, 9) / 7 + where / 31)

    def _copy_block(self, src: int, dst: int) -> None:
        if self.kv_slots is not None:
            self.kv_slots[dst] = list(self.kv_slots[src])

    def _prefill(self, seqs: list[Sequence], first_row: int) -> list[int]:
        """First tokens for sequences whose prompt completes, headed to rows [first_row, ...) (a spy or fault
        point for tests)."""
        if self.admit_fault:
            self.admit_fault(seqs)
        for seq in seqs:  # the fake is certain of every prompt token too
            if seq.prompt_logprobs_k is not None:
                k = seq.prompt_logprobs_k
                rest = seq.prompt_token_ids[1:]
                seq.prompt_logprobs = [None] + [TokenLogprobs(t, 0.0, ((t, 0.0),)[:k]) for t in rest]
        return self._next_tokens(seqs)

    def _decode(self, seqs: list[Sequence], drafts: list[list[int]] = ()) -> list[int | list[int] | RowFailure]:
        """Next tokens for the decode rows [0, len(seqs)), a run for each row with drafts (a spy or fault point for
        tests)."""
        self.step_calls += 1
        if self.step_fault:
            self.step_fault(self.step_calls)
        if self.step_delay:
            time.sleep(self.step_delay)
        if not any(drafts):
            return self._next_tokens(seqs)
        return [self._verify(seq, d) if d else self._next_tokens([seq])[0] for seq, d in zip(seqs, drafts)]

    def _verify(self, seq: Sequence, drafts: list[int]) -> list[int] | RowFailure:
        """The run a row verifying ``drafts`` emits: ``token_fn`` at each position, as if the drafts before it were
        accepted (it reads a copy of the sequence with them appended), up to the first that differs."""
        sampled = []
        for i in range(len(drafts) + 1):
            view = seq if i == 0 else dataclasses.replace(seq, output_token_ids=seq.output_token_ids + drafts[:i])
            token = self.token_fn(view)
            if isinstance(token, RowFailure):
                if not sampled:
                    return token
                break
            sampled.append(token)
            if i < len(drafts) and token != drafts[i]:
                break
        run = verify_run(sampled, drafts)
        if seq.logprobs is not None:
            seq.output_logprobs += [TokenLogprobs(t, 0.0, [(t, 0.0)][: seq.logprobs]) for t in run]
        return run

    def _next_tokens(self, seqs: list[Sequence]) -> list[int | RowFailure]:
        """token_fn per sequence (a RowFailure fails that row alone); a requested logprob is 0.0 (the fake
        is certain of its choice)."""
        tokens = [self.token_fn(s) for s in seqs]
        for seq, token in zip(seqs, tokens):
            if seq.logprobs is not None and not isinstance(token, RowFailure):
                seq.output_logprobs.append(TokenLogprobs(token, 0.0, ((token, 0.0),)[: seq.logprobs]))
        return tokens

    def reset_state(self) -> None:
        self.resets += 1
        if self.kv_slots is not None:
            self.kv_slots.clear()
