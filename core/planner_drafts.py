"""The planner's drafts (speculative decoding, ``core/speculative.py``): after a step's newcomers are placed and its
chunks planned, each decode row may get draft tokens from its proposer, as many as its measured acceptance makes
worth it, within what the token budget has left and from plain free blocks only (a lookahead never evicts a cached
block or preempts anyone). When the output is applied, the slots of the rejected drafts are rolled back, so between
steps no sequence holds a lookahead. A part of ``core.planner.Planner``, whose books it reads."""

from __future__ import annotations

from core.block_manager import BlockManager
from core.sequence import Sequence
from core.speculative import SpecParams, StepCost, cut_drafts, draft_state
from core.step import RowFailure


class DraftBooks:
    """Draft tokens and their lookahead slots, on the planner's books (set up by ``Planner.__init__``)."""

    blocks: BlockManager
    max_context: int
    max_num_batched_tokens: int
    speculative: SpecParams
    spec_disable_batch_size: int
    spec_adaptive: bool
    spec_row_limit: int
    proposers: dict
    step_cost: StepCost  # what a decode step costs by its rows, as measured (update_from_output)

    def _propose(self, rows: list[Sequence], chunk_tokens: int) -> tuple[list[list[int]], list[int]]:
        """Draft tokens for each decode row, and the lookahead slots reserved for an engine-run proposer to fill (a
        draft model: ``EngineProposer``), each ``[]`` when no row has any; within the step's token budget left by
        the decode rows and the ``chunk_tokens`` of prompt chunks (a prompt loading is never slowed by drafts),
        with KV slots reserved for them (``BlockManager.append_lookahead``: plain free blocks only, so a draft
        never evicts a cached block nor preempts anyone); none while ``spec_disable_batch_size`` rows or more
        decode."""
        if not rows or (self.spec_disable_batch_size and len(rows) >= self.spec_disable_batch_size):
            return [], []
        budget = self.max_context
        if self.max_num_batched_tokens:
            budget = self.max_num_batched_tokens - len(rows) - chunk_tokens
        if self.spec_row_limit and len(rows) + chunk_tokens < self.spec_row_limit:
            budget = min(budget, self.spec_row_limit - 1 - len(rows) - chunk_tokens)
        drafts, slots = [], []
        for proposer in self.proposers.values():  # a draft model's measured cost fades between its measurements
            getattr(proposer, "decay", lambda: None)()
        for seq in rows:
            tokens, k = self._drafts_for(seq, budget, len(rows)) if budget > 0 else ([], 0)
            k = self.blocks.append_lookahead(seq.seq_id, len(tokens) or k) if tokens or k else 0
            budget -= k
            drafts.append(tokens[:k])
            slots.append(0 if tokens else k)
        return drafts if any(drafts) or any(slots) else [], slots if any(slots) else []

    def _drafts_for(self, seq: Sequence, budget: int, rows: int) -> tuple[list[int], int]:
        """The proposer's drafts for ``seq`` in a step of ``rows`` decode rows, or for an engine-run proposer how
        many it may propose ((tokens, 0) or ([], k)): as many as its measured acceptance makes worth verifying there
        (``spec_adaptive``; else ``num_tokens``), never past its ``max_tokens`` (the run's last token is sampled,
        not a draft), the context or ``budget``; cut after a stop token (the sequence ends there) and where its
        grammar would reject them (``cut_drafts``)."""
        params = seq.speculation or self.speculative
        proposer = self.proposers.get(params.method) if params.enabled else None
        if proposer is None:  # off, or a method this engine has no proposer for
            return [], 0
        k = params.num_tokens
        if self.spec_adaptive:
            k = draft_state(seq).length.length(k, rows, getattr(proposer, "cost", 0.0), self.step_cost)
        k = min(k, seq.max_new_tokens - len(seq.output_token_ids) - 1, budget)
        k = min(k, self.max_context - seq.num_tokens)
        if k <= 0:
            return [], 0
        if getattr(proposer, "in_engine", False):
            return [], k
        return cut_drafts(seq, proposer.propose(seq, params, k)[:k]), 0

    def _roll_back_lookahead(self, rows: list[Sequence], lookahead: list[int], runs: list | None = None) -> None:
        """Give back the slots of the drafts no row keeps, last row first (the reverse of ``_propose``'s taking, so
        the free list is restored exactly): a row that took tokens keeps slots for all but its newest (as after a
        step without drafts), one that took none (failed, or ``runs`` None: the step did not run) its last token's.
        ``lookahead[i]``: the slots row ``i`` reserved past its last token (``BatchPlan.lookahead``)."""
        for i in reversed(range(len(lookahead))):
            seq = rows[i]
            if not lookahead[i] or seq.seq_id not in self.blocks:
                continue
            took = runs is not None and not isinstance(runs[i], RowFailure)
            self.blocks.rollback(seq.seq_id, seq.num_tokens - 1 if took else seq.num_tokens)
