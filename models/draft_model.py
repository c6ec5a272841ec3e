"""A draft model: a smaller model with the target's tokenizer proposing the drafts of speculative decoding. No torch.

vLLM's ``draft_model`` method inside our continuous batching. ``SPECULATIVE_MODEL`` names it (a MODEL_ID, loaded as
the target is, on the same runtime kind: ``models.runtime.attach_draft_model``); it is served in the same process,
with its own KV pool and its own block books (``core.block_manager.BlockManager``), and it runs on the engine's
worker thread before each target forward (``InferenceEngine.execute`` -> ``DraftModel.propose``):

1. for the plan's decode rows that the planner gave lookahead slots (``BatchPlan.draft_slots``), it catches its KV
   up on the tokens the target accepted since it last saw the sequence: one batched forward over those rows (a
   chunk each, or a decode row where only the last token is new), whose logits give each row's first draft;
2. then it proposes greedily, one batched one-row forward per further draft, feeding each row its previous draft
   (their mean wall time, ``forward_seconds``, is what one more draft costs: the engine hands it to the planner's
   draft length, ``core.speculative.EngineProposer.cost``);
3. the drafts, cut after a stop token and where the row's grammar rejects them (``cut_drafts``), go into
   ``plan.drafts``; the target verifies them as it verifies any drafts (``ModelEngine._verify``).

Rollback: the draft's K/V at positions past what the target accepted is simply overwritten next time. Each sequence
remembers the tokens it fed past the last verified position (``_Fed``); the next step keeps the draft's K/V up to
where they agree with the sequence's tokens and recomputes from there, and its books shrink to what that step
needs (``BlockManager.rollback``). A sequence that left (finished, aborted, preempted) frees its draft blocks at the
next step (``_release_gone``); a preempted one catches up from its first token when it drafts again, a forked
choice (n > 1) from its own first token. A row the draft cannot serve this step (its pool full, its context past
the draft's, a catch-up longer than the step's share, a failed draft forward) gets no drafts and decodes as
without them. Greedy drafts for every row, sampled ones included: the target's own draw decides what is accepted
(docs/speculative.md "Exact").
"""

from __future__ import annotations

import logging
import time

import numpy as np

from core.block_manager import BlockManager, NoFreeBlocksError
from core.sequence import Sequence, SequenceStatus
from core.speculative import cut_drafts
from core.step import BatchPlan

log = logging.getLogger("minibatch.engine")


class _Fed:
    """What one sequence has in the draft's KV: its tokens ``[0, verified)`` as the target holds them, then
    ``tail``, the drafts fed after them (positions ``verified ..``), right only as far as the target accepted them."""

    __slots__ = ("seq", "verified", "tail")

    def __init__(self, seq: Sequence) -> None:
        self.seq, self.verified, self.tail = seq, 0, []

    def valid(self) -> int:
        """Positions whose K/V in the draft's pool hold the sequence's own tokens now."""
        seq, n = self.seq, self.verified
        prompt, output, plen = seq.prompt_token_ids, seq.output_token_ids, seq.prompt_len
        for token in self.tail:
            if n >= seq.num_tokens or (prompt[n] if n < plen else output[n - plen]) != token:
                break
            n += 1
        return n


