"""The mixed batch: where each token of one forward sits. B decode tokens (one per active row ``[0, B)``, each at its
own position) and the prompt chunks packed after them, ``[B + T]`` with no padding; each token's KV slot, the
decode rows' block tables, and the rows whose logits (or hidden states) are wanted."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MixedBatch:
    """Where each token of one mixed forward sits: B decode tokens first, then the prompt chunks back to back.

    Every token also has a KV slot (block id, offset in the block) from its sequence's block table.
    A prompt chunk covers positions [start, start + n) of its sequence; ``start`` > 0 when a prompt
    is prefilled over several steps (its earlier positions are already in its blocks).
    Built once per forward, used by every layer.
    """

    ids: torch.Tensor  # [B + T] token ids
    pos: torch.Tensor  # [B + T] positions
    slot_blocks: torch.Tensor  # [B + T] block id of each token's KV slot
    slot_offsets: torch.Tensor  # [B + T] offset of each token's KV slot in its block
    n_decode: int  # B: the decode tokens are rows [0, B) of the activation
    # [B, max_blocks] int32 of the decode rows (padded with 0), None when B = 0; built ``for_step``: [B + P,
    # max_blocks], the P chunks' tables after the decode rows'.
    block_tables: torch.Tensor | None
    context_lens: torch.Tensor | None  # [B] int32: decode row b attends positions [0, pos[b]]
    prompts: list[tuple[int, int, int, torch.Tensor]]  # per chunk: (first activation row, length, start, table)
    sample_rows: torch.Tensor | None  # rows whose logits are needed; None = every row (no prompts)
    lean: bool = False  # decode rows only, few enough for the lean path (MixedForward.forward sets it)
    row_tables: torch.Tensor | None = None  # built ``for_step`` with prompts: [B + T] int32, each row's table
    hidden_rows: torch.Tensor | None = None  # rows whose final hidden states are wanted (chunks flagged ``hidden``)

    @classmethod
    def build(
        cls,
        token_ids: list[int],
        positions: list[int],
        tables: list[list[int]],
        prompts: list[list[int]],
        prompt_tables: list[list[int]],
        prompt_starts: list[int],
        block_size: int,
        device: torch.device,
        every_position: list[bool] = (),
        for_step: bool = False,
        hidden: list[bool] = (),
    ) -> MixedBatch:
        """``every_position[i]``: chunk i's logits are wanted at all its positions, not only the last
        (prompt logprobs); ``hidden[i]``: none of its logits, its final hidden states at every position instead
        (``hidden_rows``). ``for_step``: the batch goes to the whole-step kernel (``fused_step``), which
        reads every row's table through ``block_tables`` and ``row_tables``."""
        B = len(token_ids)
        lengths = [len(p) for p in prompts]
        starts = [B + sum(lengths[:i]) for i in range(len(lengths))]
        ids = torch.tensor(list(token_ids) + [t for p in prompts for t in p], dtype=torch.long)
        pos = list(positions) + [s + i for s, n in zip(prompt_starts, lengths) for i in range(n)]
        blocks = [table[p // block_size] for table, p in zip(tables, positions)]
        for table, start, n in zip(prompt_tables, prompt_starts, lengths):
            blocks += [table[p // block_size] for p in range(start, start + n)]
        block_tables = context_lens = row_tables = None
        all_tables = list(tables) + list(prompt_tables) if for_step else tables
        if all_tables:
            width = max(len(t) for t in all_tables)
            block_tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in all_tables], dtype=torch.int32)
        if B:
            context_lens = torch.tensor(positions, dtype=torch.int32) + 1
        if for_step and prompts:  # row -> table: decode row b reads table b, chunk i's rows table B + i
            counts = torch.tensor([1] * B + lengths)
            row_tables = torch.repeat_interleave(torch.arange(B + len(prompts), dtype=torch.int32), counts)
        full = list(every_position) or [False] * len(prompts)
        pooled = list(hidden) or [False] * len(prompts)
        spans = [
            [] if h else range(s, s + n) if f else [s + n - 1] for s, n, f, h in zip(starts, lengths, full, pooled)
        ]
        sample = [*range(B), *(r for span in spans for r in span)] if prompts else None
        states = [r for s, n, h in zip(starts, lengths, pooled) if h for r in range(s, s + n)]
        pos_t = torch.tensor(pos, dtype=torch.long)
        return cls(
            ids.to(device),
            pos_t.to(device),
            torch.tensor(blocks, dtype=torch.long, device=device),
            (pos_t % block_size).to(device),
            B,
            block_tables,
            context_lens,
            [
                (r, n, s, torch.tensor(t, dtype=torch.long, device=device))
                for r, n, s, t in zip(starts, lengths, prompt_starts, prompt_tables)
            ],
            torch.tensor(sample, device=device, dtype=torch.long) if sample is not None else None,
            row_tables=row_tables,
            hidden_rows=torch.tensor(states, device=device, dtype=torch.long) if states else None,
        )
