"""One step's rows as every runtime reads them (numpy, torch-free): B decode tokens, then each prompt chunk's tokens
back to back, N rows with no padding, and each row's KV slot and block table.

Built once per step by the engine (``StepLayout.build``, vectorized; ``models.model_engine.ModelEngine._forward``),
checked against what the runner's kernels may touch (its ``step_limits``), then handed to the runner's ``forward``
and read as it is: the whole-step kernel call (``models.kernels.step_abi.StepKernel.run``, both runtimes) passes its
arrays' addresses, the torch forward's per-layer path views them zero-copy
(``models.mixed_batch.MixedBatch.from_layout``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepLimits:
    """What a step's ids, positions and blocks must lie within. ``embed_rows`` (token table rows),
    ``context_window`` (RoPE / position table rows) and ``kv_window`` (every layer's sliding window, 0: none) are
    None where the runner leaves that check to its own indexing (the torch forward)."""

    block_size: int
    num_blocks: int
    embed_rows: int | None = None
    context_window: int | None = None
    kv_window: int | None = None


class StepLayout:
    """One step's rows: N rows, decode tokens then each chunk's (B decode rows, P chunks).

    ids, pos, slot_blocks, slot_offsets: [N] int64; tables [B + P, width] int32 (decode rows' tables, then the
    chunks'; padded with 0), table_lens [B + P] int64; row_table [N] int32 (row -> its table); chunk_rows [P] int64
    (each chunk's first row); sample: int64 rows whose logits are wanted, in order, or None (no prompts: every row);
    hidden: int64 rows whose final hidden states are wanted (the chunks flagged ``hidden``: every row of theirs,
    none of them sampled), or None (no chunk flagged).
    """

    __slots__ = (
        "n",
        "n_decode",
        "ids",
        "pos",
        "slot_blocks",
        "slot_offsets",
        "tables",
        "table_lens",
        "row_table",
        "chunk_rows",
        "sample",
        "n_sample",
        "hidden",
    )

    @classmethod
    def build(
        cls,
        limits: StepLimits,
        token_ids,
        positions,
        tables,
        prompts,
        prompt_tables,
        starts,
        every=(),
        hidden=(),
    ) -> StepLayout:
        """``ModelRunner.forward``'s arguments -> the step's rows; ValueError for arguments that do not fit
        ``limits``, the tables or each other."""
        B, P = len(token_ids), len(prompts)
        starts = [0] * P if starts is None else list(starts)
        if len(positions) != B or len(tables) != B or len(prompt_tables) != P or len(starts) != P:
            raise ValueError("token_ids, positions and tables, and prompts, prompt_tables and prompt_starts differ")
        if every and len(every) != P:
            raise ValueError(f"every_position has {len(every)} entries for {P} prompts")
        if hidden and len(hidden) != P:
            raise ValueError(f"hidden has {len(hidden)} entries for {P} prompts")
        lengths = np.fromiter(map(len, prompts), np.int64, P)
        if P and lengths.min() < 1:
            raise ValueError("an empty prompt chunk")
        self = cls()
        n = self.n = B + int(lengths.sum())
        self.n_decode = B
        counts = np.concatenate([np.ones(B, np.int64), lengths])
        self.row_table = np.repeat(np.arange(B + P, dtype=np.int32), counts)
        self.ids = np.fromiter(itertools.chain(token_ids, *prompts), np.int64, n)
        first = self.chunk_rows = B + np.cumsum(lengths) - lengths
        self.pos = np.empty(n, np.int64)
        self.pos[:B] = positions
        self.pos[B:] = np.repeat(np.asarray(starts, np.int64) - first, lengths) + np.arange(B, n)
        self.tables, self.table_lens = _pad_tables(list(tables) + list(prompt_tables))
        self._check(limits)
        self.slot_blocks = self.tables[self.row_table, self.pos // limits.block_size].astype(np.int64)
        self.slot_offsets = self.pos % limits.block_size
        self.hidden = None
        if not P:
            self.sample, self.n_sample = None, n
            return self
        wanted = np.zeros(n, bool)
        wanted[:B] = True
        wanted[first + lengths - 1] = True
        if every:
            wanted[B:] |= np.repeat(np.asarray(every, bool), lengths)
        if any(hidden):  # a flagged chunk's rows: hidden states, no logits
            pooled = np.concatenate([np.zeros(B, bool), np.repeat(np.asarray(hidden, bool), lengths)])
            wanted &= ~pooled
            self.hidden = np.flatnonzero(pooled).astype(np.int64)
        self.sample = np.flatnonzero(wanted).astype(np.int64)
        self.n_sample = len(self.sample)
        return self

    def row_slots(self, loras) -> np.ndarray | None:
        """Each row's adapter slot [N] int64 from ``loras``, one per decode row then chunk (-1: the base), or None
        for None; ValueError when ``loras`` is not one per decode row and chunk."""
        if loras is None:
            return None
        want = len(self.table_lens)
        if len(loras) != want:
            raise ValueError(f"loras: one adapter slot per decode row and chunk ({want}), not {len(loras)}")
        return np.asarray(loras, np.int64)[self.row_table]

    def _check(self, limits: StepLimits) -> None:
        """Every id, position and block inside what the kernels may touch (a bad one would read or write out of
        bounds)."""
        if self.n and limits.embed_rows is not None and (self.ids.min() < 0 or self.ids.max() >= limits.embed_rows):
            raise ValueError(f"token ids must lie in [0, {limits.embed_rows})")
        window = limits.context_window
        if self.n and window is not None and (self.pos.min() < 0 or self.pos.max() >= window):
            raise ValueError(f"positions must lie in [0, {window}) (the context window)")
        if self.n and self.pos.min() < 0:
            raise ValueError("positions must not be negative")
        if self.n and np.any(self.pos // limits.block_size >= self.table_lens[self.row_table]):
            raise ValueError("a block table does not cover its tokens' positions")
        if not self.tables.size:  # no rows
            return
        if self.tables.max() >= limits.num_blocks:
            raise ValueError(f"block ids must lie in [0, {limits.num_blocks})")
        if limits.kv_window is not None and self.tables.min() < 0 and np.any(self._read(limits) < 0):
            raise ValueError(f"block ids must lie in [0, {limits.num_blocks})")

    def _read(self, limits: StepLimits) -> np.ndarray:
        """The table entries the rows read: from the block of each row's first key (its sliding window's, when every
        layer has one: entries before it may be released) to its own position's. -> their block ids, flat."""
        bs, window = limits.block_size, limits.kv_window
        first = np.maximum(self.pos - window + 1, 0) // bs if window else np.zeros_like(self.pos)
        cols = np.arange(self.tables.shape[1])
        wanted = (cols >= first[:, None]) & (cols <= (self.pos // bs)[:, None])  # [N, width]
        return self.tables[self.row_table][wanted]


def _pad_tables(tables: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Block tables -> ([len(tables), max length] int32, each padded with 0; their lengths [len(tables)] int64)."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    out = np.zeros((len(tables), max(int(lens.max()) if len(tables) else 0, 1)), np.int32)
    out[np.arange(out.shape[1]) < lens[:, None]] = np.fromiter(itertools.chain(*tables), np.int64, int(lens.sum()))
    return out, lens