class DraftModel:
    """Proposes drafts with ``engine``'s model (a ``model_engine.ModelEngine`` built for the draft checkpoint: its
    model and KV pool; its planner is not used). ``catch_up_tokens``: most tokens one step's catch-up feeds over all
    rows (0: no cap), so that a long prompt reaching its first decode step delays that step by a bounded amount: a
    row whose catch-up does not fit proceeds over the next steps, without drafts until it is caught up."""

    def __init__(self, engine, name: str, catch_up_tokens: int = 0) -> None:
        self.engine, self.name, self.catch_up_tokens = engine, name, catch_up_tokens
        pool = engine.planner.blocks
        self.blocks = BlockManager(pool.num_blocks, pool.block_size, 0, enable_caching=False)
        self.max_context = engine.max_context
        self._fed: dict[int, _Fed] = {}
        self.forwards = 0  # draft forward calls
        self.unserved = 0  # rows given no drafts because the draft's pool had no room for them
        self.tokens_fed = 0  # tokens through the draft model (catch-up and drafts)
        self.seconds = 0.0  # wall time of ``propose`` (the draft's share of a step)
        # The last step's mean wall time of a one-row-per-sequence draft forward (what one more draft costs; the
        # catch-up forward is left out: its length is the text's, not the draft's), None when none ran.
        self.forward_seconds: float | None = None

    # --- the engine's Drafter seam ------------------------------------------------------------------
    def propose(self, plan: BatchPlan) -> None:
        """Fill ``plan.drafts`` for the rows with ``plan.draft_slots`` (see the module docstring)."""
        self._release_gone()
        self.forward_seconds = None
        rows = [i for i, k in enumerate(plan.draft_slots) if k]
        if not rows:
            return
        start = time.perf_counter()
        if not plan.drafts:
            plan.drafts = [[] for _ in plan.decode]
        try:
            for i, tokens in self._propose([plan.decode[i] for i in rows], [plan.draft_slots[i] for i in rows]):
                plan.drafts[rows[i]] = cut_drafts(plan.decode[rows[i]], tokens)
        except Exception:  # the target decodes these rows without drafts; their draft KV is recomputed
            log.exception("the draft model %s failed; these rows decode without drafts this step", self.name)
            for i in rows:
                plan.drafts[i] = []
                self._free(plan.decode[i].seq_id)
        self.seconds += time.perf_counter() - start

    def reset(self) -> None:
        bm = self.blocks
        self.blocks = BlockManager(bm.num_blocks, bm.block_size, 0, enable_caching=False)
        self._fed.clear()

    def stats(self) -> dict[str, int]:
        return {
            "spec_draft_model_forwards": self.forwards,
            "spec_draft_model_tokens": self.tokens_fed,
            "spec_draft_model_unserved_rows": self.unserved,
            "spec_draft_model_ms": round(self.seconds * 1000),
            "spec_draft_model_kv_free_blocks": self.blocks.num_free_blocks,
            "spec_draft_model_kv_blocks": self.blocks.num_blocks,
        }

    # --- proposing --------------------------------------------------------------------------------------
    def _propose(self, seqs: list[Sequence], slots: list[int]) -> list[tuple[int, list[int]]]:
        """(index into ``seqs``, its greedy drafts) for each sequence the draft serves this step."""
        budget = self.catch_up_tokens or self.max_context * len(seqs)
        rows, chunks, ks = [], [], []  # served sequences' indices, the tokens each feeds first, drafts each wants
        for i, (seq, k) in enumerate(zip(seqs, slots)):
            n = seq.num_tokens
            k = min(k, self.max_context - n)
            if k <= 0:
                continue
            fed = self._fed.get(seq.seq_id)
            if fed is None:
                fed = self._fed[seq.seq_id] = _Fed(seq)
            begin = min(fed.valid(), n - 1)  # the last token is always fed: its logits give the first draft
            end = min(n, begin + max(budget, 1))
            if end < n:  # not caught up within this step's share: feed what fits, no drafts yet
                k = 0
            if not self._reserve(seq.seq_id, end + max(k - 1, 0)):
                self._free(seq.seq_id)
                self.unserved += 1
                continue
            budget -= end - begin
            fed.verified, fed.tail = end, []
            rows.append(i)
            chunks.append((begin, end))
            ks.append(k)
        if not rows:
            return []
        logits = self._catch_up([seqs[i] for i in rows], chunks)
        drafts = [[t] if k else [] for t, k in zip(logits.argmax(axis=1).tolist(), ks)]
        spent = []  # the wall time of each further draft's forward
        for j in range(1, max(ks)):  # the j-th further draft: each going row feeds its previous one
            # (a row whose last draft is a stop token stops there: the sequence would end, nothing after is verified)
            going = [
                r for r, (d, k) in enumerate(zip(drafts, ks)) if k > j and d[-1] not in seqs[rows[r]].stop_token_ids
            ]
            if not going:
                break
            seqs_j = [seqs[rows[r]] for r in going]
            fed_tokens = [drafts[r][-1] for r in going]
            positions = [s.num_tokens - 1 + j for s in seqs_j]
            tables = [self.blocks.block_table(s.seq_id) for s in seqs_j]
            t0 = time.perf_counter()
            nxt = self._forward(fed_tokens, positions, tables).argmax(axis=1).tolist()
            spent.append(time.perf_counter() - t0)
            for r, token, fed_token in zip(going, nxt, fed_tokens):
                self._fed[seqs[rows[r]].seq_id].tail.append(fed_token)
                drafts[r].append(token)
        if spent:
            self.forward_seconds = sum(spent) / len(spent)
        return [(i, d) for i, d in zip(rows, drafts) if d]

    def _catch_up(self, seqs: list[Sequence], chunks: list[tuple[int, int]]) -> np.ndarray:
        """One forward feeding each sequence's tokens [begin, end) (a decode row where that is one token, a chunk
        otherwise) -> the logits at each one's last position [len(seqs), V], in ``seqs``' order."""
        single = [i for i, (b, e) in enumerate(chunks) if e - b == 1]
        multi = [i for i, (b, e) in enumerate(chunks) if e - b > 1]
        table = self.blocks.block_table
        logits = self._forward(
            [_token(seqs[i], chunks[i][0]) for i in single],
            [chunks[i][0] for i in single],
            [table(seqs[i].seq_id) for i in single],
            [(seqs[i].prompt_token_ids + seqs[i].output_token_ids)[slice(*chunks[i])] for i in multi],
            [table(seqs[i].seq_id) for i in multi],
            [chunks[i][0] for i in multi],
        )
        order = {r: j for j, r in enumerate(single + multi)}
        return logits[[order[r] for r in range(len(seqs))]]

    def _forward(self, token_ids, positions, tables, prompts=(), prompt_tables=(), starts=()) -> np.ndarray:
        """The draft model's forward (``RowsForward.forward_rows``: decode rows, then chunks) -> float32 logits
        [rows, V] (numpy: the decode rows', then each chunk's last position's)."""
        self.forwards += 1
        self.tokens_fed += len(token_ids) + sum(map(len, prompts))
        return self.engine.model.forward_rows(token_ids, positions, tables, prompts, prompt_tables, starts)

    # --- the draft's books --------------------------------------------------------------------------------
    def _reserve(self, seq_id: int, num_tokens: int) -> bool:
        """The sequence's draft blocks cover exactly ``num_tokens`` positions (grown or shrunk); False when the draft's
        pool has no room."""
        bm = self.blocks
        try:
            if seq_id not in bm:
                bm.allocate(seq_id, num_tokens)
            elif num_tokens > bm.num_tokens(seq_id):
                bm.append_slots(seq_id, num_tokens - bm.num_tokens(seq_id))
            else:
                bm.rollback(seq_id, num_tokens)
        except NoFreeBlocksError:
            return False
        return True

    def _release_gone(self) -> None:
        """Free the draft blocks of the sequences that left the batch (finished, aborted, preempted)."""
        for seq_id, fed in list(self._fed.items()):
            if fed.seq.is_finished or fed.seq.status is SequenceStatus.WAITING:
                self._free(seq_id)

    def _free(self, seq_id: int) -> None:
        self._fed.pop(seq_id, None)
        if seq_id in self.blocks:
            self.blocks.free(seq_id)

    @property
    def num_sequences(self) -> int:
        """Sequences holding draft blocks."""
        return len(self._fed)


def _token(seq: Sequence, position: int) -> int:
    return (
        seq.prompt_token_ids[position] if position < seq.prompt_len else seq.output_token_ids[position - seq.prompt_len]
    )
