"""The planner: the KV books and the decision of each step, as data. Torch-free; runs on the event loop.

``Planner`` keeps the books of every admitted sequence: which decode row it has (``rows``), which are still
prefilling their prompt in chunks and how far they got, which choices of an ``n`` > 1 request fork another's
prefill, and the KV blocks each holds (``core.block_manager.BlockManager``). Each step it decides, in one pass:

1. ``schedule(waiting)``: a slot for every running sequence's next token, oldest admission first; while a block
   is missing, the most recently admitted sequence is preempted (vLLM's rule: its blocks are freed, it waits
   again with its tokens and is recomputed on readmission). Then, when nothing was preempted, the oldest waiting
   sequences that fit (a free row, KV blocks for the tokens they do not find in the prefix cache plus a 1%
   watermark) are admitted in the queue's order: FCFS for a plain list; a ``core.fair_queue.FairQueue`` (the
   server's) gives its fair order between clients and requests, and when every row is taken it may name one
   running sequence of a client or request holding more than its share, which the plan preempts so that the next
   in line takes its slot (fair share). The queue never skips its next. A newcomer whose next uncached block is
   being computed right now by a sequence still prefilling (or by one admitted ahead of it) waits instead of
   computing it twice. Then the prompt chunks of the step: decode rows first, then chunks of the prefilling
   sequences, oldest first, within ``max_num_batched_tokens`` (and ``max_prefill_while_decoding`` while rows
   decode). The result is a ``core.step.BatchPlan``.
2. The engine executes the plan (its worker thread) and returns one token per sampled row.
3. ``update_from_output(plan, output)``: the rows take their tokens, chunks advance, full blocks enter the
   prefix cache, forked choices complete, finished sequences leave. This is where sequences change status
   (RUNNING at admission, WAITING when preempted, FINISHED_* through ``Sequence.append_token`` / ``finish``).

Its parts, each a base class of ``Planner`` over the same books: the prefix cache (``core/planner_prefix.py``:
chain hashes, lookups, waiting for a block being computed), newcomers' blocks and the forks of ``n`` > 1 choices
(``core/planner_forks.py``: a choice shares its parent's prefill; a parent that leaves hands its place to its
first child, ``_hand_over``), and speculative drafts (``core/planner_drafts.py``: ``_propose`` reserves lookahead
slots from plain free blocks only, ``_roll_back_lookahead`` gives back the rejected ones, so between steps the
books are what they would be without drafts).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable

from core.block_manager import BlockManager
from core.fair_queue import FairQueue
from core.planner_drafts import DraftBooks
from core.planner_forks import ForkBooks
from core.planner_prefix import PrefixBooks
from core.sequence import Sequence, SequenceStatus
from core.speculative import NgramProposer, SpecParams, SpecStats, StepCost, draft_state
from core.step import AdmissionError, BatchLimits, BatchPlan, Chunk, RowFailure, StepOutput, StepResult

log = logging.getLogger("minibatch.engine")


class Planner(PrefixBooks, ForkBooks, DraftBooks):
    """The books of ``limits.capacity`` rows over a pool of ``limits.num_blocks`` KV blocks of ``limits.block_size``
    tokens (0: enough for every row at ``limits.max_context``, so nothing is ever preempted), and the plan of each
    step. ``limits`` (``core.step.BatchLimits``) is the engine's too: read, never copied."""

    def __init__(self, limits: BatchLimits) -> None:
        self.limits = limits
        num_blocks = limits.num_blocks or limits.capacity * -(-limits.max_context // limits.block_size)
        # Admission leaves 1% of the pool free (vLLM's watermark) so running sequences can grow a little
        # before anyone is preempted.
        self.blocks = BlockManager(
            num_blocks, limits.block_size, num_blocks // 100, enable_caching=limits.prefix_caching
        )
        self.rows: list[Sequence] = []  # the decoding sequences, in row order
        self._admitted: dict[int, int] = {}  # seq_id -> admission serial (the preemption order)
        self._serial = itertools.count()
        self._prefilling: list[Sequence] = []  # admitted, not all tokens computed yet (oldest first)
        self._computed: dict[int, int] = {}  # seq_id -> how many of its tokens are in its blocks
        self._forks: dict[int, list[Sequence]] = {}  # parent seq_id -> choices waiting for its prompt
        self._parent_of: dict[int, Sequence] = {}
        self.prefill_tokens_computed = 0  # tokens fed by prefill chunks (prompt, or recompute), cache hits excluded
        self.num_preemptions = 0  # KV cache full or fair share
        self.num_fair_preemptions = 0  # of those, for another client's or request's fair share
        self.num_forks = 0  # choices that took their prompt from a parent's prefill
        self.num_block_copies = 0  # partial blocks copied for them
        self._steps = 0
        self._peak_batch = 0
        self._tokens = 0
        # Speculative decoding (core/speculative.py): the server's default (a request's own SpecParams wins), no
        # drafts while ``spec_disable_batch_size`` or more rows decode (0: never off: a busy batch is compute-bound
        # and verify rows cost real time there), the proposers by method, and the counters.
        self.speculative = SpecParams()
        self.spec_disable_batch_size = 0
        self.spec_adaptive = True  # each sequence's draft length follows its acceptance (``DraftLength``)
        # Rows at which the engine's step changes its arithmetic (int8 activations from this many rows under
        # ACTIVATIONS=auto; 0: none): drafts never take a step across it, so every token is computed as without them.
        self.spec_row_limit = 0
        self.proposers = {"ngram": NgramProposer()}
        self.step_cost = StepCost()
        self.spec = SpecStats()

    # The limits the books read, by their names (read-only here: change them on ``limits``, the one object).
    capacity = property(lambda self: self.limits.capacity)
    max_context = property(lambda self: self.limits.max_context)
    stop_token_ids = property(lambda self: self.limits.stop_token_ids)
    max_num_batched_tokens = property(lambda self: self.limits.max_num_batched_tokens)  # 0: whole prompts
    max_prefill_while_decoding = property(lambda self: self.limits.max_prefill_while_decoding)
    kv_window = property(lambda self: self.limits.kv_window)  # blocks that left it go back to the pool

    # --- what is admitted ---------------------------------------------------------------------
    def num_active(self) -> int:
        """Sequences holding a slot: decoding, prefilling, or forked and waiting for a parent's prompt."""
        return len(self.rows) + len(self._prefilling) + len(self._parent_of)

    def active_sequences(self) -> list[Sequence]:
        return list(self.rows) + list(self._prefilling) + [c for cs in self._forks.values() for c in cs]

    @property
    def prefilling(self) -> list[Sequence]:
        """Admitted sequences still computing their tokens in chunks, oldest first."""
        return list(self._prefilling)

    def forks_of(self, seq_id: int) -> list[Sequence]:
        """The choices waiting for ``seq_id``'s prompt (they share its blocks)."""
        return list(self._forks.get(seq_id, ()))

    def check_admissible(self, seq: Sequence) -> str | None:
        """Why ``seq`` can never be admitted (empty, longer than the context, more blocks than the pool), or None.
        Cheap; called before queueing."""
        if seq.prompt_len == 0:
            return "prompt is empty after tokenization"
        if seq.prompt_len + seq.max_new_tokens > self.max_context:
            return (
                f"prompt ({seq.prompt_len} tokens) + max_new_tokens ({seq.max_new_tokens}) "
                f"exceeds the model's context window of {self.max_context} tokens"
            )
        total, bm = seq.prompt_len + seq.max_new_tokens, self.blocks
        if bm.blocks_for(total) > bm.num_blocks or not bm.can_ever_allocate(seq.prompt_len):
            return (
                f"prompt ({seq.prompt_len} tokens) + max_new_tokens ({seq.max_new_tokens}) needs "
                f"{bm.blocks_for(total)} KV blocks of {bm.block_size} tokens; the whole KV cache holds "
                f"{bm.num_blocks} blocks ({bm.num_blocks * bm.block_size} tokens, KV_CACHE_MB), "
                f"{bm.watermark_blocks} of them kept free at admission"
            )
        return None

    def can_admit(self, seqs: list[Sequence]) -> bool:
        """Whether ``seqs``, in this order, would all be admitted now (``admissible``)."""
        return len(self.admissible(seqs)) == len(seqs)

    def admissible(self, waiting: Iterable[Sequence], wait_for_prefixes: bool = True) -> list[Sequence]:
        """The longest head of ``waiting`` that fits now, in one pass: free rows; free blocks for the tokens each
        does not find in the prefix cache (a forked choice: its partial block's copy only) plus the watermark,
        after the running sequences took the blocks their next token needs; and (``wait_for_prefixes``, the
        policy) none that computes its prompt had better wait for a prefix being computed."""
        bm = self.blocks
        room = self.capacity - self.num_active()
        need = bm.watermark_blocks + sum(
            bm.blocks_to_append(s.seq_id, max(0, s.num_tokens - bm.num_tokens(s.seq_id))) for s in self.rows
        )
        computing = {s.seq_id for s in self._prefilling}
        chosen: list[Sequence] = []
        for seq in waiting:
            if len(chosen) >= room or self.check_admissible(seq):
                break
            source = self._fork_source(seq, computing)
            cost = bm.fork_cost(seq.num_tokens) if source else bm.admission_cost(seq.num_tokens, self._lookup(seq))
            if need + cost > bm.num_free_blocks:
                break
            if wait_for_prefixes and source is None and self._waits_for_prefix(seq, chosen):
                break
            chosen.append(seq)
            need += cost
            if source is None:
                computing.add(seq.seq_id)
        return chosen

    # --- the plan ------------------------------------------------------------------------------
    def schedule(self, waiting: Iterable[Sequence] | FairQueue, decode: bool = True) -> BatchPlan:
        """The next step: every running sequence's slot (preempting while a block is missing), then, if nothing
        was preempted for blocks, the head of ``waiting`` that fits (``admissible``; a ``FairQueue`` in its
        admission order, after its fair-share preemption, ``_fair_share``), then the step's prompt chunks. The
        caller takes ``plan.newcomers`` out of its queue and puts ``plan.preempted`` at its front."""
        preempted = self._reserve_running() if decode else []
        if preempted:
            return self._plan([], decode, preempted)
        if isinstance(waiting, FairQueue):
            preempted = self._fair_share(waiting)
            waiting = waiting.admission_order(self.active_sequences())
        return self._plan(self.admissible(waiting), decode, preempted)

    def _fair_share(self, queue: FairQueue) -> list[Sequence]:
        """Every row taken and someone waiting: the running sequence the queue's policy gives up for the next in
        its order (``FairQueue.preemption_victim``: a client or request holding at least two slots more, a slot
        held a second or more), preempted here; returns it (or nothing)."""
        if not len(queue) or self.num_active() < self.capacity:
            return []
        active = self.active_sequences()
        head = next(queue.admission_order(active), None)
        victim = None if head is None else queue.preemption_victim(head, active, time.perf_counter())
        if victim is None:
            return []
        self._preempt(victim, "fair share")
        self.num_fair_preemptions += 1
        return [victim]

    def plan(self, newcomers: list[Sequence], decode: bool = True) -> BatchPlan:
        """A step that admits exactly ``newcomers`` (AdmissionError, nothing admitted, if they do not fit) and,
        with ``decode``, advances every decode row."""
        preempted = self._reserve_running() if decode else []
        self._check_newcomers(newcomers)
        return self._plan(newcomers, decode, preempted)

    def _plan(self, newcomers: list[Sequence], decode: bool, preempted: list[Sequence]) -> BatchPlan:
        start = time.perf_counter()
        try:
            for seq, cached in self._place(newcomers):
                self._computed[seq.seq_id] = cached
                self._prefilling.append(seq)
            for seq in newcomers:
                self._admitted.setdefault(seq.seq_id, next(self._serial))
            rows = list(self.rows) if decode else []
            chunks = self._plan_chunks(len(rows))
            drafts, draft_slots = self._propose(rows, sum(c.end - c.start for c in chunks))
        except BaseException:
            self._unplace_all(newcomers)
            raise
        table, bs = self.blocks.block_table, self.blocks.block_size
        ending = [c.seq for c in chunks if c.ends_prompt and c.seq.pooling is None]  # an embedding samples nothing
        forks = {p.seq_id: list(self._forks[p.seq_id]) for p in ending if p.seq_id in self._forks}
        copies = [
            (table(p.seq_id)[p.prompt_len // bs], table(c.seq_id)[p.prompt_len // bs])
            for p in ending
            if p.prompt_len % bs
            for c in forks.get(p.seq_id, ())
        ]
        return BatchPlan(
            decode=rows,
            chunks=chunks,
            tables=[list(table(s.seq_id)) for s in rows] + [list(table(c.seq.seq_id)) for c in chunks],
            newcomers=list(newcomers),
            forks=forks,
            preempted=preempted,
            samples=rows + [x for p in ending for x in (p, *forks.get(p.seq_id, ()))],
            copies=copies,
            drafts=drafts,
            draft_slots=draft_slots,
            start=start,
        )

    def _plan_chunks(self, n_decode: int) -> list[Chunk]:
        """A chunk per prefilling sequence, oldest first, within the budget left after the decode rows (and, when
        rows decode, within ``max_prefill_while_decoding``); every prompt whole when chunking is off."""
        if not self.max_num_batched_tokens:
            return [Chunk(s, self._computed[s.seq_id], s.num_tokens) for s in self._prefilling]
        budget = max(self.max_num_batched_tokens - n_decode, 1)
        if n_decode and self.max_prefill_while_decoding:
            budget = min(budget, self.max_prefill_while_decoding)
        chunks = []
        for seq in self._prefilling:
            if budget <= 0:
                break
            start = self._computed[seq.seq_id]
            end = min(seq.num_tokens, start + budget)
            chunks.append(Chunk(seq, start, end))
            budget -= end - start
        return chunks

    def abandon(self, plan: BatchPlan) -> None:
        """The engine failed on ``plan``: its decode rows give back their drafts' slots and its newcomers hold nothing
        again (its preemptions, and the rows' slots for their next token, stand)."""
        self._roll_back_lookahead(plan.decode, plan.lookahead)
        self._unplace_all(plan.newcomers)

    # --- applying a step's output ----------------------------------------------------------------
    def update_from_output(self, plan: BatchPlan, output: StepOutput, now: float | None = None) -> StepResult:
        """Apply what the engine computed for ``plan``: decode rows take their tokens, chunks advance (their full
        blocks enter the cache), sequences whose prompt is complete take their first token and a row, forked
        choices complete with their parent, finished sequences leave."""
        now = time.perf_counter() if now is None else now
        tokens, n = output.tokens, len(plan.decode)
        for seq in plan.newcomers:
            seq.status = SequenceStatus.RUNNING
            seq.slot_since = plan.start  # fair share preempts only a sequence that held its slot a while
            if seq.admit_time is None:  # a recomputed sequence keeps its first admission time
                seq.admit_time = plan.start
        if plan.decode:
            if output.seconds and not plan.chunks:  # a decode step's cost by its rows: the draft length's bar
                self.step_cost.observe(n + plan.num_draft_tokens, output.seconds)
            self._commit_step(plan.decode, tokens[:n], now, plan.drafts, plan.lookahead)
        done = []
        for seq, begin, end in plan.chunks:
            self._computed[seq.seq_id] = end
            self.prefill_tokens_computed += end - begin
            if end == seq.num_tokens:
                done.append(seq)
            else:
                self._cache_computed(seq, end)
        for seq in done:
            self._prefilling.remove(seq)
            del self._computed[seq.seq_id]
        embedded = [s for s in done if s.pooling is not None]
        self._finish_embedded(embedded, now)
        self._commit_newcomers(self._complete_forks([s for s in done if s.pooling is None]), tokens[n:], now)
        finished = [s for s in self.rows if s.is_finished]
        self._evict(finished)
        return StepResult(finished=embedded + finished, preempted=list(plan.preempted))

    def _finish_embedded(self, seqs: list[Sequence], now: float) -> None:
        """Embeddings whose prompt a forward completed (``core/pooling.py``): their full blocks enter the cache, they
        finish (stopped, or failed when the vector is not finite) and give their blocks back; they never take a row."""
        for seq in seqs:
            if isinstance(seq.embedding, RowFailure):
                seq.finish(SequenceStatus.FINISHED_ERROR, now, error=seq.embedding.reason)
            else:
                self._cache_computed(seq, seq.num_tokens)
                seq.finish(SequenceStatus.FINISHED_STOPPED, now)
            self._admitted.pop(seq.seq_id, None)
            self.blocks.free(seq.seq_id)

    def _commit_step(
        self, rows: list[Sequence], tokens: list, now: float, drafts: list[list[int]], lookahead: list[int]
    ) -> None:
        """Decode rows take their tokens (a verified row its run, cut where the sequence finishes), the rejected
        drafts' slots go back, and the blocks their verified tokens filled enter the cache."""
        taken = [_take(seq, token, now) for seq, token in zip(rows, tokens)]
        if drafts:
            self._roll_back_lookahead(rows, lookahead, tokens)
            for seq, draft, run, n in zip(rows, drafts, tokens, taken):
                if draft:
                    accepted = len(run) - 1 if isinstance(run, list) else 0
                    self.spec.record(len(draft), accepted, n)
                    draft_state(seq).length.update(len(draft), accepted)
        for seq in rows:
            self._cache_fed(seq)
        self._steps += 1
        self._tokens += sum(taken)
        self._peak_batch = max(self._peak_batch, len(self.rows))

    def _commit_newcomers(self, seqs: list[Sequence], first_tokens: list[int | RowFailure], now: float) -> None:
        """Sequences whose prompt a forward completed take rows, with their first tokens."""
        self.rows.extend(seqs)
        for seq, token in zip(seqs, first_tokens):
            seq.status = SequenceStatus.RUNNING
            if not seq.ignore_eos:
                seq.stop_token_ids = seq.stop_token_ids | self.stop_token_ids
            _take(seq, token, now)
            self._cache_fed(seq)
        self._tokens += len(seqs)
        self._peak_batch = max(self._peak_batch, len(self.rows))

    def _cache_fed(self, seq: Sequence) -> None:
        """After a forward fed every token of ``seq`` but its newest: cache its full blocks, unless it failed
        (its K/V may be garbage: never shared)."""
        if seq.status is not SequenceStatus.FINISHED_ERROR:
            self._cache_computed(seq, seq.num_tokens - 1)

    # --- growth and preemption -------------------------------------------------------------------
    def _reserve_running(self) -> list[Sequence]:
        """A slot for every running sequence's next token, oldest admission first; while a block is missing,
        preempt the most recently admitted (possibly the one that needs it). Returns the preempted."""
        preempted: list[Sequence] = []
        for seq in sorted(self.rows, key=lambda s: self._admitted[s.seq_id]):
            if seq.seq_id not in self._admitted:  # preempted meanwhile
                continue
            need = seq.num_tokens - self.blocks.num_tokens(seq.seq_id)
            if need <= 0:
                continue
            while not self.blocks.can_append(seq.seq_id, need):
                victim = max(self.active_sequences(), key=lambda s: self._admitted[s.seq_id])
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.blocks.append_slots(seq.seq_id, need)
        return preempted

    def _preempt(self, seq: Sequence, why: str = "KV cache full") -> None:
        """Free the sequence's blocks and row; it waits again with its tokens (recomputed on readmission)."""
        if seq.seq_id in self._parent_of:
            self._drop_fork(seq)
        elif seq in self._prefilling:
            self._drop_prefilling(seq)
        else:
            self._evict([seq])
        seq.status = SequenceStatus.WAITING
        if seq.grammar is not None:
            seq.grammar.release()  # its matcher's memory goes; replayed from its tokens on readmission
        self.num_preemptions += 1
        log.info("preempted sequence %d (%d tokens): %s", seq.seq_id, seq.num_tokens, why)

    def _check_newcomers(self, seqs: list[Sequence]) -> None:
        if self.num_active() + len(seqs) > self.capacity:
            raise AdmissionError(f"{len(seqs)} newcomers exceed free capacity {self.capacity - self.num_active()}")
        for seq in seqs:
            reason = self.check_admissible(seq)
            if reason:
                raise AdmissionError(f"sequence {seq.seq_id}: {reason}")
        if len(self.admissible(seqs, wait_for_prefixes=False)) < len(seqs):
            raise AdmissionError(
                f"{len(seqs)} newcomers need {sum(self.blocks.blocks_for(s.num_tokens) for s in seqs)} KV blocks; "
                f"{self.blocks.num_free_blocks} of {self.blocks.num_blocks} are free"
            )

    # --- leaving -----------------------------------------------------------------------------------
    def abort(self, seq_id: int) -> Sequence | None:
        """Free an admitted sequence's slot and blocks; it finishes as aborted unless it already has a finished
        status. Returns it (None if not admitted)."""
        seq = next((s for s in [*self.rows, *self._prefilling] if s.seq_id == seq_id), None)
        parent = self._parent_of.get(seq_id)
        if seq is None and parent is not None:
            seq = next(c for c in self._forks[parent.seq_id] if c.seq_id == seq_id)
        if seq is None:
            return None
        seq.finish(SequenceStatus.FINISHED_ABORTED)
        if parent is not None:
            self._drop_fork(seq)
        elif seq in self._prefilling:
            self._drop_prefilling(seq)
        else:
            self._evict([seq])
        return seq

    def reset(self) -> None:
        """Forget every admitted sequence (after a failure); the prefix cache goes too, since a failed call may
        have left blocks half written."""
        self.rows.clear()
        self._prefilling.clear()
        self._computed.clear()
        self._forks.clear()
        self._parent_of.clear()
        self._admitted.clear()
        bm = self.blocks
        self.blocks = BlockManager(bm.num_blocks, bm.block_size, bm.watermark_blocks, bm.enable_caching)
        self.blocks.queried_tokens, self.blocks.hit_tokens = bm.queried_tokens, bm.hit_tokens

    def _evict(self, leaving: list[Sequence]) -> None:
        """Free the rows and blocks of ``leaving``; the survivors stay in rows [0, n), tail rows moved into the
        holes (a row's K/V lives in its blocks, so a move is only a new row number)."""
        if not leaving:
            return
        for seq in leaving:
            self._admitted.pop(seq.seq_id, None)
            if seq.seq_id in self.blocks:
                self.blocks.free(seq.seq_id)
        gone = {self.rows.index(s) for s in leaving}
        keep = len(self.rows) - len(gone)
        holes = sorted(r for r in gone if r < keep)
        movers = [r for r in range(keep, len(self.rows)) if r not in gone]
        for src, dst in zip(movers, holes):
            self.rows[dst] = self.rows[src]
        del self.rows[keep:]

    def stats(self) -> dict[str, int]:
        return {
            "steps": self._steps,
            "peak_batch": self._peak_batch,
            "generated_tokens": self._tokens,
            "kv_blocks": self.blocks.num_blocks,
            "kv_free_blocks": self.blocks.num_free_blocks,
            "kv_block_size": self.blocks.block_size,
            "num_preemptions": self.num_preemptions,
            "num_fair_preemptions": self.num_fair_preemptions,
            "num_prefilling": len(self._prefilling) + len(self._parent_of),  # forked choices wait for a prefill
            "kv_cached_blocks": self.blocks.num_cached_blocks,
            "prefix_cache_queries": self.blocks.queried_tokens,
            "prefix_cache_hits": self.blocks.hit_tokens,
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "spec_num_drafts": self.spec.num_drafts,
            "spec_num_draft_tokens": self.spec.num_draft_tokens,
            "spec_num_accepted_tokens": self.spec.num_accepted_tokens,
            "spec_num_emitted_tokens": self.spec.num_emitted_tokens,
        }


def _take(seq: Sequence, token: int | list[int] | RowFailure, now: float) -> int:
    """A row's result: its next token, the run of tokens a verified row emits (those past the one that finishes the
    sequence are dropped, with their logprobs), or its failure (it finishes with the error; the caller evicts it).
    Returns how many tokens it took."""
    if isinstance(token, RowFailure):
        seq.finish(SequenceStatus.FINISHED_ERROR, now, error=token.reason)
        return 0
    if not isinstance(token, list):
        seq.append_token(token, now)
        return 1
    before = len(seq.output_token_ids)
    for t in token:
        if seq.is_finished:
            break
        seq.append_token(t, now)
    if seq.logprobs is not None:
        del seq.output_logprobs[len(seq.output_token_ids) :]
    return len(seq.output_token_ids) - before
