"""The engine seam: what the scheduler may ask of whatever executes the model.

``InferenceEngine`` is the contract (capacity, admit, step, abort, reset).
``BatchEngine`` implements the sequence bookkeeping every engine shares: slots as
contiguous rows, KV memory as blocks of a pool (``block_manager.BlockManager``: admission
by memory, growth, preemption), stopping, eviction and row compaction; subclasses supply
only the tensor work (``_forward``, ``_move_row``, ``_reset_state``).
``FakeEngine`` is deterministic and torch-free, for model-free tests. ``HFEngine``
runs a Hugging Face checkpoint (GPT-2 or Llama family) through our hand-written
forward (the ``models`` package). This module imports no torch: ``HFEngine``
imports it when built.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import NamedTuple

from config import Config
from core.block_manager import BlockManager, extend_block_hashes
from core.sampling import NonFiniteLogits, TokenLogprobs, apply_token_bitmask, grammar_bitmask, logprobs, sample
from core.sequence import Sequence, SequenceStatus
from model_runner import ModelRunner
from models.kernels import int_dot
from models.kernels.build import kernel_isa, set_kernel_isa
from models.kv_dtype import bytes_per_token as bytes_per_kv_token
from models.kv_dtype import unavailable_reason as kv_dtype_unavailable
from models.loading import ModelLoadError
from models.native_memory import HeapTrimmer

log = logging.getLogger("minibatch.engine")


class AdmissionError(ValueError):
    """A sequence cannot be admitted (too long, empty, over capacity). Nothing was admitted."""


class ChatTemplateError(ValueError):
    """The model has no chat template (and none is configured), or rendering it failed."""


class RowFailure(NamedTuple):
    """What ``_forward`` returns instead of a token for a row that failed alone (the others go on).

    ``reason`` is stable text for clients; the internal detail is logged where the failure happens.
    """

    reason: str


NON_FINITE_LOGITS = "the model's output for this sequence was not finite (NaN or inf); it was stopped"
SAMPLING_FAILED = "sampling the next token for this sequence failed; it was stopped"


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
        """Advance every active sequence by exactly one token; return those that finished.

        A row that fails alone (non-finite logits, a sampling failure) finishes as FINISHED_ERROR with a
        stable ``error`` and is returned with the finished; the other rows take their tokens as usual.
        """

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
        """Free an active sequence's slot; it finishes as aborted unless it already has a finished status.

        False if not active."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every active sequence and return to an empty, usable state (after a failure)."""

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Render chat messages (and the tools the model may call) into a prompt that ends where the
        assistant's answer begins."""
        raise ChatTemplateError(f"model {self.model_name!r} has no chat template")

    def grammar_vocabulary(self) -> tuple | None:
        """Structured output: (HF tokenizer, vocabulary size, stop token ids) that grammars are compiled against,
        or None when this engine cannot constrain its sampling (then a grammar request gets a 400)."""
        return None

    def supports_tools(self) -> bool:
        """Whether the chat template renders ``tools`` (a request with tools is refused otherwise)."""
        return False

    def can_admit(self, seqs: list[Sequence]) -> bool:
        """Whether ``seqs`` could all be admitted now (free slots; engines with a KV pool: free memory)."""
        return self.num_active() + len(seqs) <= self.capacity

    def take_preempted(self) -> list[Sequence]:
        """Sequences the last calls preempted (status WAITING again, tokens kept), oldest admission first;
        the caller queues them again at the front. Each is returned once."""
        return []

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

    def reset_prefix_cache(self) -> int:
        """Drop every cached KV block no sequence holds; returns how many (engines without a cache: 0)."""
        return 0

    def stats(self) -> dict[str, int]:
        return {}


