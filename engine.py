"""The engine seam: what the scheduler may ask of whatever executes the model.

``InferenceEngine`` is the contract (capacity, admit, step, abort, reset).
``BatchEngine`` implements the sequence bookkeeping every engine shares: slots as
contiguous rows, stopping, eviction and row compaction; subclasses supply only the
tensor work (``_forward``, ``_move_row``, ``_reset_state``).
``FakeEngine`` is deterministic and torch-free, for model-free tests. ``HFEngine``
runs a Hugging Face checkpoint (GPT-2 or Llama family) through our hand-written
forward (the ``models`` package). This module imports no torch: ``HFEngine``
imports it when built.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from typing import Callable, Iterable

from config import Config
from sampling import TokenLogprobs, logprobs, sample
from sequence import Sequence, SequenceStatus

log = logging.getLogger("minibatch.engine")


class AdmissionError(ValueError):
    """A sequence cannot be admitted (too long, empty, over capacity). Nothing was admitted."""


class ChatTemplateError(ValueError):
    """The model has no chat template (and none is configured), or rendering it failed."""


class InferenceEngine(ABC):
    """Executes sequences; the scheduler decides which and when.

    Threading: every method but ``encode``/``decode`` is called from one worker thread
    at a time (the scheduler's), never concurrently.
    """

    capacity: int  # most sequences active at once
    max_context: int  # prompt + generated tokens one sequence may hold
    vocab_size: int  # token ids are in [0, vocab_size)
    model_name: str

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize a prompt (a rendered chat template already holds its special tokens)."""

    @abstractmethod
    def decode(self, token_ids: list[int]) -> str:
        """Detokenize generated ids (special tokens skipped)."""

    @abstractmethod
    def num_active(self) -> int:
        """Sequences currently holding a slot."""

    @abstractmethod
    def admit(self, seqs: list[Sequence]) -> list[int]:
        """Atomically admit ``seqs``: prefill them and give each its first token.

        Returns their seq_ids. On any failure nothing is admitted, the active batch is
        untouched and the exception propagates. A sequence that finishes on its first
        token comes back already finished and holds no slot.
        """

    @abstractmethod
    def step(self) -> list[Sequence]:
        """Advance every active sequence by exactly one token; return those that finished."""

    @abstractmethod
    def admit_and_step(self, seqs: list[Sequence]) -> list[Sequence]:
        """Advance every active sequence by one token and admit ``seqs`` (first token) in one call.

        Returns every sequence that finished, newcomers included. An engine that runs both in
        one forward streams the weights once instead of twice. Atomic: on failure nothing is
        committed (no token appended, no newcomer admitted), so the caller may retry the
        admission and the step separately to find out which part fails.
        """

    @abstractmethod
    def abort(self, seq_id: int) -> bool:
        """Free an active sequence's slot; it finishes as aborted unless it already has a finished status. False if not active."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every active sequence and return to an empty, usable state (after a failure)."""

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Render chat messages into a prompt that ends where the assistant's answer begins."""
        raise ChatTemplateError(f"model {self.model_name!r} has no chat template")

    def check_admissible(self, seq: Sequence) -> str | None:
        """Why ``seq`` can never be admitted, or None. Cheap; called before queueing."""
        if seq.prompt_len == 0:
            return "prompt is empty after tokenization"
        if seq.prompt_len + seq.max_new_tokens > self.max_context:
            return (
                f"prompt ({seq.prompt_len} tokens) + max_new_tokens ({seq.max_new_tokens}) "
                f"exceeds the model's context window of {self.max_context} tokens"
            )
        return None

    def stats(self) -> dict[str, int]:
        return {}


class BatchEngine(InferenceEngine):
    """Sequence bookkeeping over ``capacity`` rows; the active sequences fill rows [0, n)."""

    def __init__(self, capacity: int, max_context: int, stop_token_ids: Iterable[int]) -> None:
        self.capacity = capacity
        self.max_context = max_context
        self.stop_token_ids = frozenset(stop_token_ids)
        self._rows: list[Sequence] = []  # _rows[r] owns row r of the KV cache
        self._steps = 0
        self._peak_batch = 0
        self._tokens = 0

    # --- tensor work, supplied by subclasses -------------------------------------------------
    @abstractmethod
    def _forward(self, running: list[Sequence], newcomers: list[Sequence]) -> list[int]:
        """One forward: the next token of each of ``running`` and the first token of each newcomer.

        ``running`` is either empty or every active sequence (``running[r]`` owns row r, rows
        [0, n)); the newcomers are prefilled into rows [n, n + len(newcomers)) where n is the
        number of active sequences, whether or not they decode in this call. Returns one token id
        per sequence of ``running + newcomers``, in that order. Commits nothing but cache
        contents at those rows/positions: on an exception the caller commits no token.
        """

    def _move_row(self, src: int, dst: int, length: int) -> None:
        """Move row src's cached positions [0, length) to row dst."""

    def _reset_state(self) -> None:
        """Forget all cached state."""

    # --- the seam ----------------------------------------------------------------------------
    def num_active(self) -> int:
        return len(self._rows)

    def active_sequences(self) -> list[Sequence]:
        return list(self._rows)

    def admit(self, seqs: list[Sequence]) -> list[int]:
        if not seqs:
            return []
        self._check_newcomers(seqs)
        start = time.perf_counter()
        first_tokens = self._forward([], seqs)  # may raise: nothing is committed yet
        self._commit_newcomers(seqs, first_tokens, start, time.perf_counter())
        self._evict([s for s in seqs if s.is_finished])
        return [s.seq_id for s in seqs]

    def step(self) -> list[Sequence]:
        if not self._rows:
            return []
        tokens = self._forward(self._rows, [])
        self._commit_step(tokens, time.perf_counter())
        finished = [s for s in self._rows if s.is_finished]
        self._evict(finished)
        return finished

    def admit_and_step(self, seqs: list[Sequence]) -> list[Sequence]:
        if not seqs:
            return self.step()
        if not self._rows:
            self.admit(seqs)
            return [s for s in seqs if s.is_finished]
        self._check_newcomers(seqs)
        start = time.perf_counter()
        n = len(self._rows)
        tokens = self._forward(self._rows, seqs)  # may raise: nothing committed
        now = time.perf_counter()
        self._commit_step(tokens[:n], now)
        self._commit_newcomers(seqs, tokens[n:], start, now)
        finished = [s for s in self._rows if s.is_finished]
        self._evict(finished)
        return finished

    def _check_newcomers(self, seqs: list[Sequence]) -> None:
        if len(self._rows) + len(seqs) > self.capacity:
            raise AdmissionError(f"{len(seqs)} newcomers exceed free capacity {self.capacity - len(self._rows)}")
        for seq in seqs:
            reason = self.check_admissible(seq)
            if reason:
                raise AdmissionError(f"sequence {seq.seq_id}: {reason}")

    def _commit_newcomers(self, seqs: list[Sequence], first_tokens: list[int], start: float, now: float) -> None:
        """The newcomers take rows [n, n + len(seqs)) with their first tokens."""
        self._rows.extend(seqs)
        for seq, token in zip(seqs, first_tokens):
            seq.status = SequenceStatus.RUNNING
            seq.admit_time = start
            if not seq.ignore_eos:
                seq.stop_token_ids = seq.stop_token_ids | self.stop_token_ids
            seq.append_token(token, now)
        self._tokens += len(seqs)
        self._peak_batch = max(self._peak_batch, len(self._rows))

    def _commit_step(self, tokens: list[int], now: float) -> None:
        """Each active sequence (rows [0, n), in order) takes its next token."""
        for seq, token in zip(self._rows, tokens):
            seq.append_token(token, now)
        self._steps += 1
        self._tokens += len(self._rows)
        self._peak_batch = max(self._peak_batch, len(self._rows))

    def abort(self, seq_id: int) -> bool:
        for seq in self._rows:
            if seq.seq_id == seq_id:
                seq.finish(SequenceStatus.FINISHED_ABORTED)
                self._evict([seq])
                return True
        return False

    def reset(self) -> None:
        self._rows.clear()
        self._reset_state()

    def stats(self) -> dict[str, int]:
        return {"steps": self._steps, "peak_batch": self._peak_batch, "generated_tokens": self._tokens}

    def _evict(self, leaving: list[Sequence]) -> None:
        """Free the rows of ``leaving`` and keep the survivors in rows [0, n) by moving tail rows into holes."""
        if not leaving:
            return
        gone = {self._rows.index(s) for s in leaving}
        keep = len(self._rows) - len(gone)
        holes = sorted(r for r in gone if r < keep)
        movers = [r for r in range(keep, len(self._rows)) if r not in gone]
        for src, dst in zip(movers, holes):
            # The row holds K/V for every token but the newest, which has not been fed yet.
            self._move_row(src, dst, self._rows[src].num_tokens - 1)
            self._rows[dst] = self._rows[src]
        del self._rows[keep:]


class FakeEngine(BatchEngine):
    """Model-free engine: deterministic tokens, byte-level tokenizer, same lifecycle as HFEngine.

    Token ids: 0 is EOS, 1..256 are the bytes 0..255. By default a sequence's n-th token is a
    lowercase letter chosen from its prompt and n, so every answer identifies its prompt.
    ``token_fn(seq) -> id`` overrides that; ``admit_fault(seqs)`` (called when newcomers are
    prefilled, ``_prefill``) and ``step_fault(step_no)`` (when running rows decode, ``_decode``)
    may raise to inject failures; ``step_delay`` sleeps per decode to mimic compute. A mixed
    call decodes first, then prefills.
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
    ) -> None:
        super().__init__(capacity, max_context, stop_token_ids)
        self.model_name = "fake"
        self.vocab_size = 257
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

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t - 1 for t in token_ids if 1 <= t <= 256).decode("utf-8", errors="replace")

    def _forward(self, running: list[Sequence], newcomers: list[Sequence]) -> list[int]:
        step = self._decode(running) if running else []
        return step + (self._prefill(newcomers, len(self._rows)) if newcomers else [])

    def _prefill(self, seqs: list[Sequence], first_row: int) -> list[int]:
        """First tokens for newcomers headed to rows [first_row, ...) (a spy or fault point for tests)."""
        if self.admit_fault:
            self.admit_fault(seqs)
        for seq in seqs:  # the fake is certain of every prompt token too
            if seq.prompt_logprobs_k is not None:
                k = seq.prompt_logprobs_k
                seq.prompt_logprobs = [None] + [TokenLogprobs(t, 0.0, [(t, 0.0)][:k]) for t in seq.prompt_token_ids[1:]]
        return self._next_tokens(seqs)

    def _decode(self, seqs: list[Sequence]) -> list[int]:
        """Next tokens for rows [0, len(seqs)) (a spy or fault point for tests)."""
        self.step_calls += 1
        if self.step_fault:
            self.step_fault(self.step_calls)
        if self.step_delay:
            time.sleep(self.step_delay)
        return self._next_tokens(seqs)

    def _next_tokens(self, seqs: list[Sequence]) -> list[int]:
        """token_fn per sequence; a requested logprob is 0.0 (the fake is certain of its choice)."""
        tokens = [self.token_fn(s) for s in seqs]
        for seq, token in zip(seqs, tokens):
            if seq.logprobs is not None:
                seq.output_logprobs.append(TokenLogprobs(token, 0.0, [(token, 0.0)][: seq.logprobs]))
        return tokens

    def _reset_state(self) -> None:
        self.resets += 1


class HFEngine(BatchEngine):
    """A Hugging Face checkpoint on our hand-written forward over a preallocated KV cache.

    ``checkpoints.load_checkpoint`` loads tokenizer and model (hub id, local directory or
    ``.gguf``); the weights are copied into the family's forward (``models.families()``, keyed by
    ``config.model_type``) and the HF module is dropped.
    """

    def __init__(self, config: Config) -> None:
        import torch  # deferred: the server stack must stay importable without torch

        from checkpoints import eos_ids, load_checkpoint
        from models import families

        torch.set_num_threads(config.num_threads or physical_cores())
        self.device = resolve_device(config.device)
        self.tokenizer, hf_model = load_checkpoint(config.model_id)
        hf_config = hf_model.config
        supported = families()
        if hf_config.model_type not in supported:
            raise ValueError(
                f"model architecture {hf_config.model_type!r} of {config.model_id!r} is not supported; "
                f"supported: {', '.join(sorted(supported))}"
            )
        family = supported[hf_config.model_type]
        window = family.context_window(hf_config)
        max_context = min(window, config.max_model_len) if config.max_model_len else window
        stops = eos_ids(hf_model, self.tokenizer) | set(config.stop_token_ids)
        super().__init__(config.max_batch_size, max_context, stops)
        self.model_name = config.model_id
        self.vocab_size = hf_config.vocab_size
        self.chat_template = config.chat_template_text() or getattr(self.tokenizer, "chat_template", None)
        self.model = family(
            hf_model.eval(), config.max_batch_size, max_context, self.device, use_small_gemm=config.small_gemm
        )
        del hf_model
        log.info(
            "loaded %s on %s: %d slots x %d tokens, KV cache %.1f MiB, oneDNN linears %s, small-batch kernel %s, "
            "%d threads",
            config.model_id, self.device, self.capacity, max_context,
            self.model.kv.nbytes / 2**20, self.model.onednn, self.model.small_gemm, torch.get_num_threads(),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if not self.chat_template:
            raise ChatTemplateError(
                f"model {self.model_name!r} has no chat template; set CHAT_TEMPLATE to a Jinja template "
                "(text or a file path) to use /v1/chat/completions"
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # a template that raises on these messages (e.g. role order)
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from None

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _forward(self, running: list[Sequence], newcomers: list[Sequence]) -> list[int]:
        """One forward for both (either may be empty): the weights stream once (a decode step alone is
        bound by that)."""
        first_row = len(self._rows)
        every = [s.prompt_logprobs_k is not None for s in newcomers]
        logits = self.model.forward(
            [s.last_token_id for s in running],
            [s.num_tokens - 1 for s in running],
            [s.prompt_token_ids for s in newcomers],
            list(range(first_row, first_row + len(newcomers))),
            every if any(every) else (),
        )  # [len(running) + len(newcomers), V], or more rows: every position of a prompt that asked for them
        if any(every):
            logits = self._take_prompt_logprobs(logits, len(running), newcomers)
        return self._next_tokens(logits, running + newcomers)

    def _take_prompt_logprobs(self, logits, n_decode: int, newcomers: list[Sequence]):
        """logits: the decode rows, then per newcomer its last position or, if it asked for prompt logprobs,
        all its positions. Fills those newcomers' ``prompt_logprobs`` (position p's row predicts token p + 1,
        from the raw logits) and returns the rows sampling needs: [n_decode + len(newcomers), V]."""
        import torch

        keep, start = list(range(n_decode)), n_decode
        for seq in newcomers:
            n = seq.prompt_len if seq.prompt_logprobs_k is not None else 1
            if seq.prompt_logprobs_k is not None:
                scored = logprobs(logits[start : start + n - 1], seq.prompt_token_ids[1:], seq.prompt_logprobs_k)
                seq.prompt_logprobs = [None, *scored]
            keep.append(start + n - 1)
            start += n
        return logits[torch.tensor(keep, device=logits.device)]

    def _next_tokens(self, logits, seqs: list[Sequence]) -> list[int]:
        """logits: [N, V] for seqs -> one token id each, under each sequence's SamplingParams.

        Logprobs, where asked for, come from the raw logits (before penalties and temperature).
        """
        tokens = sample(
            logits,
            [s.sampling for s in seqs],
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
        )
        wanted = [i for i, s in enumerate(seqs) if s.logprobs is not None]
        if wanted:
            k = max(seqs[i].logprobs for i in wanted)
            rows = logits if len(wanted) == len(seqs) else logits[wanted]
            for i, lp in zip(wanted, logprobs(rows, [tokens[i] for i in wanted], k)):
                seqs[i].output_logprobs.append(lp._replace(top=lp.top[: seqs[i].logprobs]))
        return tokens

    def _move_row(self, src: int, dst: int, length: int) -> None:
        self.model.kv.move_row(src, dst, length)


def resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads share a core's FPUs)."""
    try:
        cores = set()
        cpu = phys = None
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "processor":
                    cpu = int(value)
                elif key == "physical id":
                    phys = value.strip()
                elif key == "core id" and cpu in os.sched_getaffinity(0):
                    cores.add((phys, value.strip()))
        if cores:
            return len(cores)
    except (OSError, ValueError, AttributeError):
        pass
    return os.cpu_count() or 1


def build_engine(config: Config) -> InferenceEngine:
    """The engine MODEL_ID asks for: ``fake`` -> FakeEngine, anything else -> HFEngine."""
    if config.is_fake:
        return FakeEngine(capacity=config.max_batch_size, stop_token_ids=(FakeEngine.EOS, *config.stop_token_ids))
    return HFEngine(config)