class BatchEngine(InferenceEngine):
    """Sequence bookkeeping over ``capacity`` rows; the active sequences fill rows [0, n).

    KV memory is ``num_blocks`` blocks of ``block_size`` tokens (0: enough for every row at
    ``max_context``, so nothing is ever preempted). A sequence holds blocks for every token
    it has fed the model: all of them at admission (the prompt, or prompt + output when a
    preempted sequence is recomputed), one more slot per decode step. When a running sequence
    needs a block and none is free, the most recently admitted one is preempted (vLLM's rule):
    its blocks are freed, it leaves the batch with its tokens and status WAITING, and
    ``take_preempted`` hands it back to the scheduler, which readmits it later: recomputed by
    a prefill over prompt + output, so it continues exactly where it stopped.

    Chunked prefill (``max_num_batched_tokens`` > 0): each forward feeds the decode rows first,
    then prompt chunks of the admitted-but-prefilling sequences, oldest first, up to that many
    tokens in all (at least one chunk token per step). While any row decodes, the chunks of a step
    carry at most ``max_prefill_while_decoding`` tokens (0: no cap of their own): a newcomer's prompt
    then loads over a few short steps instead of stretching every running stream's next gap by its whole
    prefill. A sequence gets its first token from the forward that computes its last chunk, then decodes
    like any row. It holds its blocks (and a place in ``capacity``) from admission on.

    Prefix caching (``prefix_caching``, on by default; the block manager owns the cache): every full
    block a sequence has computed is registered under its chain hash after the forward that wrote it
    (``_cache_computed``), and stays cached when the sequence ends, is aborted or preempted, until the
    pool needs the block. A newcomer shares the longest cached prefix of its tokens in whole blocks
    (short of the block holding its last token, whose logits it needs) and prefills only the rest: a
    chunk that starts past the shared blocks. Admission counts only the blocks it really takes
    (``BlockManager.admission_cost``). A newcomer whose next uncached block is being computed right now by
    an admitted sequence (or by one admitted ahead of it in the same call) waits for it instead of
    computing it again (``_waits_for_prefix``): identical prompts, the choices of an ``n`` > 1 request and
    a burst of requests with one system prompt prefill their common part once. A sequence that still
    needs its prompt logprobs skips the lookup: cached blocks have no logits.

    Parallel sampling (the choices of an ``n`` > 1 request, ``Sequence.group``) forks instead: a choice admitted
    while another choice of its group computes the same prompt (admitted earlier in the same call, or still
    prefilling in chunks) takes no prompt of its own (``_fork_sources``). It shares every block of that parent
    (``BlockManager.fork``: full blocks by refcount, a fresh block for the partial last one), waits while the
    parent prefills, and when the parent's last chunk is computed it gets a copy of the parent's partial block
    (``_copy_block``), the parent's prompt logprobs, and its first token sampled from the parent's logits row
    under its own sampling parameters (``_with_forks``): the prompt is computed once for all n choices and no
    choice writes into a block another holds. A parent that leaves before its prompt is complete (aborted,
    preempted) hands its place to its first child (``_hand_over``). A choice that can no longer fork (its
    parent already decodes, or it was preempted after its first token) is admitted like any sequence.
    """

    kv_cache_dtype = "none"  # a model engine's pool elements (KV_CACHE_DTYPE); the fake's pool holds no K/V

    def __init__(
        self,
        capacity: int,
        max_context: int,
        stop_token_ids: Iterable[int],
        num_blocks: int = 0,
        block_size: int = 32,
        max_num_batched_tokens: int = 0,
        prefix_caching: bool = True,
        max_prefill_while_decoding: int = 0,
    ) -> None:
        self.capacity = capacity
        self.max_context = max_context
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_while_decoding = max_prefill_while_decoding
        self.stop_token_ids = frozenset(stop_token_ids)
        num_blocks = num_blocks or capacity * -(-max_context // block_size)
        # Admission leaves 1% of the pool free (vLLM's watermark) so running sequences can grow a little
        # before anyone is preempted.
        self.blocks = BlockManager(num_blocks, block_size, num_blocks // 100, enable_caching=prefix_caching)
        self.prefill_tokens_computed = 0  # tokens fed by prefill chunks (prompt, or recompute), cache hits excluded
        self._rows: list[Sequence] = []  # _rows[r] owns row r of the batch
        self._admitted: dict[int, int] = {}  # seq_id -> admission serial (the preemption order)
        self._serial = itertools.count()
        self._preempted: list[Sequence] = []
        self.num_preemptions = 0
        # Chunked prefill: admitted sequences whose tokens are not all in the cache yet (oldest first),
        # and how many of each one's tokens are.
        self._prefilling: list[Sequence] = []
        self._computed: dict[int, int] = {}
        # Forked choices waiting for their parent's prompt: parent seq_id -> children (in order), and back.
        self._forks: dict[int, list[Sequence]] = {}
        self._parent_of: dict[int, Sequence] = {}
        self.num_forks = 0  # choices that took their prompt from a parent's prefill
        self.num_block_copies = 0  # partial blocks copied for them
        self._steps = 0
        self._peak_batch = 0
        self._tokens = 0
        self.kv_window = 0  # a sliding window on every layer: blocks that left it go back to the pool

    # --- tensor work, supplied by subclasses -------------------------------------------------
    @abstractmethod
    def _forward(self, running: list[Sequence], newcomers: list[Sequence]) -> list[int | RowFailure]:
        """One forward: the next token of each of ``running`` and the first token of each newcomer.

        ``running`` is either empty or every active sequence (``running[r]`` owns row r, rows
        [0, n)); the newcomers take rows [n, n + len(newcomers)) where n is the number of active
        sequences, whether or not they decode in this call. A running sequence feeds its last token
        (position ``num_tokens - 1``); a newcomer feeds all its tokens (prompt, plus output when it
        is recomputed after a preemption). ``self.blocks.block_table(seq_id)`` already covers every
        position fed. Returns one token id per sequence of ``running + _with_forks(newcomers)`` (a newcomer's
        forked choices sample from its logits row), in that order, or a ``RowFailure`` for a row that failed
        alone. Commits nothing but cache contents at those slots: on an exception the caller commits no token.
        """

    def _forward_chunks(
        self, running: list[Sequence], chunks: list[tuple[Sequence, int, int]]
    ) -> list[int | RowFailure]:
        """One forward: the next token of each of ``running`` (as in ``_forward``) and, for each chunk
        ``(seq, start, end)``, the sequence's tokens [start, end) fed at those positions (its earlier
        ones are in its blocks). Returns tokens for ``running``, then for each chunk that ends the sequence
        (``end == seq.num_tokens``) its first token followed by those of the choices forked from it
        (``_with_forks``: from its logits row, each under its own sampling). Commits nothing but cache contents.
        Engines that cannot prefill in chunks leave this unimplemented (then set no token budget)."""
        raise NotImplementedError

    def _move_row(self, src: int, dst: int, length: int) -> None:
        """Move row src's cached positions [0, length) to row dst."""

    def _copy_block(self, src: int, dst: int) -> None:
        """KV block ``dst`` becomes a copy of block ``src`` (every layer): a forked choice's own partial block."""

    def _reset_state(self) -> None:
        """Forget all cached state."""

    # --- the seam ----------------------------------------------------------------------------
    def num_active(self) -> int:
        return len(self._rows) + len(self._prefilling) + len(self._parent_of)

    def active_sequences(self) -> list[Sequence]:
        return list(self._rows) + list(self._prefilling) + [c for cs in self._forks.values() for c in cs]

    def can_admit(self, seqs: list[Sequence]) -> bool:
        """``seqs`` fit now (``_fits``), and none that computes its prompt had better wait for a prefix being
        computed."""
        sources = self._fork_sources(seqs)
        if not self._fits(seqs, sources):
            return False
        return not any(
            src is None and self._waits_for_prefix(s, seqs[:i]) for i, (s, src) in enumerate(zip(seqs, sources))
        )

    def _fits(self, seqs: list[Sequence], sources: list[Sequence | None]) -> bool:
        """Free rows for ``seqs``, and free blocks for the tokens they do not find in the prefix cache (a forked
        choice: its partial block's copy only) plus the watermark, after the running sequences took the blocks
        their next token needs (never for one that can never fit)."""
        if self.num_active() + len(seqs) > self.capacity or any(self.check_admissible(s) for s in seqs):
            return False
        bm = self.blocks
        growth = sum(bm.blocks_to_append(s.seq_id, max(0, s.num_tokens - bm.num_tokens(s.seq_id))) for s in self._rows)
        need = sum(
            bm.fork_cost(s.num_tokens) if src else bm.admission_cost(s.num_tokens, self._lookup_hashes(s))
            for s, src in zip(seqs, sources)
        )
        return need + growth + bm.watermark_blocks <= bm.num_free_blocks

    # --- parallel sampling: forks -------------------------------------------------------------
    def _fork_sources(self, seqs: list[Sequence]) -> list[Sequence | None]:
        """For each newcomer, in admission order, the sequence it forks from (``_fork_source``), or None when it
        computes its own tokens. Pure: admission and ``can_admit`` plan alike."""
        computing = {s.seq_id for s in self._prefilling}
        sources = []
        for seq in seqs:
            source = self._fork_source(seq, computing)
            sources.append(source)
            if source is None:
                computing.add(seq.seq_id)
        return sources

    @staticmethod
    def _fork_source(seq: Sequence, computing: set[int]) -> Sequence | None:
        """A choice of ``seq``'s group that computes the same prompt (its seq_id in ``computing``: prefilling, or
        admitted before ``seq`` in this call), neither of them with output yet (a recomputed sequence never
        forks) and with the prompt logprobs ``seq`` wants; None if there is none."""
        if seq.group is None or seq.output_token_ids:
            return None
        for other in seq.group:
            if (
                other is not seq
                and other.seq_id in computing
                and not other.output_token_ids
                and seq.prompt_logprobs_k in (None, other.prompt_logprobs_k)
                and other.prompt_token_ids == seq.prompt_token_ids
            ):
                return other
        return None

    def _place(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """KV blocks for each newcomer: a choice whose prompt another computes forks it (``_fork``), any other
        allocates all its tokens, its cached prefix shared. Returns the ones that compute, with how many of
        their tokens were cached. On failure the caller ``_unplace``s every newcomer."""
        computing = []
        for seq, source in zip(seqs, self._fork_sources(seqs)):
            if source is None:
                computing.append((seq, self._allocate(seq)))
            else:
                self._fork(seq, source)
        return computing

    def _fork(self, child: Sequence, parent: Sequence) -> None:
        """The child shares the parent's blocks (its own fresh partial block) and waits for its prompt."""
        self.blocks.fork(parent.seq_id, child.seq_id)
        self._forks.setdefault(parent.seq_id, []).append(child)
        self._parent_of[child.seq_id] = parent
        if child.num_cached_tokens is None:  # the prompt's cache hit is the parent's (usage reports it once)
            child.num_cached_tokens = parent.num_cached_tokens

    def _with_forks(self, seqs: list[Sequence]) -> list[Sequence]:
        """``seqs`` (sequences whose prompt a forward completes), each followed by the choices forked from it:
        the rows the forward samples a first token for, the parent's logits row repeated for its children."""
        return [x for seq in seqs for x in (seq, *self._forks.get(seq.seq_id, ()))]

    def _complete_forks(self, parents: list[Sequence]) -> list[Sequence]:
        """After a forward computed the prompts of ``parents``: each forked child gets its copy of the parent's
        partial last block and its prompt logprobs, and stops waiting. Returns ``_with_forks(parents)``."""
        order = self._with_forks(parents)
        bs, table = self.blocks.block_size, self.blocks.block_table
        for parent in parents:
            last = parent.prompt_len // bs  # the index of its partial last block, if it has one
            for child in self._forks.pop(parent.seq_id, ()):
                del self._parent_of[child.seq_id]
                if parent.prompt_len % bs:
                    self._copy_block(table(parent.seq_id)[last], table(child.seq_id)[last])
                    self.num_block_copies += 1
                if child.prompt_logprobs_k is not None:
                    child.prompt_logprobs = list(parent.prompt_logprobs)
                child.block_hashes = list(parent.block_hashes)  # same prompt, same chain (spares the hashing)
                self.num_forks += 1
        return order

    def _hand_over(self, parent: Sequence) -> None:
        """A prefilling parent leaves (aborted, preempted, failed) while choices wait on it: the first of them
        takes its place in the prefill queue and the others wait on it instead. It goes on from where the parent
        got, since it shares the prompt's full blocks, but from no further than the start of the partial last
        block: its own copy of that one holds nothing yet. It keeps the prompt logprobs scored so far."""
        children = self._forks.pop(parent.seq_id, None)
        if not children:
            return
        heir, rest = children[0], children[1:]
        del self._parent_of[heir.seq_id]
        bs = self.blocks.block_size
        start = self._computed[heir.seq_id] = min(self._computed[parent.seq_id], parent.prompt_len // bs * bs)
        if heir.prompt_logprobs_k is not None:  # the parent scored positions [0, start) already (_scores_prompt)
            heir.prompt_logprobs = list(parent.prompt_logprobs[: start + 1]) if start else []
        self._prefilling.insert(self._prefilling.index(parent), heir)
        if rest:
            self._forks[heir.seq_id] = rest
            for child in rest:
                self._parent_of[child.seq_id] = heir

    def _drop_fork(self, child: Sequence) -> None:
        """A forked choice leaves before its parent's prompt is complete: its blocks go back (the shared ones
        stay with the parent)."""
        parent = self._parent_of.pop(child.seq_id)
        siblings = self._forks[parent.seq_id]
        siblings.remove(child)
        if not siblings:
            del self._forks[parent.seq_id]
        self._admitted.pop(child.seq_id, None)
        self.blocks.free(child.seq_id)

    def _unplace(self, seq: Sequence) -> None:
        """Undo a newcomer's ``_place`` (a failed admission; forked children before their parents)."""
        if seq.seq_id in self._parent_of:
            self._drop_fork(seq)
        elif seq in self._prefilling:
            self._drop_prefilling(seq)
        elif seq.seq_id in self.blocks:
            self.blocks.free(seq.seq_id)

    # --- prefix cache ------------------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Chain hashes of the full blocks among the sequence's first ``num_tokens`` tokens (kept on the
        sequence and extended as its blocks fill)."""
        n, bs = num_tokens // self.blocks.block_size, self.blocks.block_size
        if len(seq.block_hashes) < n:
            tokens = (seq.prompt_token_ids + seq.output_token_ids)[: n * bs]
            extend_block_hashes(seq.block_hashes, tokens, bs)
        return seq.block_hashes[:n]

    def _lookup_hashes(self, seq: Sequence) -> list[bytes]:
        """What a newcomer may find in the cache: its full blocks before the one holding its last token (that
        one is computed, for its logits); nothing when caching is off or it still needs prompt logprobs."""
        if not self.blocks.enable_caching or _needs_prompt_logprobs(seq):
            return []
        return self._block_hashes(seq, seq.num_tokens - 1)

    def _waits_for_prefix(self, seq: Sequence, ahead: list[Sequence]) -> bool:
        """Whether the first block ``seq`` would have to compute is being computed by an admitted sequence still
        prefilling, or will be by one of ``ahead`` (admitted before it in the same call): then it waits one
        or a few steps and shares the block instead of computing it twice."""
        hashes = self._lookup_hashes(seq)
        hit = len(self.blocks.match(hashes))
        if hit == len(hashes):
            return False
        wanted = hashes[hit]
        for other in [*self._prefilling, *ahead]:
            if _needs_prompt_logprobs(other) or not self.blocks.enable_caching:
                continue
            done = self._computed.get(other.seq_id, 0) // self.blocks.block_size
            if wanted in self._block_hashes(other, other.num_tokens)[done:]:
                return True
        return False

    def _allocate(self, seq: Sequence) -> int:
        """Blocks for all of a newcomer's tokens, its cached prefix shared; returns how many tokens are cached."""
        self.blocks.allocate(seq.seq_id, seq.num_tokens, self._lookup_hashes(seq))
        cached = self.blocks.cached_tokens(seq.seq_id)
        if seq.num_cached_tokens is None:  # the first admission: what the prompt found in the cache
            seq.num_cached_tokens = min(cached, seq.prompt_len)
        return cached

    def _cache_computed(self, seq: Sequence, computed: int) -> None:
        """The sequence's first ``computed`` tokens are in its blocks: its full blocks among them enter the cache;
        under a sliding window on every layer (``kv_window``), the blocks that left it go back to the pool (its
        next query, at position ``computed``, reads keys from ``computed - kv_window + 1`` on)."""
        bm = self.blocks
        if bm.enable_caching and computed // bm.block_size > bm.num_hashed_blocks(seq.seq_id):
            bm.cache_blocks(seq.seq_id, self._block_hashes(seq, computed))
        if self.kv_window and seq.seq_id in bm:
            bm.release_before(seq.seq_id, computed - self.kv_window + 1)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no sequence holds (``POST /admin/reset_prefix_cache``); returns how many."""
        return self.blocks.reset_cache()

    def take_preempted(self) -> list[Sequence]:
        preempted, self._preempted = self._preempted, []
        return preempted

    def admit(self, seqs: list[Sequence]) -> list[int]:
        if not seqs:
            return []
        self._check_newcomers(seqs)
        if self.max_num_batched_tokens:
            self._chunked_call(seqs, decode=False)
            return [s.seq_id for s in seqs]
        start = time.perf_counter()
        order, first_tokens = self._forward_newcomers([], seqs)  # may raise: nothing is committed yet
        self._commit_newcomers(order, first_tokens, start, time.perf_counter())
        self._evict([s for s in seqs if s.is_finished])
        return [s.seq_id for s in seqs]

    def step(self) -> list[Sequence]:
        self._reserve_running()
        if self._prefilling:
            return self._chunked_call([], decode=True)
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
        self._reserve_running()
        if self.max_num_batched_tokens:
            self._check_newcomers(seqs)
            return self._chunked_call(seqs, decode=True)
        if not self._rows:
            self.admit(seqs)
            return [s for s in seqs if s.is_finished]
        self._check_newcomers(seqs)
        start = time.perf_counter()
        n = len(self._rows)
        order, tokens = self._forward_newcomers(self._rows, seqs)  # may raise: nothing committed
        now = time.perf_counter()
        self._commit_step(tokens[:n], now)
        self._commit_newcomers(order, tokens[n:], start, now)
        finished = [s for s in self._rows if s.is_finished]
        self._evict(finished)
        return finished

    def _chunked_call(self, newcomers: list[Sequence], decode: bool) -> list[Sequence]:
        """Newcomers join the prefilling queue (blocks for all their tokens); one forward runs the decode
        rows (when ``decode``) and the next prompt chunks within the token budget. Returns what finished.
        Atomic like ``admit_and_step``: on failure the newcomers hold nothing and no progress is kept.
        A forked newcomer joins its parent's children instead of the queue (``_place``)."""
        start = time.perf_counter()
        running = list(self._rows) if decode else []
        try:
            for seq, cached in self._place(newcomers):
                self._computed[seq.seq_id] = cached
                self._prefilling.append(seq)
            for seq in newcomers:
                self._admitted[seq.seq_id] = next(self._serial)
            chunks = self._plan_chunks(len(running))
            tokens = self._forward_chunks(running, chunks)
        except BaseException:
            for seq in reversed(newcomers):  # children before the parents they forked
                self._unplace(seq)
            raise
        now = time.perf_counter()
        for seq in newcomers:
            seq.status = SequenceStatus.RUNNING
            if seq.admit_time is None:
                seq.admit_time = start
        if running:
            self._commit_step(tokens[: len(running)], now)
        done = []
        for seq, begin, end in chunks:
            self._computed[seq.seq_id] = end
            self.prefill_tokens_computed += end - begin
            if end == seq.num_tokens:
                done.append(seq)
            else:
                self._cache_computed(seq, end)
        for seq in done:
            self._prefilling.remove(seq)
            del self._computed[seq.seq_id]
        self._commit_newcomers(self._complete_forks(done), tokens[len(running) :], start, now)
        finished = [s for s in self._rows if s.is_finished]
        self._evict(finished)
        return finished

    def _plan_chunks(self, n_decode: int) -> list[tuple[Sequence, int, int]]:
        """(seq, start, end) per prefilling sequence, oldest first, within the budget left after the decode rows
        (and, when rows decode, within ``max_prefill_while_decoding``)."""
        budget = max(self.max_num_batched_tokens - n_decode, 1)
        if n_decode and self.max_prefill_while_decoding:
            budget = min(budget, self.max_prefill_while_decoding)
        chunks = []
        for seq in self._prefilling:
            if budget <= 0:
                break
            start = self._computed[seq.seq_id]
            end = min(seq.num_tokens, start + budget)
            chunks.append((seq, start, end))
            budget -= end - start
        return chunks

    def _drop_prefilling(self, seq: Sequence) -> None:
        self._hand_over(seq)
        self._prefilling.remove(seq)
        self._computed.pop(seq.seq_id, None)
        self._admitted.pop(seq.seq_id, None)
        if seq.seq_id in self.blocks:
            self.blocks.free(seq.seq_id)

    def _forward_newcomers(
        self, running: list[Sequence], seqs: list[Sequence]
    ) -> tuple[list[Sequence], list[int | RowFailure]]:
        """Give the newcomers their blocks (``_place``: forked choices share their parent's), then one forward
        over the tokens not cached (the whole prompts, ``_forward``, when nothing is); on failure they hold
        none. Returns the newcomers in the order their first tokens follow the running ones'
        (``_with_forks``), and the tokens."""
        try:
            computing = self._place(seqs)
            if any(cached for _, cached in computing):
                tokens = self._forward_chunks(running, [(s, c, s.num_tokens) for s, c in computing])
            else:
                tokens = self._forward(running, [s for s, _ in computing])
        except BaseException:
            for seq in reversed(seqs):  # children before the parents they forked
                self._unplace(seq)
            raise
        self.prefill_tokens_computed += sum(s.num_tokens - c for s, c in computing)
        return self._complete_forks([s for s, _ in computing]), tokens

    def _reserve_running(self) -> None:
        """A slot for every running sequence's next token, oldest admission first; while a block is
        missing, preempt the most recently admitted (possibly the one that needs it)."""
        for seq in sorted(self._rows, key=lambda s: self._admitted[s.seq_id]):
            if seq.seq_id not in self._admitted:  # preempted meanwhile
                continue
            need = seq.num_tokens - self.blocks.num_tokens(seq.seq_id)
            if need <= 0:
                continue
            while not self.blocks.can_append(seq.seq_id, need):
                victim = max(self.active_sequences(), key=lambda s: self._admitted[s.seq_id])
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.append_slots(seq.seq_id, need)

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and row; it waits again with its tokens (recomputed on readmission)."""
        if seq.seq_id in self._parent_of:
            self._drop_fork(seq)
        elif seq in self._prefilling:
            self._drop_prefilling(seq)
        else:
            self._evict([seq])
        seq.status = SequenceStatus.WAITING
        self._preempted.append(seq)
        self.num_preemptions += 1
        log.info("preempted sequence %d (%d tokens): KV cache full", seq.seq_id, seq.num_tokens)

    def _check_newcomers(self, seqs: list[Sequence]) -> None:
        if self.num_active() + len(seqs) > self.capacity:
            raise AdmissionError(f"{len(seqs)} newcomers exceed free capacity {self.capacity - self.num_active()}")
        for seq in seqs:
            reason = self.check_admissible(seq)
            if reason:
                raise AdmissionError(f"sequence {seq.seq_id}: {reason}")
        if not self._fits(seqs, self._fork_sources(seqs)):
            raise AdmissionError(
                f"{len(seqs)} newcomers need {sum(self.blocks.blocks_for(s.num_tokens) for s in seqs)} KV blocks; "
                f"{self.blocks.num_free_blocks} of {self.blocks.num_blocks} are free"
            )

    def check_admissible(self, seq: Sequence) -> str | None:
        reason = super().check_admissible(seq)
        if reason:
            return reason
        total, bm = seq.prompt_len + seq.max_new_tokens, self.blocks
        if bm.blocks_for(total) > bm.num_blocks or not bm.can_ever_allocate(seq.prompt_len):
            return (
                f"prompt ({seq.prompt_len} tokens) + max_new_tokens ({seq.max_new_tokens}) needs "
                f"{bm.blocks_for(total)} KV blocks of {bm.block_size} tokens; the whole KV cache holds "
                f"{bm.num_blocks} blocks ({bm.num_blocks * bm.block_size} tokens, KV_CACHE_MB), "
                f"{bm.watermark_blocks} of them kept free at admission"
            )
        return None

    def _commit_newcomers(self, seqs: list[Sequence], first_tokens: list[int], start: float, now: float) -> None:
        """The newcomers take rows [n, n + len(seqs)) with their first tokens."""
        self._rows.extend(seqs)
        for seq, token in zip(seqs, first_tokens):
            self._admitted.setdefault(seq.seq_id, next(self._serial))
            seq.status = SequenceStatus.RUNNING
            if seq.admit_time is None:  # a recomputed sequence keeps its first admission time
                seq.admit_time = start
            if not seq.ignore_eos:
                seq.stop_token_ids = seq.stop_token_ids | self.stop_token_ids
            self._take(seq, token, now)
            self._cache_fed(seq)
        self._tokens += len(seqs)
        self._peak_batch = max(self._peak_batch, len(self._rows))

    def _commit_step(self, tokens: list[int], now: float) -> None:
        """Each active sequence (rows [0, n), in order) takes its next token."""
        for seq, token in zip(self._rows, tokens):
            self._take(seq, token, now)
            self._cache_fed(seq)
        self._steps += 1
        self._tokens += len(self._rows)
        self._peak_batch = max(self._peak_batch, len(self._rows))

    def _cache_fed(self, seq: Sequence) -> None:
        """After a forward fed every token of ``seq`` but its newest: cache its full blocks, unless it failed
        (its K/V may be garbage: never shared)."""
        if seq.status is not SequenceStatus.FINISHED_ERROR:
            self._cache_computed(seq, seq.num_tokens - 1)

    @staticmethod
    def _take(seq: Sequence, token: int | RowFailure, now: float) -> None:
        """A row's result: its next token, or its failure (it finishes with the error; the caller evicts it)."""
        if isinstance(token, RowFailure):
            seq.finish(SequenceStatus.FINISHED_ERROR, now, error=token.reason)
        else:
            seq.append_token(token, now)

    def abort(self, seq_id: int) -> bool:
        for seq in self._rows:
            if seq.seq_id == seq_id:
                seq.finish(SequenceStatus.FINISHED_ABORTED)
                self._evict([seq])
                return True
        for seq in self._prefilling:
            if seq.seq_id == seq_id:
                seq.finish(SequenceStatus.FINISHED_ABORTED)
                self._drop_prefilling(seq)
                return True
        parent = self._parent_of.get(seq_id)
        if parent is not None:
            child = next(c for c in self._forks[parent.seq_id] if c.seq_id == seq_id)
            child.finish(SequenceStatus.FINISHED_ABORTED)
            self._drop_fork(child)
            return True
        return False

    def reset(self) -> None:
        self._rows.clear()
        self._prefilling.clear()
        self._computed.clear()
        self._forks.clear()
        self._parent_of.clear()
        self._admitted.clear()
        bm = self.blocks  # the cache goes too: a failed call may have left blocks half written
        self.blocks = BlockManager(bm.num_blocks, bm.block_size, bm.watermark_blocks, bm.enable_caching)
        self.blocks.queried_tokens, self.blocks.hit_tokens = bm.queried_tokens, bm.hit_tokens
        self._reset_state()

    def stats(self) -> dict[str, int]:
        return {
            "steps": self._steps,
            "peak_batch": self._peak_batch,
            "generated_tokens": self._tokens,
            "kv_blocks": self.blocks.num_blocks,
            "kv_free_blocks": self.blocks.num_free_blocks,
            "kv_block_size": self.blocks.block_size,
            "num_preemptions": self.num_preemptions,
            "num_prefilling": len(self._prefilling) + len(self._parent_of),  # forked choices wait for a prefill
            "kv_cached_blocks": self.blocks.num_cached_blocks,
            "prefix_cache_queries": self.blocks.queried_tokens,
            "prefix_cache_hits": self.blocks.hit_tokens,
            "prefill_tokens_computed": self.prefill_tokens_computed,
        }

    def _evict(self, leaving: list[Sequence]) -> None:
        """Free the rows of ``leaving`` and keep the survivors in rows [0, n) by moving tail rows into holes."""
        if not leaving:
            return
        for seq in leaving:
            self._admitted.pop(seq.seq_id, None)
            if seq.seq_id in self.blocks:
                self.blocks.free(seq.seq_id)
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
    ) -> None:
        super().__init__(
            capacity,
            max_context,
            stop_token_ids,
            num_blocks,
            block_size,
            max_num_batched_tokens,
            prefix_caching,
            max_prefill_while_decoding,
        )
        self.kv_slots: dict[int, list[int | None]] | None = {} if check_kv else None  # block -> token per slot
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

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t - 1 for t in token_ids if 1 <= t <= 256).decode("utf-8", errors="replace")

    def _forward(self, running: list[Sequence], newcomers: list[Sequence]) -> list[int | RowFailure]:
        return self._forward_chunks(running, [(s, 0, s.num_tokens) for s in newcomers])

    def _forward_chunks(
        self, running: list[Sequence], chunks: list[tuple[Sequence, int, int]]
    ) -> list[int | RowFailure]:
        """Decode the running rows; a chunk that ends its sequence gets its first token, and its forked choices
        theirs (``_prefill``)."""
        if self.kv_slots is not None:
            for seq in running:
                self._feed(seq, seq.num_tokens - 1, seq.num_tokens)
            for seq, start, end in chunks:
                self._feed(seq, start, end)
        step = self._decode(running) if running else []
        done = self._with_forks([seq for seq, _, end in chunks if end == seq.num_tokens])
        return step + (self._prefill(done, len(self._rows)) if chunks else [])

    def _feed(self, seq: Sequence, start: int, end: int) -> None:
        """``check_kv``: the sequence's slots [0, start) must hold its tokens; it writes tokens [start, end)."""
        tokens, bm = seq.prompt_token_ids + seq.output_token_ids, self.blocks
        waiting = {c.seq_id for c in self._forks.get(seq.seq_id, ())}
        for pos in range(end):
            block, offset = bm.slot(seq.seq_id, pos)
            slots = self.kv_slots.setdefault(block, [None] * bm.block_size)
            if pos < start:
                assert slots[offset] == tokens[pos], f"seq {seq.seq_id} position {pos}: block {block} holds {slots}"
                continue
            others = set(bm.holders(block)) - {seq.seq_id}
            assert others <= waiting, f"seq {seq.seq_id} writes block {block}, which {others} hold too"
            slots[offset] = tokens[pos]

    def _copy_block(self, src: int, dst: int) -> None:
        if self.kv_slots is not None:
            self.kv_slots[dst] = list(self.kv_slots[src])

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

    def _next_tokens(self, seqs: list[Sequence]) -> list[int | RowFailure]:
        """token_fn per sequence (a RowFailure fails that row alone); a requested logprob is 0.0 (the fake
        is certain of its choice)."""
        tokens = [self.token_fn(s) for s in seqs]
        for seq, token in zip(seqs, tokens):
            if seq.logprobs is not None and not isinstance(token, RowFailure):
                seq.output_logprobs.append(TokenLogprobs(token, 0.0, [(token, 0.0)][: seq.logprobs]))
        return tokens

    def _reset_state(self) -> None:
        self.resets += 1
        if self.kv_slots is not None:
            self.kv_slots.clear()


class ModelEngine(BatchEngine):
    """A real model behind the bookkeeping: what every model runtime shares once its model and tokenizer exist.

    Subclasses build ``self.model`` (the forward contract of ``models.layers.MixedForward.forward``: decode rows and
    prompt chunks in, logits rows out) and ``self.tokenizer`` (encode / decode / apply_chat_template), then call
    ``_init_batching``. Here: tokenizing, chat templates, one forward over decode rows and prompt chunks, and
    sampling its logits (``sampling``, on numpy: the same code whichever runtime made them).
    """

    tokenizer: object
    model: ModelRunner
    chat_template: str | None

    def _init_batching(
        self, config: Config, window: int, stops: set[int], kv_bytes_per_token: int, kv_window: int = 0
    ) -> int:
        """Context, KV pool and batching from ``config`` for a model of ``window`` positions (and a sliding window
        of ``kv_window`` keys on every layer, 0: none); -> KV pool blocks."""
        max_context = min(window, config.max_model_len) if config.max_model_len else window
        block_size = config.kv_block_size
        num_blocks = kv_pool_blocks(config, max_context, kv_bytes_per_token * block_size)
        super().__init__(
            config.max_batch_size,
            max_context,
            stops | set(config.stop_token_ids),
            num_blocks,
            block_size,
            config.max_num_batched_tokens,
            config.prefix_caching,
            config.max_prefill_tokens_while_decoding,
        )
        self.model_name = config.model_id
        self.kv_cache_dtype = kv_cache_dtype(config)
        self.kv_window = kv_window
        self._heap = HeapTrimmer()
        return num_blocks

    def _logits(self, *forward_args):
        """``self.model.forward(*forward_args)`` as a float32 numpy array [rows, V] (sampling runs on numpy)."""
        return self.model.forward(*forward_args)

    @property
    def kv_pool_bytes(self) -> int:
        """Bytes of the KV block pool."""
        return self.model.kv_nbytes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def grammar_vocabulary(self) -> tuple:
        return self.tokenizer, self.vocab_size, self.stop_token_ids

    def supports_tools(self) -> bool:
        from text.chat_template import template_supports_tools

        return bool(self.chat_template) and template_supports_tools(self.chat_template)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ChatTemplateError(
                f"model {self.model_name!r} has no chat template; set CHAT_TEMPLATE to a Jinja template "
                "(text or a file path) to use /v1/chat/completions"
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self.chat_template, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # a template that raises on these messages (e.g. role order)
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from None

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _forward(self, running: list[Sequence], newcomers: list[Sequence]) -> list[int | RowFailure]:
        """One forward for both (either may be empty): the weights stream once (a decode step alone is
        bound by that)."""
        return self._forward_chunks(running, [(s, 0, s.num_tokens) for s in newcomers])

    def _forward_chunks(
        self, running: list[Sequence], chunks: list[tuple[Sequence, int, int]]
    ) -> list[int | RowFailure]:
        """Decode rows and prompt chunks in one forward; tokens only where a chunk ends its sequence.

        A chunk whose sequence asked for prompt logprobs gets logits at every position (scored into
        ``seq.prompt_logprobs``); every other chunk only at its last, and only when it ends the sequence.
        """
        table = self.blocks.block_table
        every = [_scores_prompt(seq, start) for seq, start, _ in chunks]
        logits = self._logits(
            [s.last_token_id for s in running],
            [s.num_tokens - 1 for s in running],
            [table(s.seq_id) for s in running],
            [(s.prompt_token_ids + s.output_token_ids)[start:end] for s, start, end in chunks],
            [table(s.seq_id) for s, _, _ in chunks],
            [start for _, start, _ in chunks],
            every if any(every) else (),
        )  # [len(running) + one row per chunk (every position of a scoring chunk), V]
        if chunks:  # prompt chunks bring new shapes, whose scratch the heap would otherwise keep
            self._heap.maybe_trim()
        keep, row, ending = list(range(len(running))), len(running), []
        for (seq, start, end), full in zip(chunks, every):
            n = end - start if full else 1
            if full:
                _score_prompt(seq, logits[row : row + n], start, end)
            if end == seq.num_tokens:
                sampled = self._with_forks([seq])  # its forked choices sample from its last row too
                keep += [row + n - 1] * len(sampled)
                ending += sampled
            row += n
        if keep != list(range(logits.shape[0])):
            logits = logits[keep]
        return self._next_tokens(logits, running + ending)

    def _copy_block(self, src: int, dst: int) -> None:
        self.model.copy_block(src, dst)

    def _next_tokens(self, logits, seqs: list[Sequence]) -> list[int | RowFailure]:
        """logits: [N, V] for seqs -> one token id each, under each sequence's SamplingParams.

        A row whose logits are not finite, or whose sampling fails, gets a ``RowFailure``; the others
        are sampled as if it were not there. Logprobs, where asked for, come from the raw logits
        (before penalties and temperature).
        """
        results: list[int | RowFailure] = [RowFailure(SAMPLING_FAILED)] * len(seqs)
        rows = list(range(len(seqs)))
        raw, logits = logits, self._constrain(logits, seqs)
        try:
            tokens = self._sample(logits, seqs)
        except NonFiniteLogits as exc:
            log.error("non-finite logits for sequences %s", [seqs[i].seq_id for i in exc.rows])
            for i in exc.rows:
                results[i] = RowFailure(NON_FINITE_LOGITS)
            rows = [i for i in rows if i not in set(exc.rows)]
            tokens = self._sample_rows(logits, seqs, rows)
        except Exception:  # a bug or an edge no range check foresaw: find the rows it belongs to
            log.exception("sampling a batch of %d failed; sampling its rows one at a time", len(seqs))
            tokens = self._sample_rows(logits, seqs, rows)
        vocab = logits.shape[-1]
        for i, token in zip(rows, tokens):
            if isinstance(token, int) and not 0 <= token < vocab:
                log.error("sampling gave token %d outside [0, %d) for sequence %d", token, vocab, seqs[i].seq_id)
                token = RowFailure(SAMPLING_FAILED)
            results[i] = token
        self._add_logprobs(raw, seqs, results)
        return results

    @staticmethod
    def _constrain(logits, seqs: list[Sequence]):
        """Structured output: the logits with each grammar row's disallowed tokens at -inf (a copy), or
        ``logits`` itself when no row has a grammar (an unconstrained batch pays nothing). The masks are
        computed here, in the engine thread, one row at a time."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return logits
        mask = grammar_bitmask([seqs[i].grammar for i in rows], logits.shape[-1])
        return apply_token_bitmask(logits, rows, mask)

    @staticmethod
    def _sample(logits, seqs: list[Sequence]) -> list[int]:
        """logits: [n, V] -> one token per sequence (``sampling.sample``)."""
        return sample(
            logits, [s.sampling for s in seqs], [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs]
        )

    def _sample_rows(self, logits, seqs: list[Sequence], rows: list[int]) -> list[int | RowFailure]:
        """Each of ``rows`` alone: a row that still fails gets a RowFailure, the others their token."""
        out: list[int | RowFailure] = []
        for i in rows:
            try:
                out.append(self._sample(logits[i : i + 1], [seqs[i]])[0])
            except NonFiniteLogits:
                out.append(RowFailure(NON_FINITE_LOGITS))
            except Exception:
                log.exception("sampling sequence %d failed", seqs[i].seq_id)
                out.append(RowFailure(SAMPLING_FAILED))
        return out

    @staticmethod
    def _add_logprobs(logits, seqs: list[Sequence], tokens: list[int | RowFailure]) -> None:
        """Append each requesting row's logprobs of its chosen token (rows that failed get none)."""
        wanted = [i for i, s in enumerate(seqs) if s.logprobs is not None and not isinstance(tokens[i], RowFailure)]
        if not wanted:
            return
        k = max(seqs[i].logprobs for i in wanted)
        rows = logits if len(wanted) == len(seqs) else logits[wanted]
        for i, lp in zip(wanted, logprobs(rows, [tokens[i] for i in wanted], k)):
            seqs[i].output_logprobs.append(lp._replace(top=lp.top[: seqs[i].logprobs]))


class HFEngine(ModelEngine):
    """A Hugging Face checkpoint on our hand-written torch forward over a preallocated KV cache.

    ``checkpoints.load_checkpoint`` loads tokenizer and model (hub id, local directory or
    ``.gguf``); the weights are copied into the family's forward (``models.families()``, keyed by
    ``config.model_type``) and the HF module is dropped.
    """

    def __init__(self, config: Config) -> None:
        from models.native_memory import bound_native_caches, memory_mib

        bound_native_caches()  # before torch runs its first oneDNN op
        thread_environment()  # before torch loads libgomp, which reads its wait policy once, at load
        import torch  # deferred: the server stack must stay importable without torch

        from models import families
        from models.loading import eos_ids, load_checkpoint  # deferred: they import transformers when called

        torch.set_num_threads(engine_threads(config))
        set_kernel_isa(config.kernel_isa)
        int_dot.set_activations(config.activations)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            _check_kv_dtype(config)
        self.tokenizer, hf_model = load_checkpoint(config.model_id, config.weights)
        hf_config = hf_model.config
        supported = families()
        if hf_config.model_type not in supported:
            raise ModelLoadError(
                f"model architecture {hf_config.model_type!r} of {config.model_id!r} is not supported; "
                f"supported: {', '.join(sorted(supported))}"
            )
        family = supported[hf_config.model_type]
        stops = eos_ids(hf_model, self.tokenizer)
        try:
            kv_window = family.kv_window(hf_config)
        except ValueError as exc:  # a config option our forward does not implement
            raise ModelLoadError(f"MODEL_ID {config.model_id}: {exc}") from exc
        bytes_per_token = family.kv_bytes_per_token(hf_config, kv_cache_dtype(config))
        num_blocks = self._init_batching(config, family.context_window(hf_config), stops, bytes_per_token, kv_window)
        max_context, block_size = self.max_context, self.blocks.block_size
        self.vocab_size = hf_config.vocab_size
        self.chat_template = config.chat_template_text() or getattr(self.tokenizer, "chat_template", None)
        weights = "fp32" if config.weights == "auto" else config.weights  # a GGUF's "auto" is in hf_model already
        try:
            self.model = family(
                hf_model.eval(),
                config.max_batch_size,
                max_context,
                self.device,
                use_small_gemm=config.small_gemm,
                num_blocks=num_blocks,
                block_size=block_size,
                weights=weights,
                kv_cache_dtype=self.kv_cache_dtype,
            )
        except ValueError as exc:  # a config option our forward does not implement (RoPE type, activation...)
            raise ModelLoadError(f"MODEL_ID {config.model_id}: {exc}") from exc
        if hasattr(hf_model, "describe"):  # a GGUF read at its own precision: say what each tensor became
            log.info("GGUF %s (WEIGHTS=%s): %s", config.model_id, config.weights, hf_model.describe())
        del hf_model
        self._heap.trim()  # the load's transient copies (state dict, unfused parts) back to the OS
        resident = self.model.resident_weights()
        memory = memory_mib()
        log.info(
            "loaded %s on %s: up to %d sequences of up to %d tokens; KV cache %s, %d blocks x %d tokens = %d tokens, "
            "%.1f MiB; weights resident, one copy each: %s (%.1f MiB); fp32 linears on %s, quantized kernels %s, "
            "%d threads; RSS %.0f MiB (peak %.0f MiB)",
            config.model_id,
            self.device,
            self.capacity,
            max_context,
            self.kv_cache_dtype,
            num_blocks,
            block_size,
            num_blocks * block_size,
            self.model.kv.nbytes / 2**20,
            ", ".join(f"{fmt} {n / 2**20:.1f} MiB" for fmt, n in sorted(resident.items())),
            sum(resident.values()) / 2**20,
            "small_gemm panels" if self.model.small_gemm else "oneDNN" if self.model.onednn else "torch",
            kernel_isa(),
            torch.get_num_threads(),
            memory.get("VmRSS", 0),
            memory.get("VmHWM", 0),
        )

    def _logits(self, *forward_args):
        return self.model.forward(*forward_args).float().cpu().numpy()  # [rows, V]: sampling runs on numpy

    def _copy_block(self, src: int, dst: int) -> None:
        self.model.kv.copy_block(src, dst)

    @property
    def kv_pool_bytes(self) -> int:
        return self.model.kv.nbytes


class NativeEngine(ModelEngine):
    """A model image (``models.image``) on the compiled whole-step kernel: the serving process never imports torch.

    The checkpoint is compiled once, in a child process that has torch, into an image: every weight in the
    kernel's packed format in one file, the tokenizer, and what the kernel needs to know of the model
    (``models.image.ensure_image``, cached). Here the file is memory-mapped (the mapping is the resident weights,
    nothing is copied), the KV pool is numpy, each step is one or more calls of ``decode_step.c``
    (``models.native.NativeModel``), the tokenizer is ``text.tokenizer`` and sampling is numpy. A server holds
    the weights, its KV pool and Python, not torch's ~185 MB of libraries (docs/performance.md "Memory").
    """

    def __init__(self, config: Config, image_dir: str | None = None) -> None:
        from models.native_memory import memory_mib

        environment = thread_environment()  # before libgomp loads with the kernel
        set_kernel_isa(config.kernel_isa)
        int_dot.set_activations(config.activations)
        from models.image import TOKENIZER_DIR, ImageError, check_image, ensure_image
        from models.native import NativeModel
        from text.tokenizer import TextTokenizer

        _check_kv_dtype(config)
        image_dir = image_dir or ensure_image(config.model_id, config.weights)
        try:
            meta = check_image(image_dir)
            self.tokenizer = TextTokenizer.from_dir(os.path.join(image_dir, TOKENIZER_DIR))
            kv = meta["kv"]
            bytes_per_token = bytes_per_kv_token(kv_cache_dtype(config), kv["n_layer"], kv["n_kv_head"], kv["head_dim"])
            num_blocks = self._init_batching(
                config, meta["context_window"], set(meta["eos_ids"]), bytes_per_token, meta["kv_window"]
            )
            self.model = NativeModel(
                image_dir, num_blocks, self.blocks.block_size, engine_threads(config), self.kv_cache_dtype
            )
        except (ImageError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"MODEL_ID {config.model_id}: its model image cannot be served: {exc}") from exc
        self.vocab_size = meta["vocab_size"]
        self.chat_template = config.chat_template_text() or self.tokenizer.chat_template
        resident = self.model.resident_weights()
        memory = memory_mib()
        log.info(
            "loaded %s without torch (image %s): up to %d sequences of up to %d tokens; KV cache %s, %d blocks x %d "
            "tokens, %.1f MiB; weights resident (mapped), one copy each: %s (%.1f MiB); quantized kernels %s; "
            "%d threads (%s); RSS %.0f MiB (peak %.0f MiB)",
            config.model_id,
            image_dir,
            self.capacity,
            self.max_context,
            self.kv_cache_dtype,
            num_blocks,
            self.blocks.block_size,
            self.model.kv_nbytes / 2**20,
            ", ".join(f"{fmt} {n / 2**20:.1f} MiB" for fmt, n in sorted(resident.items())),
            sum(resident.values()) / 2**20,
            kernel_isa(),
            self.model.threads,
            ", ".join(f"{k}={v}" for k, v in environment.items()),
            memory.get("VmRSS", 0),
            memory.get("VmHWM", 0),
        )
        log.info("quantized linears: %s", int_dot.describe(config.activations))


def _needs_prompt_logprobs(seq: Sequence) -> bool:
    """The sequence asked for prompt logprobs and does not have them all yet (a recomputed one may)."""
    return seq.prompt_logprobs_k is not None and len(seq.prompt_logprobs) < seq.prompt_len


def _scores_prompt(seq: Sequence, start: int) -> bool:
    """Whether a chunk of ``seq`` from ``start`` computes prompt logprobs: the sequence asked for them, the
    chunk has a position that predicts a prompt token, and they are not complete already (a sequence
    recomputed after a preemption keeps the ones it has)."""
    if seq.prompt_logprobs_k is None or start >= seq.prompt_len - 1:
        return False
    if start == 0:
        return len(seq.prompt_logprobs) < seq.prompt_len
    return len(seq.prompt_logprobs) == start + 1  # the earlier chunks scored positions [0, start)


def _score_prompt(seq: Sequence, logits, start: int, end: int) -> None:
    """logits: [end - start, V], position p's row predicting token p + 1 (raw logits). Appends the
    logprobs of the prompt tokens those positions predict; position 0 has nothing before it (None)."""
    if start == 0:
        seq.prompt_logprobs = [None]
    stop = min(end, seq.prompt_len - 1)  # the last prompt position predicts the first output token
    predicted = seq.prompt_token_ids[start + 1 : stop + 1]
    seq.prompt_logprobs += logprobs(logits[: stop - start], predicted, seq.prompt_logprobs_k)


def _check_kv_dtype(config: Config) -> None:
    """KV_CACHE_DTYPE must be one this CPU runs (fp16 needs F16C): a one-line startup error otherwise."""
    reason = kv_dtype_unavailable(kv_cache_dtype(config))
    if reason:
        raise ModelLoadError(reason)


def kv_pool_blocks(config: Config, max_context: int, block_bytes: int) -> int:
    """Blocks in the KV pool: ``KV_CACHE_MB`` of them, or by default enough for ``MAX_BATCH_SIZE`` sequences
    at the full context, capped at ``KV_CACHE_RAM_FRACTION`` of the machine's memory."""
    if config.kv_cache_mb:
        blocks = int(config.kv_cache_mb * 2**20) // block_bytes
        if blocks < 1:
            raise ValueError(f"KV_CACHE_MB={config.kv_cache_mb} holds no KV block ({block_bytes} bytes each)")
        return blocks
    blocks = config.max_batch_size * -(-max_context // config.kv_block_size)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return blocks
    return max(1, min(blocks, int(ram * KV_CACHE_RAM_FRACTION) // block_bytes))


KV_CACHE_RAM_FRACTION = 0.25  # the default pool never takes more of the machine's RAM than this


def resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# What OpenMP and the tokenizer get unless the environment says otherwise (measured: docs/performance.md "Threads").
# A decode step runs ~120 OpenMP regions back to back, microseconds apart. A worker that sleeps at once
# (OMP_WAIT_POLICY=PASSIVE) costs a futex wake-up per region: SmolLM2's batch-1 step took 18 ms instead of
# 9.5. libgomp's default spin (300k iterations, ~3 ms) keeps the worker on a core long after a step, while
# the event loop needs it. GOMP_SPINCOUNT=100000 (~1 ms) spans the gaps inside a step and the short hop
# between two steps, then sleeps: served batch-1 steps within 1.05x of the bare step. (It spins only while
# libgomp's pooled threads fit the cores: ``scheduler.engine_thread`` keeps every torch call on one thread.)
# The Rust tokenizer starts its own pool of one thread per core for batch encodes: never beside torch's.
THREAD_ENV = {"GOMP_SPINCOUNT": "100000", "TOKENIZERS_PARALLELISM": "false"}


def thread_environment() -> dict[str, str]:
    """Set ``THREAD_ENV`` where the environment does not (an explicit setting wins, and an explicit
    OMP_WAIT_POLICY keeps its own spin); returns what is in effect. Must run before torch is imported:
    libgomp reads its settings once, when it is loaded."""
    import sys

    wanted = dict(THREAD_ENV)
    if "OMP_WAIT_POLICY" in os.environ:
        wanted.pop("GOMP_SPINCOUNT")  # GOMP_SPINCOUNT would override the policy the user chose
    if "torch" in sys.modules and any(k not in os.environ for k in wanted):
        log.warning("torch was imported before the thread settings: OpenMP keeps its own wait policy")
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in [*wanted, "OMP_WAIT_POLICY"] if key in os.environ}


def engine_threads(config: Config) -> int:
    """Torch intra-op threads: NUM_THREADS, or 0 = every physical core (measured fastest: docs/performance.md,
    "Threads")."""
    return config.num_threads or physical_cores()


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
    """The engine MODEL_ID and RUNTIME ask for: ``fake`` -> FakeEngine, else NativeEngine or HFEngine
    (``uses_native_runtime``).

    Raises ``ModelLoadError`` (a one-line message saying why and what to do) when MODEL_ID cannot be served.
    """
    if config.is_fake:
        return FakeEngine(
            capacity=config.max_batch_size,
            stop_token_ids=(FakeEngine.EOS, *config.stop_token_ids),
            num_blocks=config.fake_kv_blocks,
            block_size=config.kv_block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            prefix_caching=config.prefix_caching,
            max_prefill_while_decoding=config.max_prefill_tokens_while_decoding,
        )
    return NativeEngine(config) if uses_native_runtime(config) else HFEngine(config)


def quantized_weights(config: Config) -> bool:
    """Whether the model's weights are served quantized: a GGUF at WEIGHTS=auto, or WEIGHTS=int8 / int4."""
    from models.loading import is_gguf

    return config.weights in ("int8", "int4") or (config.weights == "auto" and is_gguf(config.model_id))


def kv_cache_dtype(config: Config) -> str:
    """The KV pool's elements: KV_CACHE_DTYPE, or for ``auto`` fp32 beside fp32 weights (exact, as the parity gates
    run) and ``AUTO_QUANTIZED_KV`` beside quantized ones (docs/kv-cache.md has the measurements behind it)."""
    if config.kv_cache_dtype != "auto":
        return config.kv_cache_dtype
    return AUTO_QUANTIZED_KV if quantized_weights(config) else "fp32"


AUTO_QUANTIZED_KV = "int8"  # KV_CACHE_DTYPE=auto beside quantized weights


def uses_native_runtime(config: Config) -> bool:
    """RUNTIME=native, or RUNTIME=auto with quantized weights (a GGUF at WEIGHTS=auto, int8, int4) on the CPU
    where the whole-step kernel builds (else auto falls back to torch, and says why)."""
    if config.runtime != "auto":
        return config.runtime == "native"
    quantized = quantized_weights(config)
    if not quantized or config.device not in ("auto", "cpu"):
        return False
    from models.native import unavailable_reason

    reason = unavailable_reason()
    if reason:
        log.warning("RUNTIME=auto: quantized weights run on torch here: %s", reason)
    return reason is None
